"""bench_kernels section `mgpu` (not in the default list): the experimental Mosaic GPU prefix attention
(pallas_kernels/prefix_attention_mgpu.py) beside the Triton tree_verify_attention, on the `attention` section's cases
whose T x H query rows fill 64-row tiles, with no tree node visible.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.kernels_attention import K26_SCALE, attention_cases, attention_cost, attention_inputs
from experiments.timing import Job, rel_err, roofline, time_jobs
from pallas_kernels import prefix_attention_mgpu as mgpu_attn
from pallas_kernels import tree_verify_attention as attn


def run_attention_mgpu(ceil: dict, results: list, deadline: float, reps: int, quick: bool, save) -> None:
    """The experimental Mosaic GPU prefix kernel beside the Triton kernel, both at the Triton kernel's split count, on
    the attention cases whose T x H query rows fill 64-row tiles, with no tree node visible (so both attend the prefix
    only; the Triton kernel also walks the empty tree block). One input set (no rotation past the L2: a ratio, not a
    roofline); errors against the reference. One row per case appended to `results`, printed, then `save()`; no new
    case past `deadline` (time.time())."""
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(1)
    for ci, case in enumerate(attention_cases(quick)):
        s, t, h, p = case["streams"], case["nodes"], case["heads"], case["prefix"]
        rows = t * h
        if rows % mgpu_attn.BLOCK_Q:
            continue
        if time.time() > deadline:
            results.append(dict(case, skipped="time budget"))
            continue
        q_lat, q_rope, c_kv, k_rope, prefix_len, _ = attention_inputs(jax.random.key(5000 + ci), case, rng)
        visible = jnp.zeros((s, t, t), bool)
        pad = ((0, 0), (0, -(p + t) % mgpu_attn.BLOCK_KV), (0, 0))   # cache rows to whole blocks (never attended)
        splits = attn.default_config(s, rows, p + t).num_splits
        args = {"triton": (q_lat, q_rope, c_kv, k_rope, prefix_len, visible),
                "mgpu": (q_lat.reshape(s, rows, -1), q_rope.reshape(s, rows, -1), jnp.pad(c_kv, pad),
                         jnp.pad(k_rope, pad), prefix_len)}
        fns = {"triton": jax.jit(lambda *a: attn.tree_verify_attention(*a, scale=K26_SCALE, interpret=interpret)),
               "mgpu": jax.jit(lambda *a: mgpu_attn.merge_partials(*mgpu_attn.prefix_attention_partials(
                   *a, scale=K26_SCALE, num_splits=splits, interpret=interpret)))}
        ref = attn.tree_verify_attention_reference(*args["triton"], scale=K26_SCALE).reshape(s, rows, -1)
        entry, jobs = dict(case, splits=splits, errors={}, failed={}), []
        for name, fn in fns.items():
            try:
                entry["errors"][name] = rel_err(fn(*args[name]).reshape(s, rows, -1), ref)
                jobs.append(Job(name, fn, [args[name]]))
            except Exception as e:  # noqa: BLE001 - a kernel that does not compile is a result
                entry["failed"][name] = f"{type(e).__name__}: {str(e)[:2000]}"
        times = time_jobs(jobs, reps) if jobs else {}
        flops, bytes_ = attention_cost(case)
        floor = roofline(flops, bytes_, ceil)
        entry.update({f"{name}_us": times[name]["us"] for name in times},
                     **{f"{name}_roofline_fraction": floor / times[name]["us"] for name in times}, timings=times)
        if "triton_us" in entry and "mgpu_us" in entry:
            entry["mgpu_speedup"] = entry["triton_us"] / entry["mgpu_us"]
        results.append(entry)
        _print_mgpu_row(entry)
        save()


def _print_mgpu_row(r):
    print(f"mgpu attention S={r['streams']} H={r['heads']:2d} N={r['prefix']:6d} T={r['nodes']:3d} splits "
          f"{r['splits']:3d} | triton {r.get('triton_us', float('nan')):8.1f} us | mgpu "
          f"{r.get('mgpu_us', float('nan')):8.1f} us | x {r.get('mgpu_speedup', float('nan')):5.2f} | errors "
          f"{r['errors']} | failed {sorted(r['failed'])}", flush=True)

