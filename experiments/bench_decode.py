"""The paper's table on our models: tau, tokens/s and speedup of chain and ddtree over ar, per budget B.

  python experiments/bench_decode.py --target=checkpoints/target --drafter=checkpoints/drafter \
      --tokenizer=checkpoints/tokenizer.json --num_prompts=32 --batch_sizes=1,8 --temperatures=0,1
An HF model directory with a DFlash drafter directory, tokenized by the model's own tokenizer, on a mesh:
  python experiments/bench_decode.py --target=K26_DIR --drafter=DFLASH_DIR --tokenizer=K26_DIR --mesh=tp=8
The budget chosen each round (kdtree_jax/budget.py) beside fixed budgets, greedy and sampled, batch 1 to 32:
  python experiments/bench_decode.py --budgets=auto,8,32 --temperatures=0,0.7,1 --batch_sizes=1,8,32

Prompts come from held-out stdlib files only. Every policy runs the same prompts in the same process, one after the
other (ar first, as the peer); compile time is excluded (each spec is warmed up on the first batch). At T = 0 every
output is checked identical to ar. Writes a JSON (--out) and a plot of tau and speedup against B (--plot), with the
budgets an auto run verified round by round. `auto` rows: budget "auto", `budget_hist` {B: batch rounds},
`budget_rounds` (B per round of the first batch), `costs` (the step costs it chose by, calibrated on the first batch
before the timed runs; `setup_s` includes that and the compile).
"""
from __future__ import annotations

import json
import os
import platform
import time

import jax
import numpy as np
from absl import flags, logging

from kdtree_jax import budget as budget_lib
from kdtree_jax import cli, model_dir, plots, sharding
from kdtree_jax.data import eval_prompts
from kdtree_jax.tokenizer import load_tokenizer
from kdtree_jax.decode import DecodeSpec, Decoder, agreeing_prefix, decode_in_batches

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/target", "target: a checkpoint directory of ours or an HF model directory")
flags.DEFINE_string("drafter", "checkpoints/drafter", "drafter: a checkpoint directory of ours or a DFlash drafter "
                    "directory in the published format")
flags.DEFINE_string("tokenizer", "checkpoints/tokenizer.json", "the project's tokenizers JSON, or a model directory "
                    "(tiktoken.model or tokenizer.json)")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "run the models in this dtype (default: the checkpoint's)")
flags.DEFINE_string("mesh", "", "device mesh, e.g. 'tp=8' (empty: one device); the target is read into its shards")
flags.DEFINE_integer("num_prompts", 32, "held-out prompts")
flags.DEFINE_integer("prompt_tokens", 64, "tokens per prompt")
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per prompt")
flags.DEFINE_list("budgets", ["4", "8", "16", "32", "64", "128", "256"], "ddtree budgets B; 'auto': chosen each "
                  "round among --auto_budgets")
flags.DEFINE_list("auto_budgets", [str(b) for b in budget_lib.DEFAULT_CANDIDATES], "the budgets an auto run "
                  "compiles, 0 = an AR round")
flags.DEFINE_list("batch_sizes", ["1", "8"], "streams decoded together")
flags.DEFINE_list("temperatures", ["0", "1"], "sampling temperatures")
flags.DEFINE_integer("topk", None, "ddtree candidates per depth (default min(B, V)); <= 16 keeps XLA:GPU's top-k "
                     "off the whole-row sort")
flags.DEFINE_integer("rounds_per_check", 1, "rounds of the decode loop between reads of its stop condition "
                     "(DecodeSpec.rounds_per_check)")
flags.DEFINE_integer("seed", 0, "prompt choice and sampling seed")
flags.DEFINE_string("out", "experiments/results/decode.json", "JSON output")
flags.DEFINE_string("plot", "experiments/results/decode.png", "PNG of tau and speedup vs B ('' to skip)")
flags.DEFINE_float("time_budget_s", None, "start no (temperature, batch) group after this many seconds; the JSON "
                   "and plot are rewritten after every group, so a run cut short keeps the groups it finished")


def main(argv):
    del argv
    tokenizer = load_tokenizer(FLAGS.tokenizer)
    mesh = sharding.parse_mesh(FLAGS.mesh)
    target = model_dir.load_target(FLAGS.target, dtype=FLAGS.dtype, mesh=mesh)
    drafter = model_dir.load_drafter(FLAGS.drafter, target.cfg, mesh=mesh)
    eos = model_dir.eos_token_id(FLAGS.target, target.cfg)
    decoder = Decoder(target, drafter, mesh=mesh)
    prompts = [list(p.ids) for p in eval_prompts(tokenizer, FLAGS.num_prompts, FLAGS.prompt_tokens, seed=FLAGS.seed)]
    block = drafter.cfg.block_size
    meta = {"device": str(jax.devices()[0]), "backend": jax.default_backend(), "jax": jax.__version__,
            "dtype": target.cfg.dtype, "target": FLAGS.target, "drafter": FLAGS.drafter, "mesh": FLAGS.mesh,
            "host": platform.node(), "num_prompts": len(prompts), "prompt_tokens": FLAGS.prompt_tokens,
            "max_new_tokens": FLAGS.max_new_tokens, "block_size": block,
            "rounds_per_check": FLAGS.rounds_per_check, "topk": FLAGS.topk, "auto_budgets": FLAGS.auto_budgets,
            "skipped_groups": []}
    rows, start = [], time.monotonic()
    for temperature in map(float, FLAGS.temperatures):
        for batch in map(int, FLAGS.batch_sizes):
            if FLAGS.time_budget_s is not None and time.monotonic() - start > FLAGS.time_budget_s:
                logging.warning("time budget spent: skipping T=%g batch=%d", temperature, batch)
                meta["skipped_groups"].append({"temperature": temperature, "batch": batch})
                continue
            def spec(policy, budget="0"):
                b = budget_lib.parse_budget(budget)
                auto = tuple(int(x) for x in FLAGS.auto_budgets) if b is None else ()
                return DecodeSpec(policy=policy, budget=b or 0, auto_budgets=auto, topk=FLAGS.topk,
                                  block_size=block, temperature=temperature,
                                  max_new_tokens=FLAGS.max_new_tokens, eos_token_id=eos,
                                  rounds_per_check=FLAGS.rounds_per_check)
            ar = decode_in_batches(decoder, prompts, spec("ar"), batch, FLAGS.seed)
            runs = [ar, decode_in_batches(decoder, prompts, spec("chain"), batch, FLAGS.seed)]
            runs += [decode_in_batches(decoder, prompts, spec("ddtree", b), batch, FLAGS.seed)
                     for b in FLAGS.budgets]
            for r in runs:
                r.update(temperature=temperature, batch=batch, speedup=r["tokens_per_s"] / ar["tokens_per_s"],
                         identical_to_ar=(r["tokens"] == ar["tokens"]) if temperature == 0 else None)
                logging.info("T=%g batch=%d %s B=%s: tau %.2f, %.1f tok/s, %.2fx", temperature, batch, r["policy"],
                             r["budget"], r["tau"], r["tokens_per_s"], r["speedup"])
                if temperature == 0:
                    r["agree_prefix"] = agreeing_prefix(r["tokens"], ar["tokens"])
            rows += runs
            write(rows, meta)
    print_table(rows)
    write(rows, meta)


def write(rows, meta: dict) -> None:
    """The JSON (--out) and plot (--plot) of the rows so far."""
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"meta": meta, "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}, f, indent=1)
    if FLAGS.plot and rows:
        plot(rows, FLAGS.plot, meta)


def print_table(rows) -> None:
    print(f"{'T':>4} {'batch':>5} {'policy':>7} {'B':>5} {'tau':>6} {'tok/s':>9} {'speedup':>8} {'same as ar':>10}"
          f"  rounds by B (auto)")
    for r in rows:
        same = "-" if r["identical_to_ar"] is None else str(r["identical_to_ar"])
        hist = " ".join(f"{b}:{n}" for b, n in r["budget_hist"].items()) if r["budget"] == "auto" else ""
        print(f"{r['temperature']:>4g} {r['batch']:>5} {r['policy']:>7} {r['budget']:>5} {r['tau']:>6.2f} "
              f"{r['tokens_per_s']:>9.1f} {r['speedup']:>7.2f}x {same:>10}  {hist}")


def plot(rows, path: str, meta: dict) -> None:
    """tau and speedup against fixed B (dashed: chain, dotted: auto), and the budgets of the auto runs' first
    batches round by round."""
    plt = plots.pyplot()
    fig, (ax_tau, ax_speed, ax_auto) = plt.subplots(1, 3, figsize=(16, 4))
    for (temperature, batch) in sorted({(r["temperature"], r["batch"]) for r in rows}):
        sel = [r for r in rows if r["temperature"] == temperature and r["batch"] == batch]
        tree = [r for r in sel if r["policy"] == "ddtree" and r["budget"] != "auto"]
        chain = next(r for r in sel if r["policy"] == "chain")
        label = f"T={temperature:g}, batch {batch}"
        line = ax_tau.plot([r["budget"] for r in tree], [r["tau"] for r in tree], "o-", label=f"ddtree {label}")
        color = line[0].get_color()
        ax_tau.axhline(chain["tau"], ls="--", color=color, alpha=0.6)
        ax_speed.plot([r["budget"] for r in tree], [r["speedup"] for r in tree], "o-", color=color,
                      label=f"ddtree {label}")
        ax_speed.axhline(chain["speedup"], ls="--", color=color, alpha=0.6)
        for r in sel:
            if r["budget"] == "auto":
                ax_tau.axhline(r["tau"], ls=":", color=color)
                ax_speed.axhline(r["speedup"], ls=":", color=color)
                ax_auto.step(range(len(r["budget_rounds"])), r["budget_rounds"], where="post", color=color,
                             label=f"{label}: {r['speedup']:.2f}x")
    fixed = any(r["policy"] == "ddtree" and r["budget"] != "auto" for r in rows)
    for ax, name in ((ax_tau, "tau (tokens per round)"), (ax_speed, "speedup over ar")):
        if fixed:  # a log axis needs points
            ax.set_xscale("log", base=2)
        ax.set_xlabel("budget B (dashed: chain, dotted: auto)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    ax_tau.legend(fontsize=7)
    ax_auto.set_xlabel("round (first batch)")
    ax_auto.set_ylabel("B verified (0 = AR round)")
    ax_auto.set_yscale("symlog", base=2, linthresh=4)
    ax_auto.set_title("--budget=auto", fontsize=9)
    ax_auto.grid(alpha=0.3)
    if ax_auto.lines:
        ax_auto.legend(fontsize=7)
    fig.suptitle(f"DDTree on the trained code target ({meta['backend']}, {meta['num_prompts']} held-out prompts)")
    plots.save(fig, path)


if __name__ == "__main__":
    cli.run(main)
