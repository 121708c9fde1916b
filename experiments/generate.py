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

import dataclasses
import json
import os
from typing import NamedTuple

import jax
from absl import flags, logging

from kdtree_jax import budget as budget_lib
from kdtree_jax import cli
from kdtree_jax import config as config_lib
from kdtree_jax import model_dir, sharding
from kdtree_jax import tokenizer as tokenizer_lib
from kdtree_jax.decode import DecodeSpec, Decoder, GenerateResult, acceptance, budget_counts, check_spec
from pallas_kernels import ops

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    def d(define, name, default, help_text, **kw):
        define(name, default, help=help_text, flag_values=fv, **kw)
    d(flags.DEFINE_string, "config", "tiny", f"model preset: {sorted(config_lib.PRESETS)} (ignored when --init is a "
      "checkpoint)")
    d(flags.DEFINE_string, "init", "random", "the target: 'random' (at --config), a checkpoint directory of ours, or "
      "an HF model directory (config.json + safetensors: DeepSeek-V3, Kimi K2.x incl. K2.6 INT4), streamed into the "
      "--mesh")
    d(flags.DEFINE_enum, "dtype", None, "run the target in this dtype (default: a preset's, a checkpoint's own, "
      "bfloat16 for an HF directory)", enum_values=["bfloat16", "float32"])
    d(flags.DEFINE_string, "drafter", "random", "the drafter (chain / ddtree): 'random', a drafter checkpoint of ours, "
      "or a DFlash drafter directory in the published format (config.json naming DFlashDraftModel)")
    d(flags.DEFINE_string, "tokenizer", "", "'' = the --init directory's own tokenizer when it has one "
      "(tiktoken.model or tokenizer.json), else token ids; 'none' = token ids; a model directory; or a tokenizers "
      "JSON file of ours (checkpoints/tokenizer.json)")
    d(flags.DEFINE_bool, "chat", False, "wrap each --prompt as one user turn in the tokenizer directory's chat "
      "template (with the assistant's generation prompt)")
    d(flags.DEFINE_integer, "seed", 0, "seed of random init and sampling")
    d(flags.DEFINE_multi_string, "prompt", None, "one stream's prompt (text, or comma-separated ids); repeat for more")
    d(flags.DEFINE_integer, "held_out_prompts", 0, "add this many prompts drawn from held-out stdlib files (needs "
      "tokenizer)")
    d(flags.DEFINE_integer, "prompt_tokens", 64, "length of each held-out prompt in tokens")
    d(flags.DEFINE_integer, "max_new_tokens", 32, "tokens to generate per stream")
    d(flags.DEFINE_enum, "policy", "ar", "decoding policy", enum_values=["ar", "chain", "ddtree"])
    d(flags.DEFINE_string, "budget", "auto", "ddtree: non-root tree nodes B, or 'auto': chosen each round among "
      "--auto_budgets by this device's measured step costs and the drafter's expected acceptance")
    d(flags.DEFINE_list, "auto_budgets", [str(b) for b in budget_lib.DEFAULT_CANDIDATES], "--budget=auto: the "
      "budgets compiled, 0 = an AR round (no draft)")
    d(flags.DEFINE_string, "cost_table", "", "--budget=auto: a JSON table of step costs; the entry for this device, "
      "model and batch is read from it, or measured and added ('': measure, write nothing)")
    d(flags.DEFINE_integer, "block_size", None, f"block size L of a random drafter (default "
      f"{model_dir.RANDOM_BLOCK_SIZE}); a checkpointed drafter has its own, and another value is refused")
    d(flags.DEFINE_float, "temperature", 0.0, "0 = greedy; > 0 samples the target per tree node")
    d(flags.DEFINE_integer, "cache_len", 0, "cache rows per stream (0 = just enough)")
    d(flags.DEFINE_bool, "compare", False, "also run ar and report both side by side, with whether outputs are "
      "identical")
    d(flags.DEFINE_integer, "reps", 3, "timed runs of each policy after its warm-up run; the median time is reported "
      "(one short run on a shared CPU swung the demo's ratio from 0.96x to 1.37x)")
    d(flags.DEFINE_string, "mesh", "", "device mesh, e.g. 'tp=8' or 'data=2,tp=4' (empty: one device); for N fake "
      "CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count=N")
    d(flags.DEFINE_bool, "json", False, "print one JSON object as the last line")
    d(flags.DEFINE_string, "out", "", "also write the JSON object to this file (process 0 only)")
    d(flags.DEFINE_enum, "kernels", "auto", "Pallas kernels or pure-JAX references ('auto': kernels on the GPU)",
      enum_values=list(ops.IMPLEMENTATIONS))
    d(flags.DEFINE_bool, "check_finite", True, "stop with an error at the first round whose logits are not finite")
    d(flags.DEFINE_bool, "exact", False, "the target's batch-invariant forward (DecodeSpec.exact): greedy chain / "
      "ddtree == ar token for token in bfloat16 too; one device or a data-only mesh")
    d(flags.DEFINE_bool, "device_loop", False, "the decode loop as one CUDA graph on the GPU (DecodeSpec.device_loop: "
      "no host round trip between rounds; the CPU ignores it)")
    cli.define_overwrite(fv)
    cli.define_process_flags(fv)


class Inputs(NamedTuple):
    """Everything the run needs but the weights, checked."""
    target: config_lib.ModelConfig
    drafter: config_lib.DrafterConfig | None
    tokenizer: object | None
    prompts: list
    mesh: object
    spec: DecodeSpec
    cache_len: int | None


def check_flags(f) -> None:
    """The flags on their own (no file read, no JAX backend: this runs before the processes join)."""
    if f.init == model_dir.RANDOM and f.config not in config_lib.PRESETS:
        cli.refuse(f, "config", f"is not a preset; choose one of {sorted(config_lib.PRESETS)}")
    cli.seed(f)
    cli.at_least(f, "held_out_prompts", 0)
    cli.at_least(f, "prompt_tokens", 1)
    cli.at_least(f, "max_new_tokens", 1)
    cli.at_least(f, "reps", 1)
    cli.budgets(f, "budget", 0)
    cli.int_list(f, "auto_budgets", 0)
    cli.at_least(f, "block_size", 2, " (the bonus token and at least one drafted)")
    cli.at_least(f, "temperature", 0, " (0 = greedy)")
    cli.at_least(f, "cache_len", 0, " (0 = just enough)")
    if f.policy == "ddtree" and f.budget.strip() == "0":
        cli.refuse(f, "budget", "must be >= 1 for --policy=ddtree (a tree of the root alone is --policy=ar)")
    if f.chat and f.tokenizer == "none":
        cli.refuse(f, "tokenizer", "turns the tokenizer off, but --chat needs one (and its chat template); drop one "
                   "of the two")
    if not f.prompt and not f.held_out_prompts:
        cli.refuse(f, "prompt", "no prompt given: pass --prompt (repeat it for more streams) or --held_out_prompts")
    cli.output_path(f, "out")
    cli.check_process_flags(f)


def check(f) -> Inputs:
    """Every input, before any weight is read or anything compiled: the flags, the files of --init, --drafter and
    --tokenizer and how they agree (drafter fit, tokenizer vocabulary and EOS, generation_config.json), the prompts,
    the mesh, the decode spec. Raises ValueError naming the flag and the fix."""
    check_flags(f)
    with cli.about(f, "init"):
        target = model_dir.target_config(f.init, preset=f.config, dtype=f.dtype)
        eos_ids = model_dir.eos_token_ids(f.init, target)
    drafter = None
    if f.policy != "ar":
        with cli.about(f, "drafter"):
            drafter = model_dir.drafter_config(f.drafter, target, block_size=f.block_size)
    source = tokenizer_path(f.tokenizer, f.init)
    tokenizer = None
    if source is not None:
        with cli.about(f, "tokenizer" if f.tokenizer else "init"):
            tokenizer = tokenizer_lib.load_tokenizer(source)
            model_dir.check_tokenizer(tokenizer, source, target, eos_ids)
    if f.chat and (source is None or not os.path.isdir(source)):
        raise ValueError(f"--chat needs a model directory's tokenizer and chat template, but {why_no_tokenizer(f)}")
    with cli.about(f, "prompt"):
        prompts = read_prompts(f.prompt, tokenizer, f.held_out_prompts, f.prompt_tokens, f.seed,
                               chat_dir=source if f.chat else None, no_tokenizer=why_no_tokenizer(f))
    with cli.about(f, "mesh"):
        mesh = sharding.parse_mesh(f.mesh)
        model_dir.check_mesh(target, mesh)
    block = drafter.block_size if drafter is not None else (
        model_dir.RANDOM_BLOCK_SIZE if f.block_size is None else f.block_size)
    spec = make_spec(f.policy, f.budget, f.auto_budgets, block_size=block, temperature=f.temperature,
                     max_new_tokens=f.max_new_tokens, eos_token_ids=eos_ids,
                     check_finite=f.check_finite, exact=f.exact,
                     device_loop=f.device_loop)
    cache_len = f.cache_len or None
    check_spec(spec, target, drafter, prompts, cache_len or Decoder.default_cache_len(spec, prompts), mesh)
    with cli.about(f, "init"):
        model_dir.check_tensors(f.init, target)
    if drafter is not None:
        with cli.about(f, "drafter"):
            model_dir.check_tensors(f.drafter, target, drafter)
    return Inputs(target, drafter, tokenizer, prompts, mesh, spec, cache_len)


def why_no_tokenizer(f) -> str:
    """Why no tokenizer is in use, in the words of the flags."""
    if f.tokenizer == "none":
        return "--tokenizer=none turns the tokenizer off"
    if f.tokenizer:
        return f"--tokenizer={f.tokenizer} is not a model directory"
    if f.init == model_dir.RANDOM:
        return "--init=random has no tokenizer (pass --tokenizer)"
    return (f"--init={f.init} holds no tokenizer file ({tokenizer_lib.TIKTOKEN_FILE} or "
            f"{tokenizer_lib.TOKENIZERS_FILE}; pass --tokenizer)")


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
                 chat_dir: str | None = None, no_tokenizer: str = "there is no tokenizer") -> list[list[int]]:
    """Token ids per stream. chat_dir: encode each text as a user turn under that directory's chat template.
    no_tokenizer: why there is none, said when a prompt needs one."""
    prompts = []
    for text in texts or []:
        if chat_dir is not None:
            prompts.append(tokenizer_lib.encode_chat(tokenizer, chat_dir, text))
        elif tokenizer is not None:
            prompts.append(tokenizer.encode(text))
        else:
            try:
                prompts.append([int(t) for t in text.split(",") if t.strip()])
            except ValueError:
                raise ValueError(f"--prompt={text!r} must be comma-separated token ids: {no_tokenizer}") from None
    if held_out:
        if tokenizer is None:
            raise ValueError(f"--held_out_prompts needs a tokenizer, but {no_tokenizer}")
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
               costs: budget_lib.StepCosts | None = None, reps: int = 1) -> dict:
    """One warm-up run (compiling), then `reps` timed runs of the same prompts and seed: the report of the run of
    median time, `seconds_all` each run's (greedy, every run's tokens are the same; sampled, an auto loop refitting
    its costs between runs may choose other budgets, and so draw other tokens)."""
    decoder.generate(prompts, spec, seed=seed, cache_len=cache_len, costs=costs)  # compile + warm up
    results = [decoder.generate(prompts, spec, seed=seed, cache_len=cache_len, costs=costs) for _ in range(reps)]
    result: GenerateResult = sorted(results, key=lambda r: r.seconds)[(reps - 1) // 2]
    new_tokens = sum(len(t) for t in result.tokens)
    tau_mean, hist = acceptance(result.taus, spec.block_size)
    report = {"policy": spec.policy, "budget": spec.budget_label, "block_size": spec.block_size,
              "temperature": spec.temperature, "exact": spec.exact, "tokens": result.tokens, "new_tokens": new_tokens,
              "seconds": result.seconds, "tokens_per_s": new_tokens / result.seconds, "rounds": result.rounds,
              "tau_mean": tau_mean, "accept_hist": hist, "budget_hist": budget_counts(result.budgets),
              "seconds_all": [r.seconds for r in results]}
    if spec.auto:
        report.update(budget_rounds=result.budgets.tolist(), costs=result.costs.as_dict())
    return report


def run(f) -> None:
    logging.set_verbosity(logging.ERROR)  # keep checkpoint-library chatter out of the report
    check_flags(f)
    cli.join_processes(f)
    ops.set_implementation(f.kernels)
    inputs = check(f)
    prompts, spec, mesh = inputs.prompts, inputs.spec, inputs.mesh
    target, drafter = load_models(f.init, f.config, f.drafter, f.block_size, f.seed, f.policy != "ar", mesh, f.dtype)
    decoder = Decoder(target, drafter, mesh=mesh)
    report = run_policy(decoder, prompts, spec, f.seed, inputs.cache_len,
                        step_costs(decoder, prompts, spec, inputs.cache_len, f.cost_table), f.reps)
    runs = [report]
    if f.compare and f.policy != "ar":
        ar_spec = dataclasses.replace(spec, policy="ar", budget=0, auto_budgets=())
        baseline = run_policy(decoder, prompts, ar_spec, f.seed, inputs.cache_len, reps=f.reps)
        runs = [baseline, report]
        report["ar"] = {k: baseline[k] for k in ("tokens_per_s", "seconds", "rounds", "tokens")}
        report["identical_to_ar"] = baseline["tokens"] == report["tokens"]
        report["speedup_over_ar"] = report["tokens_per_s"] / baseline["tokens_per_s"]
    print_report(prompts, runs, inputs.tokenizer)
    if f.compare and f.policy != "ar":
        print(f"\n{f.policy} output identical to ar: {report['identical_to_ar']}  "
              f"(speedup {report['speedup_over_ar']:.2f}x on this device)")
    report.update(init=f.init, drafter=f.drafter if drafter is not None else None, mesh=f.mesh,
                  kernels=f.kernels, backend=jax.default_backend(), dtype=target.cfg.dtype,
                  eos_token_ids=list(spec.eos_token_ids))
    if f.json:
        print(json.dumps(report))
    if f.out and jax.process_index() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
        with open(f.out, "w") as fh:
            json.dump(report, fh, indent=1)


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
    cli.script(define_flags, run)
