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
--check_finite=on,off runs every case with the loop's NaN / inf check of the logits on and then off, and prints what
the check costs (meta.check_finite_cost in the JSON):
  python experiments/bench_decode.py --check_finite=on,off --temperatures=0 --budgets=8,32,128 --batch_sizes=1,8 \
      --out=/tmp/decode_finite.json --plot=
--exact=on runs the target's batch-invariant forward (DecodeSpec.exact: greedy chain / ddtree == ar in bf16), and
--exact=on,off times it beside the default (meta.exact_cost):
  python experiments/bench_decode.py --exact=on,off --temperatures=0 --budgets=8,32 --batch_sizes=1,8 \
      --out=/tmp/decode_exact.json --plot=
--device_loop=on,off times every case with the loop as one CUDA graph (DecodeSpec.device_loop: no host round trip
between rounds) beside the default (meta.device_loop_cost; on the CPU both are the same program):
  python experiments/bench_decode.py --device_loop=on,off --temperatures=0 --budgets=8,32 --batch_sizes=1,8 \
      --out=/tmp/decode_device_loop.json --plot=
"""
from __future__ import annotations

import itertools
import json
import os
import platform
import time
from typing import NamedTuple

import jax
from absl import flags, logging

from experiments.run_record import code_version
from kdtree_jax import budget as budget_lib
from kdtree_jax import cli, model_dir, plots, sharding
from kdtree_jax.data import eval_prompts
from kdtree_jax.decode import DecodeSpec, Decoder, agreeing_prefix, check_spec, decode_in_batches
from pallas_kernels import ops

FLAGS = flags.FLAGS
MODES = ("check_finite", "exact", "device_loop")  # DecodeSpec switches timed both ways when a flag lists on,off


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    def d(define, name, default, help_text, **kw):
        define(name, default, help=help_text, flag_values=fv, **kw)
    model_dir.define_model_flags(fv)
    d(flags.DEFINE_enum, "dtype", None, "run the models in this dtype (default: the checkpoint's)",
      enum_values=["bfloat16", "float32"])
    d(flags.DEFINE_string, "mesh", "", "device mesh, e.g. 'tp=8' (empty: one device); the target is read into its "
      "shards")
    d(flags.DEFINE_integer, "num_prompts", 32, "held-out prompts")
    d(flags.DEFINE_integer, "prompt_tokens", 64, "tokens per prompt")
    d(flags.DEFINE_integer, "max_new_tokens", 128, "tokens generated per prompt")
    d(flags.DEFINE_list, "budgets", ["4", "8", "16", "32", "64", "128", "256"], "ddtree budgets B; 'auto': chosen "
      "each round among --auto_budgets")
    d(flags.DEFINE_list, "auto_budgets", [str(b) for b in budget_lib.DEFAULT_CANDIDATES], "the budgets an auto run "
      "compiles, 0 = an AR round")
    d(flags.DEFINE_list, "batch_sizes", ["1", "8"], "streams decoded together")
    d(flags.DEFINE_list, "temperatures", ["0", "1"], "sampling temperatures")
    d(flags.DEFINE_integer, "topk", None, "ddtree candidates per depth (default min(B, V)); <= 16 keeps XLA:GPU's "
      "top-k off the whole-row sort")
    d(flags.DEFINE_integer, "rounds_per_check", 1, "rounds of the decode loop between reads of its stop condition "
      "(DecodeSpec.rounds_per_check; fixed budgets: the auto loop checks after each round)")
    d(flags.DEFINE_list, "check_finite", ["on"], "the loop's check of the logits for NaN / inf "
      "(DecodeSpec.check_finite): 'on', 'off', or 'on,off' to time every case both ways, one after the other")
    d(flags.DEFINE_list, "exact", ["off"], "the target's batch-invariant forward (DecodeSpec.exact): 'on', 'off', or "
      "'on,off' to time every case both ways")
    d(flags.DEFINE_list, "device_loop", ["off"], "the decode loop as one CUDA graph on the GPU "
      "(DecodeSpec.device_loop: XLA's WHILE / CONDITIONAL command buffers): 'on', 'off', or 'on,off' to time every "
      "case both ways")
    d(flags.DEFINE_bool, "dense_kernel", False, "the target's dense products of few rows through skinny_matmul "
      "(`ops.set_dense_kernel`; one device, the GPU)")
    d(flags.DEFINE_bool, "router_kernel", False, "the target's MoE router (sigmoid, top-k, weights) as one Triton "
      "kernel (`ops.set_router_kernel`; one device, the GPU)")
    d(flags.DEFINE_integer, "seed", 0, "prompt choice and sampling seed")
    d(flags.DEFINE_string, "out", "experiments/results/decode/decode.json", "JSON output")
    d(flags.DEFINE_string, "plot", "experiments/results/decode/decode.png", "PNG of tau and speedup vs B ('' to skip)")
    d(flags.DEFINE_float, "time_budget_s", None, "start no (temperature, batch) group after this many seconds; the "
      "JSON and plot are rewritten after every group, so a run cut short keeps the groups it finished")
    cli.define_overwrite(fv)


class Inputs(NamedTuple):
    target: object  # ModelConfig
    drafter: object  # DrafterConfig
    tokenizer: object
    mesh: object
    eos: tuple[int, ...]  # the ids the streams stop at
    budgets: list  # 'auto' or integer strings
    auto_budgets: tuple
    batch_sizes: list
    temperatures: list
    mode_sets: list  # [{check_finite: bool, exact: bool}]: each case runs once in each


def check(f) -> Inputs:
    """Every input before any weight is read: the flags, the target, drafter and tokenizer files and how they agree,
    the mesh, and each decode spec the run will compile (at the prompts' length)."""
    for name, minimum in (("num_prompts", 1), ("prompt_tokens", 1), ("max_new_tokens", 1), ("topk", 1),
                          ("rounds_per_check", 1), ("time_budget_s", 0)):
        cli.at_least(f, name, minimum)
    cli.seed(f)
    budgets = ["auto" if b is None else str(b) for b in cli.budgets(f, "budgets", 1)]
    auto_budgets = tuple(cli.int_list(f, "auto_budgets", 0))
    batches = cli.int_list(f, "batch_sizes", 1)
    temperatures = cli.float_list(f, "temperatures", 0)
    modes = [cli.on_off(f, name) for name in MODES]
    mode_sets = [dict(zip(MODES, combo)) for combo in itertools.product(*modes)]
    if not f.out:
        cli.refuse(f, "out", "is empty; name the JSON file to write")
    cli.output_path(f, "out")
    cli.output_path(f, "plot")
    target, drafter, tokenizer, eos = model_dir.model_configs(f, f.dtype)
    with cli.about(f, "mesh"):
        mesh = sharding.parse_mesh(f.mesh)
        model_dir.check_mesh(target, mesh)
    for batch in batches:
        prompts = [[0] * f.prompt_tokens] * min(batch, f.num_prompts)
        for temperature in temperatures:
            for policy, budget in [("ar", "0"), ("chain", "0")] + [("ddtree", b) for b in budgets]:
                for mode in mode_sets:
                    spec = make_spec(policy, budget, auto_budgets, topk=f.topk, block_size=drafter.block_size,
                                     temperature=temperature, max_new_tokens=f.max_new_tokens, eos_token_ids=eos,
                                     rounds_per_check=f.rounds_per_check, **mode)
                    check_spec(spec, target, drafter, prompts, Decoder.default_cache_len(spec, prompts), mesh)
    model_dir.check_model_tensors(f, target, drafter)
    return Inputs(target, drafter, tokenizer, mesh, eos, budgets, auto_budgets, batches, temperatures, mode_sets)


def make_spec(policy: str, budget: str, auto_budgets: tuple, **kwargs) -> DecodeSpec:
    """The DecodeSpec of one case: budget an integer or 'auto' (ddtree, choosing among auto_budgets; its loop plans
    each round, so it checks its stop condition each round whatever rounds_per_check says)."""
    b = budget_lib.parse_budget(budget)
    if b is None:
        kwargs["rounds_per_check"] = 1
    return DecodeSpec(policy=policy, budget=b or 0, auto_budgets=auto_budgets if b is None else (), **kwargs)


def run(f) -> None:
    inputs = check(f)
    ops.set_dense_kernel(f.dense_kernel)
    ops.set_router_kernel(f.router_kernel)
    mesh = inputs.mesh
    prompts = [list(p.ids) for p in eval_prompts(inputs.tokenizer, f.num_prompts, f.prompt_tokens, seed=f.seed)]
    target = model_dir.load_target(f.target, dtype=f.dtype, mesh=mesh)
    drafter = model_dir.load_drafter(f.drafter, target.cfg, mesh=mesh)
    decoder = Decoder(target, drafter, mesh=mesh)
    block = drafter.cfg.block_size
    meta = {"code": code_version(), "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "jax": jax.__version__,
            "dtype": target.cfg.dtype, "target": f.target, "drafter": f.drafter, "mesh": f.mesh,
            "host": platform.node(), "num_prompts": len(prompts), "prompt_tokens": f.prompt_tokens,
            "max_new_tokens": f.max_new_tokens, "block_size": block,
            "rounds_per_check": f.rounds_per_check, "topk": f.topk, "modes": inputs.mode_sets,
            "dense_kernel": f.dense_kernel,
            "router_kernel": f.router_kernel,
            "auto_budgets": list(inputs.auto_budgets),
            "skipped_groups": []}
    rows, start = [], time.monotonic()
    cases = [("ar", "0"), ("chain", "0")] + [("ddtree", b) for b in inputs.budgets]
    for temperature in inputs.temperatures:
        for batch in inputs.batch_sizes:
            if f.time_budget_s is not None and time.monotonic() - start > f.time_budget_s:
                logging.warning("time budget spent: skipping T=%g batch=%d", temperature, batch)
                meta["skipped_groups"].append({"temperature": temperature, "batch": batch})
                continue
            runs = []
            for policy, budget in cases:  # each case in every mode (--check_finite x --exact x --device_loop), in turn
                for mode in inputs.mode_sets:
                    spec = make_spec(policy, budget, inputs.auto_budgets, topk=f.topk, block_size=block,
                                     temperature=temperature, max_new_tokens=f.max_new_tokens,
                                     eos_token_ids=inputs.eos, rounds_per_check=f.rounds_per_check, **mode)
                    r = decode_in_batches(decoder, prompts, spec, batch, f.seed)
                    r.update(temperature=temperature, batch=batch, **mode)
                    runs.append(r)
            for r in runs:
                ar = next(a for a in runs if a["policy"] == "ar" and all(a[m] == r[m] for m in MODES))
                r.update(speedup=r["tokens_per_s"] / ar["tokens_per_s"],
                         identical_to_ar=(r["tokens"] == ar["tokens"]) if temperature == 0 else None)
                logging.info("T=%g batch=%d %s B=%s: tau %.2f, %.1f tok/s, %.2fx", temperature, batch, r["policy"],
                             r["budget"], r["tau"], r["tokens_per_s"], r["speedup"])
                if temperature == 0:
                    r["agree_prefix"] = agreeing_prefix(r["tokens"], ar["tokens"])
            rows += runs
            for mode in MODES:
                meta[f"{mode}_cost"] = mode_cost(rows, mode)
            write(f, rows, meta)
    print_table(rows)
    for mode in MODES:
        print_mode_cost(mode, meta.get(f"{mode}_cost", []))
    write(f, rows, meta)


def mode_cost(rows, mode: str) -> list[dict]:
    """Per case timed with `mode` on and off (everything else equal): tok/s both ways and the fraction it costs."""
    same = ("temperature", "batch", "policy", "budget") + tuple(m for m in MODES if m != mode)
    out = []
    for on in (r for r in rows if r[mode]):
        off = next((r for r in rows if not r[mode] and all(r[k] == on[k] for k in same)), None)
        if off is not None:
            out.append({k: on[k] for k in same} | {
                "tokens_per_s_on": on["tokens_per_s"], "tokens_per_s_off": off["tokens_per_s"],
                "cost": 1.0 - on["tokens_per_s"] / off["tokens_per_s"]})
    return out


def print_mode_cost(mode: str, costs: list[dict]) -> None:
    if not costs:
        return
    print(f"\n{mode} (DecodeSpec.{mode}) cost, same run:\n{'T':>4} {'batch':>5} {'policy':>7} {'B':>5} "
          f"{'tok/s on':>9} {'tok/s off':>9} {'cost':>7}")
    for c in costs:
        print(f"{c['temperature']:>4g} {c['batch']:>5} {c['policy']:>7} {c['budget']:>5} {c['tokens_per_s_on']:>9.1f} "
              f"{c['tokens_per_s_off']:>9.1f} {100 * c['cost']:>6.2f}%")


def write(f, rows, meta: dict) -> None:
    """The JSON (--out) and plot (--plot) of the rows so far."""
    os.makedirs(os.path.dirname(f.out) or ".", exist_ok=True)
    with open(f.out, "w") as fh:
        json.dump({"meta": meta, "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}, fh, indent=1)
    if f.plot and rows:
        plot([r for r in rows if all(r[m] == rows[0][m] for m in MODES)], f.plot, meta)


def print_table(rows) -> None:
    print(f"{'T':>4} {'batch':>5} {'policy':>7} {'B':>5} {'finite':>6} {'exact':>5} {'device':>6} {'tau':>6} "
          f"{'tok/s':>9} {'speedup':>8} {'same as ar':>10}  rounds by B (auto)")
    for r in rows:
        same = "-" if r["identical_to_ar"] is None else str(r["identical_to_ar"])
        hist = " ".join(f"{b}:{n}" for b, n in r["budget_hist"].items()) if r["budget"] == "auto" else ""
        modes = " ".join(f"{'on' if r[m] else 'off':>{w}}" for m, w in zip(MODES, (6, 5, 6)))
        print(f"{r['temperature']:>4g} {r['batch']:>5} {r['policy']:>7} {r['budget']:>5} {modes} {r['tau']:>6.2f} "
              f"{r['tokens_per_s']:>9.1f} "
              f"{r['speedup']:>7.2f}x {same:>10}  {hist}")


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
    cli.script(define_flags, run)
