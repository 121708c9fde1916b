"""Generate with ar | chain | ddtree decoding and report tokens, speed and acceptance.

Token ids (no tokenizer), a random tiny model:
  python experiments/generate.py --config=tiny --init=random --policy=ddtree --budget=16 \
      --prompt=1,2,3 --prompt=4,5 --max_new_tokens=32 --json
The shipped models on a held-out prompt, DDTree beside AR (what `make demo` runs), the tree budget chosen each round
from this device's measured step costs (--budget=auto, the default; kdtree_jax/budget.py):
  python experiments/generate.py --init=checkpoints/target --drafter=checkpoints/drafter \
      --tokenizer=checkpoints/tokenizer.json --held_out_prompts=1 --policy=ddtree --budget=auto --compare
An HF model directory (Kimi K2.6, DeepSeek-V3) with a DFlash drafter directory, the model's own tokenizer and chat
template, on a mesh (README.md, "Running on real Kimi K2.6"):
  python experiments/generate.py --init=tests/fixtures/kimi_k26_tiny --drafter=tests/fixtures/dflash_tiny \
      --chat --prompt="Write a haiku." --policy=ddtree --budget=16 --compare --mesh=tp=4

Each --prompt is one stream: text when a tokenizer is in use, else comma-separated token ids. With --json the last
line printed is one JSON object; --out writes it to a file. --budget=auto first times a few rounds at each of
--auto_budgets (a second or two on the CPU; or reads them from --cost_table, which a first run writes).
"""
from __future__ import annotations

import json
import os

import jax
from absl import flags, logging

from kdtree_jax import budget as budget_lib
from kdtree_jax import cli
from kdtree_jax import config as config_lib
from kdtree_jax import model_dir, sharding
from kdtree_jax import tokenizer as tokenizer_lib
from kdtree_jax.decode import DecodeSpec, Decoder, GenerateResult, acceptance, budget_counts
from pallas_kernels import ops

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny", f"model preset: {sorted(config_lib.PRESETS)} (ignored when --init is a checkpoint)")
flags.DEFINE_string("init", "random", "the target: 'random' (at --config), a checkpoint directory of ours, or an HF "
                    "model directory (config.json + safetensors: DeepSeek-V3, Kimi K2.x incl. K2.6 INT4), streamed "
                    "into the --mesh")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "run the target in this dtype (default: a preset's, a "
                  "checkpoint's own, bfloat16 for an HF directory)")
flags.DEFINE_string("drafter", "random", "the drafter (chain / ddtree): 'random', a drafter checkpoint of ours, or a "
                    "DFlash drafter directory in the published format (config.json naming DFlashDraftModel)")
flags.DEFINE_string("tokenizer", "", "'' = the --init directory's own tokenizer when it has one (tiktoken.model or "
                    "tokenizer.json), else token ids; 'none' = token ids; a model directory; or a tokenizers JSON "
                    "file of ours (checkpoints/tokenizer.json)")
flags.DEFINE_bool("chat", False, "wrap each --prompt as one user turn in the tokenizer directory's chat template "
                  "(with the assistant's generation prompt)")
flags.DEFINE_integer("seed", 0, "seed of random init and sampling")
flags.DEFINE_multi_string("prompt", None, "one stream's prompt (text, or comma-separated ids); repeat for more")
flags.DEFINE_integer("held_out_prompts", 0, "add this many prompts drawn from held-out stdlib files (needs tokenizer)")
flags.DEFINE_integer("prompt_tokens", 64, "length of each held-out prompt in tokens")
flags.DEFINE_integer("max_new_tokens", 32, "tokens to generate per stream")
flags.DEFINE_enum("policy", "ar", ["ar", "chain", "ddtree"], "decoding policy")
flags.DEFINE_string("budget", "auto", "ddtree: non-root tree nodes B, or 'auto': chosen each round among "
                    "--auto_budgets by this device's measured step costs and the drafter's expected acceptance")
flags.register_validator("budget", lambda v: v.strip().lower() == "auto" or v.strip().isdigit(),
                         "must be 'auto' or an integer number of tree nodes B >= 0")
flags.DEFINE_list("auto_budgets", [str(b) for b in budget_lib.DEFAULT_CANDIDATES], "--budget=auto: the budgets "
                  "compiled, 0 = an AR round (no draft)")
flags.DEFINE_string("cost_table", "", "--budget=auto: a JSON table of step costs; the entry for this device, model "
                    "and batch is read from it, or measured and added ('': measure, write nothing)")
flags.DEFINE_integer("block_size", None, f"block size L of a random drafter (default {model_dir.RANDOM_BLOCK_SIZE}); "
                     "a checkpointed drafter has its own, and another value is refused")
flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples the target per tree node")
flags.DEFINE_integer("cache_len", 0, "cache rows per stream (0 = just enough)")
flags.DEFINE_bool("compare", False, "also run ar and report both side by side, with whether outputs are identical")
flags.DEFINE_string("mesh", "", "device mesh, e.g. 'tp=8' or 'data=2,tp=4' (empty: one device); for N fake CPU "
                    "devices set XLA_FLAGS=--xla_force_host_platform_device_count=N")
flags.DEFINE_bool("json", False, "print one JSON object as the last line")
flags.DEFINE_string("out", "", "also write the JSON object to this file (process 0 only)")
flags.DEFINE_enum("kernels", "auto", ops.IMPLEMENTATIONS, "Pallas kernels or pure-JAX references ('auto': kernels "
                  "on the GPU)")
flags.DEFINE_string("coordinator", "", "host:port of process 0: join --num_processes processes with "
                    "jax.distributed.initialize before the mesh is made (one process per GPU or per host)")
flags.DEFINE_integer("num_processes", 1, "processes joined by jax.distributed (with --coordinator)")
flags.DEFINE_integer("process_id", 0, "this process's index, 0 .. num_processes - 1 (with --coordinator)")


def load_models(init: str, preset: str, drafter_init: str, block_size: int | None, seed: int, need_drafter: bool,
                mesh=None, dtype: str | None = None):
    """The target (into its shards on `mesh`) and, when needed, the drafter (kdtree_jax.model_dir)."""
    target = model_dir.load_target(init, preset=preset, seed=seed, dtype=dtype, mesh=mesh)
    if not need_drafter:
        return target, None
    return target, model_dir.load_drafter(drafter_init, target.cfg, block_size=block_size, seed=seed + 1,
                                             mesh=mesh)


def tokenizer_path(flag: str, init: str) -> str | None:
    """Where the tokenizer comes from (None: prompts and outputs are token ids)."""
    if flag == "none":
        return None
    if flag:
        return flag
    return init if init != model_dir.RANDOM and tokenizer_lib.has_model_tokenizer(init) else None


def read_prompts(texts, tokenizer, held_out: int, prompt_tokens: int, seed: int,
                 chat_dir: str | None = None) -> list[list[int]]:
    """Token ids per stream. chat_dir: encode each text as a user turn under that directory's chat template."""
    prompts = []
    for text in texts or []:
        if chat_dir is not None:
            prompts.append(tokenizer_lib.encode_chat(tokenizer, chat_dir, text))
        elif tokenizer is not None:
            prompts.append(tokenizer.encode(text))
        else:
            try:
                prompts.append([int(t) for t in text.split(",") if t.strip()])
            except ValueError as err:
                raise ValueError(f"--prompt={text!r} must be comma-separated token ids (or pass --tokenizer)") from err
    if held_out:
        if tokenizer is None:
            raise ValueError("--held_out_prompts needs --tokenizer")
        from kdtree_jax.data import eval_prompts
        prompts += [list(p.ids) for p in eval_prompts(tokenizer, held_out, prompt_tokens, seed=seed)]
    if not prompts:
        raise ValueError("no prompt: pass --prompt or --held_out_prompts")
    return prompts


def make_spec(policy: str, budget: str, auto_budgets, **kwargs) -> DecodeSpec:
    """The DecodeSpec of --policy / --budget (an integer or 'auto') / --auto_budgets."""
    b = budget_lib.parse_budget(budget)
    auto = tuple(int(x) for x in auto_budgets) if b is None and policy == "ddtree" else ()
    return DecodeSpec(policy=policy, budget=b or 0, auto_budgets=auto, **kwargs)


def step_costs(decoder: Decoder, prompts, spec: DecodeSpec, cache_len: int | None, table: str):
    """The auto loop's step costs: read from `table` when it holds this setting's entry, else measured (and added to
    `table` when one is named); None for a fixed budget."""
    if not spec.auto:
        return None
    cache_len = cache_len or Decoder.default_cache_len(spec, prompts)
    key = decoder.cost_key(spec, len(prompts), cache_len)
    costs = budget_lib.load_costs(table, key) if table else None
    if costs is None:
        costs = decoder.step_costs(spec, prompts, cache_len)
        if table and jax.process_index() == 0:
            budget_lib.save_costs(table, costs)
    return costs


def run_policy(decoder: Decoder, prompts, spec: DecodeSpec, seed: int, cache_len: int | None,
               costs: budget_lib.StepCosts | None = None) -> dict:
    decoder.generate(prompts, spec, seed=seed, cache_len=cache_len, costs=costs)  # compile + warm up
    result: GenerateResult = decoder.generate(prompts, spec, seed=seed, cache_len=cache_len, costs=costs)
    new_tokens = sum(len(t) for t in result.tokens)
    tau_mean, hist = acceptance(result.taus, spec.block_size)
    report = {"policy": spec.policy, "budget": spec.budget_label, "block_size": spec.block_size,
              "temperature": spec.temperature, "tokens": result.tokens, "new_tokens": new_tokens,
              "seconds": result.seconds, "tokens_per_s": new_tokens / result.seconds, "rounds": result.rounds,
              "tau_mean": tau_mean, "accept_hist": hist, "budget_hist": budget_counts(result.budgets)}
    if spec.auto:
        report.update(budget_rounds=result.budgets.tolist(), costs=result.costs.as_dict())
    return report


def main(argv):
    del argv
    logging.set_verbosity(logging.ERROR)  # keep checkpoint-library chatter out of the report
    if FLAGS.coordinator:
        jax.distributed.initialize(coordinator_address=FLAGS.coordinator, num_processes=FLAGS.num_processes,
                                   process_id=FLAGS.process_id)
    ops.set_implementation(FLAGS.kernels)
    source = tokenizer_path(FLAGS.tokenizer, FLAGS.init)
    tokenizer = tokenizer_lib.load_tokenizer(source) if source else None
    if FLAGS.chat and (source is None or not os.path.isdir(source)):
        raise ValueError("--chat needs a model directory's tokenizer and chat template: give --init an HF directory "
                         "that holds its tokenizer, or --tokenizer=DIRECTORY")
    prompts = read_prompts(FLAGS.prompt, tokenizer, FLAGS.held_out_prompts, FLAGS.prompt_tokens, FLAGS.seed,
                           chat_dir=source if FLAGS.chat else None)
    mesh = sharding.parse_mesh(FLAGS.mesh)
    target, drafter = load_models(FLAGS.init, FLAGS.config, FLAGS.drafter, FLAGS.block_size, FLAGS.seed,
                                  FLAGS.policy != "ar", mesh, FLAGS.dtype)
    eos = model_dir.eos_token_id(FLAGS.init, target.cfg)
    block = drafter.cfg.block_size if drafter is not None else (FLAGS.block_size or model_dir.RANDOM_BLOCK_SIZE)
    spec = make_spec(FLAGS.policy, FLAGS.budget, FLAGS.auto_budgets, block_size=block,
                     temperature=FLAGS.temperature, max_new_tokens=FLAGS.max_new_tokens, eos_token_id=eos)
    decoder = Decoder(target, drafter, mesh=mesh)
    cache_len = FLAGS.cache_len or None
    report = run_policy(decoder, prompts, spec, FLAGS.seed, cache_len,
                        step_costs(decoder, prompts, spec, cache_len, FLAGS.cost_table))
    runs = [report]
    if FLAGS.compare and FLAGS.policy != "ar":
        baseline = run_policy(decoder, prompts, DecodeSpec(policy="ar", block_size=block,
                                                           temperature=FLAGS.temperature,
                                                           max_new_tokens=FLAGS.max_new_tokens,
                                                           eos_token_id=eos),
                              FLAGS.seed, cache_len)
        runs = [baseline, report]
        report["ar"] = {k: baseline[k] for k in ("tokens_per_s", "seconds", "rounds", "tokens")}
        report["identical_to_ar"] = baseline["tokens"] == report["tokens"]
        report["speedup_over_ar"] = report["tokens_per_s"] / baseline["tokens_per_s"]
    print_report(prompts, runs, tokenizer)
    if FLAGS.compare and FLAGS.policy != "ar":
        print(f"\n{FLAGS.policy} output identical to ar: {report['identical_to_ar']}  "
              f"(speedup {report['speedup_over_ar']:.2f}x on this device)")
    report.update(init=FLAGS.init, drafter=FLAGS.drafter if drafter is not None else None, mesh=FLAGS.mesh,
                  kernels=FLAGS.kernels, backend=jax.default_backend(), dtype=target.cfg.dtype, eos_token_id=eos)
    if FLAGS.json:
        print(json.dumps(report))
    if FLAGS.out and jax.process_index() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            json.dump(report, f, indent=1)


def print_report(prompts, runs, tokenizer) -> None:
    show = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: ",".join(map(str, ids)))
    for i, prompt in enumerate(prompts):
        print(f"=== stream {i}: prompt ({len(prompt)} tokens) ===\n{show(prompt)}")
        print(f"=== stream {i}: generated by {runs[-1]['policy']} ===\n{show(runs[-1]['tokens'][i])}\n")
    print(f"{'policy':>8} {'budget':>6} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'rounds':>6} {'tau':>5}  "
          f"rounds by B")
    for r in runs:
        print(f"{r['policy']:>8} {r['budget']:>6} {r['new_tokens']:>7} {r['seconds']:>8.3f} "
              f"{r['tokens_per_s']:>8.1f} {r['rounds']:>6} {r['tau_mean']:>5.2f}  "
              f"{' '.join(f'{b}:{n}' for b, n in r['budget_hist'].items())}")
    auto = [r for r in runs if "costs" in r]
    for r in auto:
        costs = r["costs"]
        print(f"step costs ({costs['how']}): " + ", ".join(f"B={b} {1e3 * t:.2f} ms" for b, t in
                                                          zip(costs["candidates"], costs["seconds"])))


if __name__ == "__main__":
    cli.run(main)
