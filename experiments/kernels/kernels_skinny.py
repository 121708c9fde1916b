"""bench_kernels section `skinny` (not in the default list; GPU only): `skinny_matmul` (Triton) against XLA's own
code for the same product with the same fusions (`skinny_matmul_reference` under jit: XLA fuses the norm and the
residual add as it does in the model), side by side, at the products of one MoE layer of the tp=8 share of Kimi K2.6,
for M = 1, 8, 33 and 64 rows (AR at 1 and 8 streams, a B=32 verify at one stream, 64 rows).

    cases      PRODUCTS: q_a (with input_layernorm), kv_a, q_b (with q_a_norm), o_proj (with the residual add), the
               shared expert's gate and up (with post_attention_layernorm) and down, the router (f32); x and w random
    variants   kernel (default_tiling), n128 (128 columns a program), n256_k64 (256 columns, 64-deep steps: with the
               weight [N, K], 128-byte runs of each weight row per load), fma (M <= 8: multiply-adds on the CUDA cores, no
               16-row tensor-core tile; 32-deep steps), fma_k64 (the same, 64-deep: twice the bytes a load, twice
               the accumulator's registers), xla (XLA's product with the weight as the model stores it, [N, K]:
               at small M its GEMV reduces along contiguous memory) and xla_kn: the same product with the weight
               stored [K, N] (the model's layout before 2026-12-08; XLA's GEMV then reduces columns, 28% slower at
               M = 1 on an H100). Timed and dropped: wider grids (default_tiling aiming at 528 and 1056
               programs: no faster) and no split-K (3.5x slower at M = 1), k26.md
    times      `busy_us` (the sum of the call's device events) is what a product costs inside the decode step, where
               the calls run back to back; `us` (the device span of a call alone) adds the launch gaps between a
               call's events, which made XLA's 2-4 events a product look 2-3x slower than they are in the step
               (k26.md, "skinny_matmul in the step"); `kernels_us` names the events
    bytes      w, x and the output (and residual) once -> fraction of the copy bandwidth (by busy time)
    layer row  per M, the sums over PRODUCTS of each variant's busy time and span: what the layer's dense products
               cost
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.timing import Job, gb_per_s, rel_err, time_jobs
from pallas_kernels import skinny_matmul as SM

D, Q, C, R, H_LOCAL, P_R, V, I_LOCAL, E = 7168, 1536, 512, 64, 8, 192, 128, 256, 384
# (name, K, N, dtype, the norm fused, the residual in the epilogue): one layer of the tp=8 share
PRODUCTS = (("q_a", D, Q, jnp.bfloat16, True, False), ("kv_a", D, C + R, jnp.bfloat16, False, False),
            ("q_b", Q, H_LOCAL * P_R, jnp.bfloat16, True, False),
            ("o_proj", H_LOCAL * V, D, jnp.bfloat16, False, True),
            ("shared_gate", D, I_LOCAL, jnp.bfloat16, True, False),
            ("shared_up", D, I_LOCAL, jnp.bfloat16, True, False),
            ("shared_down", I_LOCAL, D, jnp.bfloat16, False, False), ("router", D, E, jnp.float32, False, False))
ROWS = (1, 8, 33, 64)
BLOCK_VARIANTS = {"n128": (128, None), "n256_k64": (256, 64)}  # variant: (block_n, block_k) for default_tiling


def product_inputs(seed: int, rows: int, k: int, n: int, dtype, norm: bool, residual: bool):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k)) * k ** -0.5, dtype)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal(k), dtype) if norm else None
    r = jnp.asarray(rng.standard_normal((rows, n)), dtype) if residual else None
    return x, w, g, r


def run_skinny(ceil: dict, results: list, deadline: float, reps: int, save) -> None:
    """Time every product at every M, the kernel's variants and XLA's; one row per case appended to `results`, a
    `layer` row per M, printed, then `save()`; no new case past `deadline` (time.time())."""
    if jax.default_backend() != "gpu":
        results.append(dict(skipped="skinny_matmul runs only on the GPU (Triton; the CPU tests use the interpreter)"))
        print("skinny: skipped, GPU only", flush=True)
        return
    for rows in ROWS:
        layer = {}
        for i, (name, k, n, dtype, norm, residual) in enumerate(PRODUCTS):
            case = dict(product=name, rows=rows, k=k, n=n, dtype=jnp.dtype(dtype).name, norm=norm, residual=residual)
            if time.time() > deadline:
                results.append(dict(case, skipped="time budget"))
                continue
            args = product_inputs(rows * 100 + i, rows, k, n, dtype, norm, residual)
            tiling = SM.default_tiling(k, n)
            tilings = {"kernel": tiling, **{v: SM.default_tiling(k, n, block_n=bn, block_k=bk)
                                            for v, (bn, bk) in BLOCK_VARIANTS.items()}}
            if rows <= SM.FMA_MAX_ROWS:
                tilings["fma"] = SM.default_tiling(k, n, fma=True)
                tilings["fma_k64"] = SM.default_tiling(k, n, block_k=64, fma=True)
            fns = {**{v: jax.jit(lambda x, w, g, r, t=t: SM.skinny_matmul(x, w, norm_weight=g, residual=r, tiling=t))
                      for v, t in tilings.items()},
                   "xla": jax.jit(lambda x, w, g, r: SM.skinny_matmul_reference(x, w, norm_weight=g, residual=r)),
                   "xla_kn": jax.jit(lambda x, w_kn, g, r: SM.skinny_matmul_reference(x, w_kn.T, norm_weight=g,
                                                                                    residual=r))}
            try:
                x32, w32, g32, r32 = (None if a is None else a.astype(jnp.float32) for a in args)
                want = SM.skinny_matmul_reference(x32, w32, norm_weight=g32, residual=r32)
                args_of = {v: (args[0], args[1].T.copy() if v == "xla_kn" else args[1], *args[2:]) for v in fns}
                args_of["xla_kn"] = jax.block_until_ready(args_of["xla_kn"])
                errors = {v: rel_err(fn(*args_of[v]), want) for v, fn in fns.items()}
                t = time_jobs([Job(v, fn, [args_of[v]]) for v, fn in fns.items()], reps)
            except Exception as e:  # noqa: BLE001 - a failure is a result; the section goes on
                results.append(dict(case, error=f"{type(e).__name__}: {str(e)[:2000]}"))
                save()
                continue
            bytes_ = (sum(a.size * a.dtype.itemsize for a in args if a is not None)
                      + rows * n * jnp.dtype(dtype).itemsize)
            busy = {v: t[v].get("busy_us") or t[v]["us"] for v in fns}
            entry = dict(case, tilings={v: ti._asdict() for v, ti in tilings.items()}, errors=errors,
                         busy_us=busy, us={v: t[v]["us"] for v in fns},
                         device_events={v: t[v].get("device_events") for v in fns},
                         kernels_us={v: t[v].get("kernels_us") for v in fns},
                         bandwidth_fraction={v: gb_per_s(bytes_, busy[v]) / ceil["bandwidth_GBps"] for v in fns},
                         bytes=bytes_)
            results.append(entry)
            for v in fns:
                layer.setdefault(v, {"busy_us": 0.0, "us": 0.0})
                layer[v]["busy_us"] += busy[v]
                layer[v]["us"] += t[v]["us"]
            print(f"skinny {name:11s} M={rows:3d} K={k:5d} N={n:5d} splits {tiling.splits:2d} | busy "
                  + " | ".join(f"{v} {busy[v]:6.1f} us ({entry['bandwidth_fraction'][v]:5.1%}, "
                               f"{entry['device_events'][v] or 0:.0f} ev)" for v in fns)
                  + f" | err {errors['kernel']:.1e} (xla {errors['xla']:.1e})", flush=True)
            save()
        if layer:
            results.append(dict(product="layer", rows=rows, busy_us={v: x["busy_us"] for v, x in layer.items()},
                                us={v: x["us"] for v, x in layer.items()}))
            print(f"skinny layer M={rows:3d} | busy (span) " + " | ".join(
                f"{v} {x['busy_us']:7.1f} ({x['us']:7.1f}) us" for v, x in layer.items()), flush=True)
            save()
