"""Generate with ar | chain | ddtree decoding and report tokens, speed and acceptance.

Token ids (no tokenizer), a random tiny model:
  python experiments/generate.py --config=tiny --init=random --policy=ddtree --budget=16 \
      --prompt=1,2,3 --prompt=4,5 --max_new_tokens=32 --json
The shipped models on a held-out prompt, DDTree beside AR (what `make demo` runs):
  python experiments/generate.py --init=checkpoints/target --drafter=checkpoints/drafter \
      --tokenizer=checkpoints/tokenizer.json --held_out_prompts=1 --policy=ddtree --budget=32 --compare

Each --prompt is one stream: text when a tokenizer is given, else comma-separated token ids. With --json the last line
printed is one JSON object.
"""
from __future__ import annotations

import json

from absl import flags, logging
from flax import nnx

from kdtree_jax import cli
from kdtree_jax import config as config_lib
from kdtree_jax import sharding
from kdtree_jax.decode import DecodeSpec, Decoder, GenerateResult, acceptance
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny", f"model preset: {sorted(config_lib.PRESETS)} (ignored when --init is a checkpoint)")
flags.DEFINE_string("init", "random", "'random' or a target checkpoint directory")
flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "dtype of a random target (default: the preset's)")
flags.DEFINE_string("drafter", "random", "'random' or a drafter checkpoint directory (chain / ddtree)")
flags.DEFINE_string("tokenizer", "", "tokenizer.json: prompts are text and outputs are decoded (empty: token ids)")
flags.DEFINE_integer("seed", 0, "seed of random init and sampling")
flags.DEFINE_multi_string("prompt", None, "one stream's prompt (text, or comma-separated ids); repeat for more")
flags.DEFINE_integer("held_out_prompts", 0, "add this many prompts drawn from held-out stdlib files (needs tokenizer)")
flags.DEFINE_integer("prompt_tokens", 64, "length of each held-out prompt in tokens")
flags.DEFINE_integer("max_new_tokens", 32, "tokens to generate per stream")
flags.DEFINE_enum("policy", "ar", ["ar", "chain", "ddtree"], "decoding policy")
flags.DEFINE_integer("budget", 16, "ddtree: non-root tree nodes B")
flags.DEFINE_integer("block_size", 8, "block size L of a random drafter (a checkpointed drafter has its own)")
flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples the target per tree node")
flags.DEFINE_integer("cache_len", 0, "cache rows per stream (0 = just enough)")
flags.DEFINE_bool("compare", False, "also run ar and report both side by side, with whether outputs are identical")
flags.DEFINE_string("mesh", "", "device mesh, e.g. 'tp=8' or 'data=2,tp=4' (empty: one device); for N fake CPU "
                    "devices set XLA_FLAGS=--xla_force_host_platform_device_count=N")
flags.DEFINE_bool("json", False, "print one JSON object as the last line")


def load_models(init: str, preset: str, drafter_init: str, block_size: int, seed: int, need_drafter: bool,
                mesh=None, dtype: str | None = None):
    """mesh: a checkpointed target is restored straight into its shards. dtype: of a random target."""
    if init == "random":
        cfg = config_lib.preset(preset)
        target = Transformer(cfg.replace(dtype=dtype) if dtype else cfg, nnx.Rngs(seed))
    else:
        from kdtree_jax.checkpoint import restore_target
        target = restore_target(init, shardings=sharding.restore_shardings(mesh) if mesh is not None else None)
    if not need_drafter:
        return target, None
    if drafter_init == "random":
        drafter = Drafter(config_lib.tiny_drafter(target.cfg, block_size), target.cfg, nnx.Rngs(seed + 1))
    else:
        from kdtree_jax.checkpoint import restore_drafter
        drafter = restore_drafter(drafter_init, target.cfg)
    return target, drafter


def read_prompts(texts, tokenizer, held_out: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    prompts = []
    for text in texts or []:
        if tokenizer is not None:
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


def run_policy(decoder: Decoder, prompts, spec: DecodeSpec, seed: int, cache_len: int | None) -> dict:
    decoder.generate(prompts, spec, seed=seed, cache_len=cache_len)  # compile + warm up
    result: GenerateResult = decoder.generate(prompts, spec, seed=seed, cache_len=cache_len)
    new_tokens = sum(len(t) for t in result.tokens)
    tau_mean, hist = acceptance(result.taus, spec.block_size)
    return {"policy": spec.policy, "budget": spec.tree_budget, "block_size": spec.block_size,
            "temperature": spec.temperature, "tokens": result.tokens, "new_tokens": new_tokens,
            "seconds": result.seconds, "tokens_per_s": new_tokens / result.seconds, "rounds": result.rounds,
            "tau_mean": tau_mean, "accept_hist": hist}


def main(argv):
    del argv
    logging.set_verbosity(logging.ERROR)  # keep checkpoint-library chatter out of the report
    tokenizer = None
    if FLAGS.tokenizer:
        from kdtree_jax.data import load_tokenizer
        tokenizer = load_tokenizer(FLAGS.tokenizer)
    prompts = read_prompts(FLAGS.prompt, tokenizer, FLAGS.held_out_prompts, FLAGS.prompt_tokens, FLAGS.seed)
    mesh = sharding.parse_mesh(FLAGS.mesh)
    target, drafter = load_models(FLAGS.init, FLAGS.config, FLAGS.drafter, FLAGS.block_size, FLAGS.seed,
                                  FLAGS.policy != "ar", mesh, FLAGS.dtype)
    block = drafter.cfg.block_size if drafter is not None else FLAGS.block_size
    spec = DecodeSpec(policy=FLAGS.policy, budget=FLAGS.budget, block_size=block, temperature=FLAGS.temperature,
                      max_new_tokens=FLAGS.max_new_tokens, eos_token_id=target.cfg.eos_token_id)
    decoder = Decoder(target, drafter, mesh=mesh)
    cache_len = FLAGS.cache_len or None
    report = run_policy(decoder, prompts, spec, FLAGS.seed, cache_len)
    runs = [report]
    if FLAGS.compare and FLAGS.policy != "ar":
        baseline = run_policy(decoder, prompts, DecodeSpec(policy="ar", block_size=block,
                                                           temperature=FLAGS.temperature,
                                                           max_new_tokens=FLAGS.max_new_tokens,
                                                           eos_token_id=target.cfg.eos_token_id),
                              FLAGS.seed, cache_len)
        runs = [baseline, report]
        report["ar"] = {k: baseline[k] for k in ("tokens_per_s", "seconds", "rounds", "tokens")}
        report["identical_to_ar"] = baseline["tokens"] == report["tokens"]
        report["speedup_over_ar"] = report["tokens_per_s"] / baseline["tokens_per_s"]
    print_report(prompts, runs, tokenizer)
    if FLAGS.compare and FLAGS.policy != "ar":
        print(f"\n{FLAGS.policy} output identical to ar: {report['identical_to_ar']}  "
              f"(speedup {report['speedup_over_ar']:.2f}x on this CPU)")
    if FLAGS.json:
        print(json.dumps(report))


def print_report(prompts, runs, tokenizer) -> None:
    show = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: ",".join(map(str, ids)))
    for i, prompt in enumerate(prompts):
        print(f"=== stream {i}: prompt ({len(prompt)} tokens) ===\n{show(prompt)}")
        print(f"=== stream {i}: generated by {runs[-1]['policy']} ===\n{show(runs[-1]['tokens'][i])}\n")
    print(f"{'policy':>8} {'budget':>6} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'rounds':>6} {'tau':>5}")
    for r in runs:
        print(f"{r['policy']:>8} {r['budget']:>6} {r['new_tokens']:>7} {r['seconds']:>8.3f} "
              f"{r['tokens_per_s']:>8.1f} {r['rounds']:>6} {r['tau_mean']:>5.2f}")


if __name__ == "__main__":
    cli.run(main)
