"""The tree-verify attention's p @ V product in two shared-memory layouts, side by side on the H200: whether the
64-column piece layout that would let the kernel copy and score each cache block piece by piece (kernels.md,
"Thirty-third session") keeps the product's rate.

Each program (one per multiprocessor, one warpgroup) multiplies a [64, 64] bf16 p by a [64, 256] bf16 block of values
`--steps` times into one f32 accumulator, as a consumer does per cache block:

  `half`    the values as one [64, 256] operand (the kernel's layout today): one wgmma of N = 256 a step;
  `pieces`  the values as four contiguous [64, 64] pieces, the accumulator as four [64, 64] parts: four wgmma of
            N = 64 a step.

p comes from registers (`_rs`, the consumer's own block) or from shared memory (`_ss`, the other consumer's block).
Timed back to back over input sets; the table gives each variant's time and TFLOP/s and its ratio to `half` with the
same p source. GPU only (wgmma):

    python3 experiments/wgmma_pieces.py --out=experiments/results/wgmma_pieces.json

Writes the JSON (--out) and a bar plot beside it.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from absl import flags
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from experiments.run_record import code_version, write_json
from experiments.timing import back_to_back_job, rel_err, time_jobs
from kdtree_jax import cli, plots

flags.DEFINE_integer("steps", 4096, "products per program")
flags.DEFINE_integer("programs", 132, "programs (one per multiprocessor on an H200)")
flags.DEFINE_integer("reps", 15, "timed windows per variant (median reported)")
flags.DEFINE_string("out", "experiments/results/wgmma_pieces.json", "JSON results (a PNG beside it)")
F = flags.FLAGS
ROWS = KV = PIECE = 64   # p rows, cache rows of a block (the product's K), columns of a piece
HALF = 256               # value columns of a consumer
PIECES = HALF // PIECE
VARIANTS = ("half_rs", "pieces_rs", "half_ss", "pieces_ss")


def _transforms():
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def product_kernel(variant: str, steps: int, programs: int):
    """p [64, 64], v [64, 256] (bf16) -> [programs, 64, 256] f32: each program's `steps` products p @ v accumulated,
    in `variant`'s layout (the module docstring)."""
    layout, source = variant.split("_")
    v_shape = (KV, HALF) if layout == "half" else (PIECES, KV, PIECE)

    def body(p_ref, v_ref, out_ref, p_smem, v_smem, bar):
        plgpu.copy_gmem_to_smem(p_ref, p_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(v_ref, v_smem, bar.at[1])
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[1])
        p = p_smem if source == "ss" else plgpu.load(p_smem, layout=plgpu.Layout.WGMMA, optimized=False)
        anchor = lax.axis_index("program") * 0      # traced piece indices: Python ints do not lower in a run_state
        pieces = [v_smem.at[anchor + k] for k in range(PIECES)] if layout == "pieces" else None

        def step(_, acc):
            if layout == "half":
                return pl.run_state(lambda ref: plgpu.wgmma(ref, p, v_smem))(plgpu.ACC.init(acc))

            def products(refs):
                for ref, piece in zip(refs, pieces):
                    plgpu.wgmma(ref, p, piece)
            return pl.run_state(products)(tuple(plgpu.ACC.init(a) for a in acc))

        zeros = plgpu.layout_cast(jnp.zeros((ROWS, PIECE if layout == "pieces" else HALF), jnp.float32),
                                  plgpu.Layout.WGMMA)
        acc = lax.fori_loop(0, steps, step, (zeros,) * PIECES if layout == "pieces" else zeros)
        out_ref.at[lax.axis_index("program")][...] = (jnp.concatenate(acc, axis=1) if layout == "pieces" else acc)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((programs, ROWS, HALF), jnp.float32),
        scratch_types=(plgpu.SMEM((ROWS, KV), jnp.bfloat16, transforms=_transforms()),
                       plgpu.SMEM(v_shape, jnp.bfloat16, transforms=_transforms()),
                       plgpu.Barrier(num_barriers=2)),
        grid=(programs,), grid_names=("program",), kernel_name=f"wgmma_{variant}")

    def run(p, v):
        if layout == "pieces":
            v = v.reshape(KV, PIECES, PIECE).transpose(1, 0, 2)
        return kernel(p, v)
    return run


def main(_):
    if jax.default_backend() != "gpu":
        cli.fail("wgmma_pieces.py times wgmma: run it on a Hopper GPU")
    keys = jax.random.split(jax.random.key(0), 8)
    sets = [(jax.random.normal(k, (ROWS, KV), jnp.bfloat16) / 8,
             jax.random.normal(jax.random.fold_in(k, 1), (KV, HALF), jnp.bfloat16)) for k in keys]
    p, v = (x.astype(jnp.float32) for x in sets[0])
    expected = F.steps * (p @ v)
    fns = {name: jax.jit(product_kernel(name, F.steps, F.programs)) for name in VARIANTS}
    errors = {name: rel_err(fn(*sets[0])[-1], expected) for name, fn in fns.items()}
    times = time_jobs([back_to_back_job(name, fn, sets, calls=2) for name, fn in fns.items()], F.reps)
    flops = 2.0 * F.programs * F.steps * ROWS * KV * HALF
    rows = []
    print(f"{'variant':10s} {'us':>9s} {'TFLOP/s':>8s} {'x half':>7s} {'rel err':>8s}")
    for name in VARIANTS:
        us = times[name]["us"]
        base = times[f"half_{name.split('_')[1]}"]["us"]
        rows.append(dict(variant=name, us=us, TFLOPs=flops / us / 1e6, vs_half=base / us, rel_err=errors[name],
                         kernels_us=times[name].get("kernels_us")))
        print(f"{name:10s} {us:9.1f} {flops / us / 1e6:8.0f} {base / us:7.3f} {errors[name]:8.1e}", flush=True)
    meta = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, steps=F.steps, programs=F.programs,
                code=code_version())
    write_json(F.out, dict(meta=meta, rows=rows))
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([r["variant"] for r in rows], [r["TFLOPs"] for r in rows])
    ax.set_ylabel("TFLOP/s (p @ V, 132 programs)")
    ax.set_title(f"p @ V by layout ({meta['device']}, code {meta['code']})")
    plots.save(fig, os.path.splitext(F.out)[0] + ".png")


if __name__ == "__main__":
    cli.run(main)
