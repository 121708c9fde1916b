"""Same tokens on a mesh as on one device: the shipped models decode held-out prompts on one device and on --mesh,
case by case (policy x budget x batch x dtype), and every output is compared token for token.

One process, two GPUs (the one-device run uses the first GPU):
  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 experiments/compare_meshes.py --mesh=tp=2 \
      --out=experiments/results/sharding/sharded_x2.json --tokens_out=/tmp/one_device_tokens.json
Two processes with one GPU each, joined by jax.distributed (the path of an 8-GPU node or several hosts), compared
with the one-device tokens of an earlier run (--reference):
  for i in 0 1; do CUDA_VISIBLE_DEVICES=$i NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 experiments/compare_meshes.py \
      --mesh=tp=2 --num_processes=2 --process_id=$i --coordinator=127.0.0.1:8476 \
      --reference=/tmp/one_device_tokens.json --out=/tmp/sharded_2proc.json & sleep 2; done; wait
Both write the JSON's `cases` (policy, budget, batch, dtype, processes, identical_tokens, tokens_before_divergence;
where a case differs, its first divergence: stream, position, both tokens and both sides' top-2 logit margins there).
float32 runs use the highest matmul precision (so only the order of summation differs between the two); bf16 runs
report how far the outputs agree.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import time

import jax
import numpy as np
from absl import flags, logging
from flax import nnx

from kdtree_jax import cli, model_dir, sharding
from kdtree_jax.checkpoint import restore_target
from kdtree_jax.data import eval_prompts, load_tokenizer
from kdtree_jax.decode import DecodeSpec, Decoder, agreeing_prefix, decode_in_batches

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/target", "target checkpoint directory")
flags.DEFINE_string("drafter", "checkpoints/drafter", "drafter checkpoint directory")
flags.DEFINE_string("tokenizer", "checkpoints/tokenizer.json", "tokenizer of the checkpoints")
flags.DEFINE_integer("num_prompts", 32, "held-out prompts")
flags.DEFINE_integer("prompt_tokens", 64, "tokens per prompt")
flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per prompt")
flags.DEFINE_list("policies", ["ar", "chain", "ddtree:8", "ddtree:32"], "cases: ar, chain or ddtree:<budget B>")
flags.DEFINE_list("batch_sizes", ["1", "8"], "streams decoded together")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "model dtypes (float32 runs at the highest matmul precision)")
flags.DEFINE_string("mesh", "tp=2", "the mesh compared with one device, e.g. 'tp=2' or 'data=2,tp=4'")
flags.DEFINE_string("reference", "", "a --tokens_out JSON of an earlier run: its one-device tokens are the reference "
                    "(no one-device decode here; needed when the devices are spread over processes)")
flags.DEFINE_string("tokens_out", "", "write the one-device tokens of every case here (a --reference for later runs)")
flags.DEFINE_string("coordinator", "", "host:port of process 0 for jax.distributed.initialize (multi-process)")
flags.DEFINE_integer("num_processes", 1, "processes joined by jax.distributed")
flags.DEFINE_integer("process_id", 0, "this process's index")
flags.DEFINE_integer("seed", 0, "prompt choice")
flags.DEFINE_string("out", "experiments/results/sharding/sharded.json", "JSON output (written by process 0)")


def parse_case(text: str) -> tuple[str, int]:
    """'ar' | 'chain' | 'ddtree:<B>' -> (policy, budget)."""
    policy, _, budget = text.partition(":")
    if policy not in ("ar", "chain", "ddtree") or (policy == "ddtree") != bool(budget) or (
            budget and not budget.isdigit()):
        raise ValueError(f"--policies entry {text!r} is not 'ar', 'chain' or 'ddtree:<budget>'")
    return policy, int(budget or 0)


def case_key(policy: str, budget: int, batch: int, dtype: str) -> str:
    return f"{policy}:{budget}/batch={batch}/{dtype}"


def last_logits(decoder: Decoder, tokens: list[int]) -> np.ndarray:
    """The target's next-token logits [V] after `tokens` (one causal forward with the decoder's params, on its mesh)."""
    def forward(params, ids):
        return nnx.merge(decoder.target_def, params).causal(ids).logits[0, -1]
    with jax.set_mesh(decoder.mesh) if decoder.mesh is not None else contextlib.nullcontext():
        logits = jax.jit(forward)(decoder.target_params, np.asarray([tokens], np.int32))
    return np.asarray(jax.device_get(logits), np.float64)


def top2_margin(logits: np.ndarray) -> float:
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def first_divergence(prompts, mesh_tokens, one_tokens, decoders: dict) -> dict | None:
    """Where the first stream that differs first differs, with the top-2 logit margin of each side there (from a
    causal forward of prompt + the common tokens; `decoders` maps 'one' / 'mesh' to a Decoder, or None)."""
    for stream, (got, want) in enumerate(zip(mesh_tokens, one_tokens)):
        if got == want:
            continue
        position = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        found = {"stream": stream, "position": position,
                 "token_mesh": got[position] if position < len(got) else None,
                 "token_one_device": want[position] if position < len(want) else None}
        context = prompts[stream] + want[:position]
        for side, decoder in decoders.items():
            if decoder is not None:
                found[f"top2_margin_{side}"] = top2_margin(last_logits(decoder, context))
        return found
    return None


def main(argv):
    del argv
    logging.set_verbosity(logging.ERROR)
    if FLAGS.num_processes > 1:
        if not FLAGS.coordinator or not FLAGS.reference:
            raise ValueError("--num_processes > 1 needs --coordinator=host:port and --reference=<one-device tokens "
                             "JSON> (the processes' devices hold no single-device run)")
        jax.distributed.initialize(coordinator_address=FLAGS.coordinator, num_processes=FLAGS.num_processes,
                                   process_id=FLAGS.process_id)
    cases = [parse_case(c) for c in FLAGS.policies]
    batches = [int(b) for b in FLAGS.batch_sizes]
    reference = None
    if FLAGS.reference:
        with open(FLAGS.reference) as f:
            reference = json.load(f)
    tokenizer = load_tokenizer(FLAGS.tokenizer)
    prompts = [list(p.ids) for p in eval_prompts(tokenizer, FLAGS.num_prompts, FLAGS.prompt_tokens, seed=FLAGS.seed)]
    mesh = sharding.parse_mesh(FLAGS.mesh)
    if mesh is None:
        raise ValueError("--mesh is empty: name the mesh to compare with one device, e.g. --mesh=tp=2")
    rows, one_device_tokens = [], {}
    for dtype in FLAGS.dtypes:
        precision = "highest" if dtype == "float32" else None
        with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
            target = restore_target(FLAGS.target, dtype=dtype, shardings=sharding.restore_shardings(mesh))
            drafter = model_dir.load_drafter(FLAGS.drafter, target.cfg, mesh=mesh)
            on_mesh = Decoder(target, drafter, mesh=mesh)
            one = None
            if reference is None:
                one_target = restore_target(FLAGS.target, dtype=dtype)
                one = Decoder(one_target, model_dir.load_drafter(FLAGS.drafter, one_target.cfg))
            block = drafter.cfg.block_size
            for policy, budget in cases:
                spec = DecodeSpec(policy=policy, budget=budget, block_size=block,
                                  max_new_tokens=FLAGS.max_new_tokens, eos_token_id=target.cfg.eos_token_id)
                for batch in batches:
                    key, start = case_key(policy, budget, batch, dtype), time.monotonic()
                    got = decode_in_batches(on_mesh, prompts, spec, batch, FLAGS.seed)
                    if reference is None:
                        want = decode_in_batches(one, prompts, spec, batch, FLAGS.seed)["tokens"]
                    elif key in reference["tokens"]:
                        want = reference["tokens"][key]
                    else:
                        raise ValueError(f"--reference {FLAGS.reference} has no case {key}; run it with the same "
                                         f"--policies, --batch_sizes and --dtypes")
                    one_device_tokens[key] = want
                    row = {"policy": policy, "budget": budget, "batch": batch, "dtype": dtype,
                           "processes": jax.process_count(), "identical_tokens": got["tokens"] == want,
                           "tokens_before_divergence": agreeing_prefix(got["tokens"], want),
                           "tau_mesh": got["tau"], "tokens_per_s_mesh": got["tokens_per_s"],
                           "first_divergence": first_divergence(prompts, got["tokens"], want,
                                                                {"mesh": on_mesh, "one_device": one})}
                    row["seconds_case"] = time.monotonic() - start
                    rows.append(row)
                    write_results(rows, one_device_tokens, len(prompts))
                    if jax.process_index() == 0:
                        print(f"{key}: identical={row['identical_tokens']} "
                              f"agree={row['tokens_before_divergence']:.3f} ({row['seconds_case']:.0f} s)", flush=True)
    if jax.process_index() == 0:
        print_table(rows)


def write_results(rows, one_device_tokens, num_prompts: int) -> None:
    """The JSON (--out) and the one-device tokens (--tokens_out) so far; process 0 writes, after every case, so a run
    cut short keeps the cases it finished."""
    if jax.process_index() != 0:
        return
    meta = {"mesh": FLAGS.mesh, "devices": [str(d) for d in jax.devices()], "backend": jax.default_backend(),
            "jax": jax.__version__, "host": platform.node(), "processes": jax.process_count(),
            "num_prompts": num_prompts, "prompt_tokens": FLAGS.prompt_tokens,
            "max_new_tokens": FLAGS.max_new_tokens, "reference": FLAGS.reference or "one device in this process",
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump({"meta": meta, "cases": rows}, f, indent=1)
    if FLAGS.tokens_out:
        with open(FLAGS.tokens_out, "w") as f:
            json.dump({"meta": meta, "tokens": one_device_tokens}, f)


def print_table(rows) -> None:
    print(f"{'dtype':>9} {'batch':>5} {'policy':>7} {'B':>4} {'procs':>5} {'identical':>9} {'agree':>6} "
          f"{'first divergence (stream, pos, margins mesh / one)':>50}")
    for r in rows:
        d = r["first_divergence"]
        where = "" if d is None else (f"s{d['stream']} @{d['position']} "
                                      f"{d.get('top2_margin_mesh', float('nan')):.2e} / "
                                      f"{d.get('top2_margin_one_device', float('nan')):.2e}")
        print(f"{r['dtype']:>9} {r['batch']:>5} {r['policy']:>7} {r['budget']:>4} {r['processes']:>5} "
              f"{str(r['identical_tokens']):>9} {r['tokens_before_divergence']:>6.3f} {where:>50}")


if __name__ == "__main__":
    cli.run(main)
