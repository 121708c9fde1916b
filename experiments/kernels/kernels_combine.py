"""bench_kernels section `combine` (not in the default list; GPU only): the split-K combine of the tree-verify
attention kernels at split counts from 2 to 256, the Triton kernel (`tree_verify_attention_combine.combine`)
against XLA's `combine_partials`, side by side: the evidence that `merge` takes the kernel at every count. Beside the
default the kernel runs with one and three steps of loads in flight (`stages_1`, `stages_3`), with half-width column
tiles and twice the splits per step (`half_cols`: twice the programs), with steps of twice the splits over 8 warps
(`warps_8`), and with `tiling`'s larger steps and more programs: steps of up to 16384 elements aiming at >= 512
programs (`tile_16k`, 4 and 8 warps: at 64 bf16 rows every split in one step up to 256 splits; at 128 rows two steps
from 132 splits; 8 f32 rows reach 128 programs) and of 8192 aiming at >= 1024 (`tile_8k_1024`).

    cases      the partials of the attention section's decode shapes: the Triton kernel's (f32 unnormalised, 8 rows:
               H=8 T=1) and the Mosaic GPU one's (bf16 normalised, 128 and 64 rows: H=8 T=16, H=64 T=1), one stream,
               512 columns, P in SPLITS
    bytes      the partials read once and the output written once -> fraction of the copy bandwidth
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import triton

from experiments.timing import Job, gb_per_s, rel_err, time_jobs
from pallas_kernels import tree_verify_attention as attn
from pallas_kernels import tree_verify_attention_combine as combine
from pallas_kernels.triton_call import bound_to

SPLITS = (2, 8, 16, 32, 66, 132, 256)
FORMATS = (("triton_f32", 8, jnp.float32, False), ("mosaic_bf16", 128, jnp.bfloat16, True),
           ("mosaic_bf16", 64, jnp.bfloat16, True))
COLS = 512


def combine_inputs(key, splits: int, rows: int, dtype, empty_max: float):
    """Random partials [P, 1, rows, COLS] in dtype with max and sum [P, 1, rows] f32 (a quarter of the splits empty
    for some rows, as short prefixes leave them, with max `empty_max`: -inf from the Mosaic GPU kernel, NEG_INF from
    the Triton one)."""
    k = jax.random.split(key, 4)
    out = jax.random.normal(k[0], (splits, 1, rows, COLS), jnp.float32)
    row_max = 3 * jax.random.normal(k[1], (splits, 1, rows))
    row_sum = jax.random.uniform(k[2], (splits, 1, rows), minval=0.5, maxval=4.0)
    empty = jax.random.uniform(k[3], (splits, 1, rows)) < 0.25
    return (jnp.where(empty[..., None], 0.0, out).astype(dtype), jnp.where(empty, empty_max, row_max),
            jnp.where(empty, 0.0, row_sum))


def run_combine(ceil: dict, results: list, deadline: float, reps: int, save) -> None:
    """Time the combine kernel and XLA's combine for every format and split count; one row per case appended to
    `results`, printed, then `save()`; no new case past `deadline` (time.time())."""
    if jax.default_backend() != "gpu":
        results.append(dict(skipped="the combine kernel runs only on the GPU (no interpret mode)"))
        print("combine: skipped, GPU only", flush=True)
        return
    call = bound_to(combine.LAUNCHER, interpret=False, op="kernels_combine", reference="(the GPU only)")
    for name, rows, dtype, normalized in FORMATS:
        for splits in SPLITS:
            case = dict(format=name, rows=rows, splits=splits)
            if time.time() > deadline:
                results.append(dict(case, skipped="time budget"))
                continue
            args = combine_inputs(jax.random.key(splits * 1000 + rows), splits, rows, dtype,
                                  -jnp.inf if normalized else attn.NEG_INF)
            splits_step, block_rows, width = combine.tiling(splits, 1, rows, COLS)
            pow2 = triton.next_power_of_2(splits)
            one_step = combine.tiling(splits, 1, rows, COLS, tile_elements=16384, target_programs=512)
            narrow = combine.tiling(splits, 1, rows, COLS, tile_elements=8192, target_programs=1024)
            variants = {"kernel": {}, "stages_1": dict(stages=1), "stages_3": dict(stages=3),
                        "half_cols": dict(block=(min(pow2, 2 * splits_step), block_rows, width // 2)),
                        "warps_8": dict(block=(min(pow2, 2 * splits_step), block_rows, width), num_warps=8),
                        "tile_16k": dict(block=one_step), "tile_16k_warps_8": dict(block=one_step, num_warps=8),
                        "tile_8k_1024": dict(block=narrow)}
            fns = {name: jax.jit(lambda *a, n=normalized, kw=kw: combine.combine(
                       call, *a, rows=rows, cols=COLS, dtype=jnp.bfloat16, normalized=n, **kw))
                   for name, kw in variants.items()}
            fns["xla"] = jax.jit(lambda *a, n=normalized: attn.combine_partials(*a, normalized=n).astype(
                jnp.bfloat16)[:, :rows])
            try:
                want = fns["xla"](*args)
                errors = {name: rel_err(fns[name](*args), want) for name in variants}
                t = time_jobs([Job(n, fn, [args]) for n, fn in fns.items()], reps)
            except Exception as e:  # noqa: BLE001 - a failure is a result; the section goes on
                results.append(dict(case, error=f"{type(e).__name__}: {str(e)[:2000]}"))
                save()
                continue
            bytes_ = sum(x.size * x.dtype.itemsize for x in args) + rows * COLS * 2
            error = errors["kernel"]
            entry = dict(case, tiling=combine.tiling(splits, 1, rows, COLS), rel_err=error,
                         kernel_us=t["kernel"]["us"], xla_us=t["xla"]["us"],
                         variants_us={name: t[name]["us"] for name in variants},
                         variant_errors=errors,
                         kernel_busy_us=t["kernel"].get("busy_us"), xla_busy_us=t["xla"].get("busy_us"),
                         kernel_bandwidth_fraction=gb_per_s(bytes_, t["kernel"]["us"]) / ceil["bandwidth_GBps"],
                         timings=t)
            results.append(entry)
            print(f"combine {name:11s} rows {rows:3d} splits {splits:3d} | kernel {entry['kernel_us']:7.1f} us "
                  f"(busy {entry['kernel_busy_us']}) | xla {entry['xla_us']:7.1f} us (busy {entry['xla_busy_us']}) | "
                  + " ".join(f"{name} {t[name]['us']:6.1f}" for name in variants if name != "kernel") + " | "
                  f"{entry['kernel_bandwidth_fraction']:5.1%} of copy | err {error:.1e}", flush=True)
            save()
