"""Generate with ar | chain | ddtree decoding and report tokens, speed and acceptance.

  python experiments/generate.py --config=tiny --init=random --policy=ddtree --budget=16 \
      --prompt=1,2,3 --prompt=4,5 --max_new_tokens=32 --json

Each --prompt is one stream (comma-separated token ids). With --json the last line printed is one JSON object.
"""
from __future__ import annotations

import json

import numpy as np
from absl import app, flags, logging
from flax import nnx

from kdtree_jax import config as config_lib
from kdtree_jax.decode import DecodeSpec, Decoder
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "tiny", f"model preset: {sorted(config_lib.PRESETS)} (ignored when --init is a checkpoint)")
flags.DEFINE_string("init", "random", "'random' or a target checkpoint directory")
flags.DEFINE_string("drafter", "random", "'random' or a drafter checkpoint directory (chain / ddtree)")
flags.DEFINE_integer("seed", 0, "seed of random init and sampling")
flags.DEFINE_multi_string("prompt", ["1,2,3,4,5"], "a prompt as comma-separated token ids; repeat for more streams")
flags.DEFINE_integer("max_new_tokens", 32, "tokens to generate per stream")
flags.DEFINE_enum("policy", "ar", ["ar", "chain", "ddtree"], "decoding policy")
flags.DEFINE_integer("budget", 16, "ddtree: non-root tree nodes B")
flags.DEFINE_integer("block_size", 8, "drafter block size L (a random drafter is built with it)")
flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples the target per tree node")
flags.DEFINE_integer("cache_len", 0, "cache rows per stream (0 = just enough)")
flags.DEFINE_bool("json", False, "print one JSON object as the last line")


def load_models(init: str, preset: str, drafter_init: str, block_size: int, seed: int, need_drafter: bool):
    if init == "random":
        target = Transformer(config_lib.preset(preset), nnx.Rngs(seed))
    else:
        from kdtree_jax.checkpoint import restore_target
        target = restore_target(init)
    if not need_drafter:
        return target, None
    if drafter_init == "random":
        drafter = Drafter(config_lib.tiny_drafter(target.cfg, block_size), target.cfg, nnx.Rngs(seed + 1))
    else:
        from kdtree_jax.checkpoint import restore_drafter
        drafter = restore_drafter(drafter_init, target.cfg)
    return target, drafter


def parse_prompt(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as err:
        raise ValueError(f"--prompt={text!r} must be comma-separated token ids") from err


def main(argv):
    del argv
    prompts = [parse_prompt(p) for p in FLAGS.prompt]
    target, drafter = load_models(FLAGS.init, FLAGS.config, FLAGS.drafter, FLAGS.block_size, FLAGS.seed,
                                  FLAGS.policy != "ar")
    block = drafter.cfg.block_size if drafter is not None else FLAGS.block_size
    spec = DecodeSpec(policy=FLAGS.policy, budget=FLAGS.budget, block_size=block, temperature=FLAGS.temperature,
                      max_new_tokens=FLAGS.max_new_tokens, eos_token_id=target.cfg.eos_token_id)
    decoder = Decoder(target, drafter)
    decoder.generate(prompts, spec, seed=FLAGS.seed, cache_len=FLAGS.cache_len or None)  # compile + warm up
    result = decoder.generate(prompts, spec, seed=FLAGS.seed, cache_len=FLAGS.cache_len or None)
    new_tokens = sum(len(t) for t in result.tokens)
    taus = result.taus[result.taus > 0]
    report = {
        "policy": FLAGS.policy, "budget": spec.tree_budget, "block_size": block, "temperature": FLAGS.temperature,
        "tokens": result.tokens, "new_tokens": new_tokens, "seconds": result.seconds,
        "tokens_per_s": new_tokens / result.seconds, "rounds": result.rounds,
        "tau_mean": float(taus.mean()) if taus.size else 0.0,
        "accept_hist": np.bincount(taus, minlength=block + 1)[1:].tolist(),
    }
    for i, toks in enumerate(result.tokens):
        logging.info("stream %d: %s", i, toks)
    logging.info("%s: %d tokens in %.3f s (%.1f tok/s), %d rounds, tau %.2f", FLAGS.policy, new_tokens,
                 result.seconds, report["tokens_per_s"], result.rounds, report["tau_mean"])
    if FLAGS.json:
        print(json.dumps(report))


if __name__ == "__main__":
    app.run(main)
