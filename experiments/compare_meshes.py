"""Same tokens on a mesh as on one device: the shipped models decode held-out prompts on one device and on --mesh,
case by case (policy x budget x batch x dtype), and every output is compared token for token.

One process, two GPUs (the one-device run uses the first GPU):
  NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 experiments/compare_meshes.py --mesh=tp=2 \
      --out=experiments/results/sharded_x2.json --tokens_out=/tmp/one_device_tokens.json
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
from typing import NamedTuple

import jax
import numpy as np
from absl import flags, logging
from flax import nnx

from kdtree_jax import cli, model_dir, sharding
from kdtree_jax.checkpoint import restore_target
from kdtree_jax.data import eval_prompts, load_tokenizer
from kdtree_jax.decode import DecodeSpec, Decoder, agreeing_prefix, check_spec, decode_in_batches

FLAGS = flags.FLAGS
DTYPES = ("float32", "bfloat16")


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    def d(define, name, default, help_text):
        define(name, default, help=help_text, flag_values=fv)
    d(flags.DEFINE_string, "target", "checkpoints/target", "target checkpoint directory")
    d(flags.DEFINE_string, "drafter", "checkpoints/drafter", "drafter checkpoint directory")
    d(flags.DEFINE_string, "tokenizer", "checkpoints/tokenizer.json", "tokenizer of the checkpoints")
    d(flags.DEFINE_integer, "num_prompts", 32, "held-out prompts")
    d(flags.DEFINE_integer, "prompt_tokens", 64, "tokens per prompt")
    d(flags.DEFINE_integer, "max_new_tokens", 128, "tokens generated per prompt")
    d(flags.DEFINE_list, "policies", ["ar", "chain", "ddtree:8", "ddtree:32"], "cases: ar, chain or ddtree:<budget B>")
    d(flags.DEFINE_list, "batch_sizes", ["1", "8"], "streams decoded together")
    d(flags.DEFINE_list, "dtypes", list(DTYPES), "model dtypes (float32 runs at the highest matmul precision)")
    d(flags.DEFINE_string, "mesh", "tp=2", "the mesh compared with one device, e.g. 'tp=2' or 'data=2,tp=4'")
    d(flags.DEFINE_string, "reference", "", "a --tokens_out JSON of an earlier run: its one-device tokens are the "
      "reference (no one-device decode here; needed when the devices are spread over processes)")
    d(flags.DEFINE_string, "tokens_out", "", "write the one-device tokens of every case here (a --reference for later "
      "runs)")
    d(flags.DEFINE_integer, "seed", 0, "prompt choice")
    d(flags.DEFINE_string, "out", "experiments/results/sharding/sharded.json", "JSON output (written by process 0)")
    cli.define_overwrite(fv)
    cli.define_process_flags(fv)


class Inputs(NamedTuple):
    cases: list
    batches: list
    reference: dict | None
    tokenizer: object
    mesh: object
    eos: tuple[int, ...]  # the ids the streams stop at


def check_flags(f) -> tuple[list, list, dict | None]:
    """(cases, batch sizes, the --reference JSON or None): the flags and the files they name that no JAX backend is
    needed for (this runs before the processes join)."""
    for name, minimum in (("num_prompts", 1), ("prompt_tokens", 1), ("max_new_tokens", 1)):
        cli.at_least(f, name, minimum)
    cli.seed(f)
    if not f.policies:
        cli.refuse(f, "policies", "is empty; give at least one case")
    cases = [parse_case(c) for c in f.policies]
    batches = cli.int_list(f, "batch_sizes", 1)
    if not f.dtypes or any(d not in DTYPES for d in f.dtypes):
        cli.refuse(f, "dtypes", f"must list dtypes of {DTYPES}")
    if not f.mesh.strip():
        cli.refuse(f, "mesh", "is empty: name the mesh to compare with one device, e.g. --mesh=tp=2")
    cli.check_process_flags(f)
    if f.num_processes > 1 and not f.reference:
        cli.refuse(f, "num_processes", "> 1 needs --reference=<one-device tokens JSON> (the processes' devices hold "
                   "no single-device run)")
    if not f.out:
        cli.refuse(f, "out", "is empty; name the JSON file to write")
    cli.output_path(f, "out")
    cli.output_path(f, "tokens_out")
    reference = None
    if f.reference:
        with cli.about(f, "reference"):
            from kdtree_jax.hf_import import read_json
            reference = read_json(f.reference, "a --tokens_out JSON")
            tokens = reference.get("tokens")
            if not isinstance(tokens, dict):
                raise ValueError("has no 'tokens' object: it is not the --tokens_out JSON of an earlier run")
            missing = [case_key(p, b, n, d) for p, b in cases for n in batches for d in f.dtypes
                       if case_key(p, b, n, d) not in tokens]
            if missing:
                raise ValueError(f"has no case {missing[0]}; run it with the same --policies, --batch_sizes and "
                                 f"--dtypes")
    return cases, batches, reference


def check(f, checked_flags: tuple | None = None) -> Inputs:
    """Every input before any weight is read (after the processes joined: the mesh needs every device);
    checked_flags: what check_flags returned, when it ran already."""
    cases, batches, reference = checked_flags or check_flags(f)
    with cli.about(f, "target"):
        if model_dir.checkpoint_kind(f.target) != model_dir.ORBAX:
            raise ValueError("is not a target checkpoint of ours (numbered step directories); only those are "
                             "compared")
        target = model_dir.target_config(f.target)
    with cli.about(f, "drafter"):
        drafter = model_dir.drafter_config(f.drafter, target)
    with cli.about(f, "tokenizer"):
        tokenizer = load_tokenizer(f.tokenizer)
        eos = model_dir.eos_token_ids(f.target, target)
        model_dir.check_tokenizer(tokenizer, f.tokenizer, target, eos)
    with cli.about(f, "mesh"):
        mesh = sharding.parse_mesh(f.mesh)
        model_dir.check_mesh(target, mesh)
    for policy, budget in cases:
        for batch in batches:
            prompts = [[0] * f.prompt_tokens] * min(batch, f.num_prompts)
            spec = DecodeSpec(policy=policy, budget=budget, block_size=drafter.block_size,
                              max_new_tokens=f.max_new_tokens, eos_token_ids=eos)
            check_spec(spec, target, drafter, prompts, Decoder.default_cache_len(spec, prompts), mesh)
    return Inputs(cases, batches, reference, tokenizer, mesh, eos)


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


def run(f) -> None:
    logging.set_verbosity(logging.ERROR)
    checked_flags = check_flags(f)
    cli.join_processes(f)
    inputs = check(f, checked_flags)
    cases, batches, reference, mesh = inputs.cases, inputs.batches, inputs.reference, inputs.mesh
    prompts = [list(p.ids) for p in eval_prompts(inputs.tokenizer, f.num_prompts, f.prompt_tokens, seed=f.seed)]
    rows, one_device_tokens = [], {}
    for dtype in f.dtypes:
        precision = "highest" if dtype == "float32" else None
        with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
            target = restore_target(f.target, dtype=dtype, shardings=sharding.restore_shardings(mesh))
            drafter = model_dir.load_drafter(f.drafter, target.cfg, mesh=mesh)
            on_mesh = Decoder(target, drafter, mesh=mesh)
            one = None
            if reference is None:
                one_target = restore_target(f.target, dtype=dtype)
                one = Decoder(one_target, model_dir.load_drafter(f.drafter, one_target.cfg))
            block = drafter.cfg.block_size
            for policy, budget in cases:
                spec = DecodeSpec(policy=policy, budget=budget, block_size=block,
                                  max_new_tokens=f.max_new_tokens, eos_token_ids=inputs.eos)
                for batch in batches:
                    key, start = case_key(policy, budget, batch, dtype), time.monotonic()
                    got = decode_in_batches(on_mesh, prompts, spec, batch, f.seed)
                    if reference is None:
                        want = decode_in_batches(one, prompts, spec, batch, f.seed)["tokens"]
                    else:
                        want = reference["tokens"][key]
                    one_device_tokens[key] = want
                    row = {"policy": policy, "budget": budget, "batch": batch, "dtype": dtype,
                           "processes": jax.process_count(), "identical_tokens": got["tokens"] == want,
                           "tokens_before_divergence": agreeing_prefix(got["tokens"], want),
                           "tau_mesh": got["tau"], "tokens_per_s_mesh": got["tokens_per_s"],
                           "first_divergence": first_divergence(prompts, got["tokens"], want,
                                                                {"mesh": on_mesh, "one_device": one})}
                    row["seconds_case"] = time.monotonic() - start
                    rows.append(row)
                    write_results(f, rows, one_device_tokens, len(prompts))
                    if jax.process_index() == 0:
                        print(f"{key}: identical={row['identical_tokens']} "
                              f"agree={row['tokens_before_divergence']:.3f} ({row['seconds_case']:.0f} s)", flush=True)
    if jax.process_index() == 0:
        print_table(rows)


def write_results(f, rows, one_device_tokens, num_prompts: int) -> None:
    """The JSON (--out) and the one-device tokens (--tokens_out) so far; process 0 writes, after every case, so a run
    cut short keeps the cases it finished."""
    if jax.process_index() != 0:
        return
    meta = {"mesh": f.mesh, "devices": [str(d) for d in jax.devices()], "backend": jax.default_backend(),
            "jax": jax.__version__, "host": platform.node(), "processes": jax.process_count(),
            "num_prompts": num_prompts, "prompt_tokens": f.prompt_tokens,
            "max_new_tokens": f.max_new_tokens, "reference": f.reference or "one device in this process",
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
    with open(f.out, "w") as fh:
        json.dump({"meta": meta, "cases": rows}, fh, indent=1)
    if f.tokens_out:
        with open(f.tokens_out, "w") as fh:
            json.dump({"meta": meta, "tokens": one_device_tokens}, fh)


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
    cli.script(define_flags, run)
