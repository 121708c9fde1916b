"""bench_kernels section `mgpu` (not in the default list; GPU only): the Mosaic GPU tree-verify attention
(pallas_kernels/tree_verify_attention_mgpu.py: the whole op, at its own and at the Triton kernel's split count, and
its kernel over the prefix alone) beside the Triton kernel and the XLA reference, on the `attention` section's
cases. On the CPU (--quick) the whole op can hang in Mosaic GPU's interpret mode (experiments/notes/kernels.md,
"The Mosaic GPU prefix kernel on the H200").
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.kernels.kernels_attention import K26_SCALE, attention_cases, attention_cost, attention_inputs
from experiments.timing import Job, rel_err, roofline, time_jobs
from pallas_kernels import tree_verify_attention_mgpu as mgpu_attn
from pallas_kernels import tree_verify_attention as attn
from pallas_kernels import tree_verify_attention_triton as attn_triton


def run_attention_mgpu(ceil: dict, results: list, deadline: float, reps: int, quick: bool, save) -> None:
    """Mosaic GPU variants beside the Triton kernel and the XLA reference on every attention case: `mgpu` the whole op
    (`tree_verify_attention_mgpu.tree_verify_attention`: the kernel over the prefix and the tree block under the case's
    ancestor mask, the merge) at its own split count (`default_num_splits`), `mgpu_triton_splits` the same at the
    Triton kernel's count where the two differ, `mgpu_registers_240_24` the whole op with FlashAttention-3's
    register split (240 per consumer thread, 24 per producer thread; `REGISTERS` is 232 / 40), and `mgpu_prefix` the
    kernel and merge over the prefix alone at mgpu's count (no tree block; its error is against the reference with no
    tree node visible). The cache is in whole
    64-row blocks (`attention_inputs`). One input set (no rotation past the L2: ratios, and roofline fractions of the
    whole case's cost); errors against the reference. One row per case appended to `results`, printed, then
    `save()`; no new case past `deadline` (time.time())."""
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(1)
    for ci, case in enumerate(attention_cases(quick)):
        s, t, h = case["streams"], case["nodes"], case["heads"]
        rows = t * h
        if time.time() > deadline:
            results.append(dict(case, skipped="time budget"))
            continue
        q_lat, q_rope, c_kv, k_rope, prefix_len, visible = attention_inputs(jax.random.key(5000 + ci), case, rng)
        splits = mgpu_attn.default_num_splits(s, rows, c_kv.shape[1])
        triton_splits = attn.default_config(s, rows, c_kv.shape[1]).num_splits
        q_lat_rows = mgpu_attn.query_rows(q_lat)
        full = (q_lat, q_rope, c_kv, k_rope, prefix_len, visible)
        no_tree = (q_lat, q_rope, c_kv, k_rope, prefix_len, jnp.zeros_like(visible))
        args = {"triton": full, "mgpu": full, "reference": full,
                "mgpu_prefix": (q_lat_rows, mgpu_attn.query_rows(q_rope), c_kv, k_rope, prefix_len,
                                mgpu_attn.frame_bias(prefix_len, jnp.zeros((s, 0, 0), bool), 1,
                                                     q_lat_rows.shape[1]))}
        fns = {"triton": jax.jit(lambda *a: attn_triton.tree_verify_attention(*a, scale=K26_SCALE)),
               "mgpu": jax.jit(lambda *a: mgpu_attn.tree_verify_attention(*a, scale=K26_SCALE, interpret=interpret)),
               "mgpu_prefix": jax.jit(lambda *a: attn.combine_partials(
                   *mgpu_attn.attention_partials(*a, scale=K26_SCALE, num_nodes=0, num_splits=splits,
                                                 interpret=interpret), normalized=True)[:, :rows]),
               "reference": jax.jit(lambda *a: attn.tree_verify_attention_reference(*a, scale=K26_SCALE))}
        args["mgpu_registers_240_24"] = full
        fns["mgpu_registers_240_24"] = jax.jit(lambda *a: mgpu_attn.tree_verify_attention(
            *a, scale=K26_SCALE, registers=(240, 24), interpret=interpret))
        if triton_splits != splits:
            args["mgpu_triton_splits"] = full
            fns["mgpu_triton_splits"] = jax.jit(lambda *a: mgpu_attn.tree_verify_attention(
                *a, scale=K26_SCALE, num_splits=triton_splits, interpret=interpret))
        refs = {name: attn.tree_verify_attention_reference(*a, scale=K26_SCALE).reshape(s, rows, -1)
                for name, a in (("full", full), ("no_tree", no_tree))}
        entry, jobs = dict(case, splits=splits, triton_splits=triton_splits, errors={}, failed={}), []
        for name, fn in fns.items():
            try:
                ref = refs["no_tree" if name == "mgpu_prefix" else "full"]
                entry["errors"][name] = rel_err(fn(*args[name]).reshape(s, rows, -1), ref)
                jobs.append(Job(name, fn, [args[name]]))
            except Exception as e:  # noqa: BLE001 - a kernel that does not compile is a result
                entry["failed"][name] = f"{type(e).__name__}: {str(e)[:2000]}"
        times = time_jobs(jobs, reps) if jobs else {}
        flops, bytes_ = attention_cost(case)
        floor = roofline(flops, bytes_, ceil)
        entry.update({f"{name}_us": times[name]["us"] for name in times},
                     **{f"{name}_roofline_fraction": floor / times[name]["us"] for name in times}, timings=times)
        for peer in ("triton", "reference"):
            if f"{peer}_us" in entry and "mgpu_us" in entry:
                entry[f"mgpu_speedup_vs_{peer}"] = entry[f"{peer}_us"] / entry["mgpu_us"]
        results.append(entry)
        _print_mgpu_row(entry)
        save()


def _print_mgpu_row(r):
    us = lambda name: r.get(f"{name}_us", float("nan"))  # noqa: E731
    print(f"mgpu attention S={r['streams']} H={r['heads']:2d} N={r['prefix']:6d} T={r['nodes']:3d} splits "
          f"{r['splits']:3d} | triton {us('triton'):8.1f} us | mgpu {us('mgpu'):8.1f} (prefix alone "
          f"{us('mgpu_prefix'):8.1f}; at triton's {r['triton_splits']} splits {us('mgpu_triton_splits'):8.1f}) | ref "
          f"{us('reference'):8.1f} | 240/24 regs {us('mgpu_registers_240_24'):8.1f} | x triton "
          f"{r.get('mgpu_speedup_vs_triton', float('nan')):5.2f}, "
          f"x ref {r.get('mgpu_speedup_vs_reference', float('nan')):5.2f}"
          f" | errors {r['errors']} | failed {sorted(r['failed'])}", flush=True)
