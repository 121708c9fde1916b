"""How fast the int4_moe kernels' weight reads can go at small M, with no arithmetic: a Triton kernel that streams the
touched experts' packed words in the exact pattern of a kernel's programs (grid, rows per program, words per step,
pipeline stages) and only adds them up, timed beside the op itself (`ops.int4_moe`) on the same experts in one run.

Two layouts of the words of one expert's matrix [N rows, W words] (`int4_moe.Int4Experts`):
- `rows`: as stored today. A program of BN rows reads, per step, WORDS contiguous words (128 B at 32 words) of each
  of its BN rows; the rows lie W words apart. BN, WORDS, warps: the op's default tiling at that M.
- `tiles`: the same words regrouped so that each program's step is one contiguous [BN, WORDS] tile (8 KB at BN=64),
  the layout a Marlin-style repack would give.

If the `rows` stream is far below the copy ceiling, the access pattern (not the dequantization) bounds the op at
small M, and a tiled repack is the lever; if it is near the ceiling, the kernels' arithmetic and latency are. GPU only.
Writes a JSON (--out) and a bar plot beside it. Outcomes: experiments/notes/kernels.md.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from absl import flags

from experiments.kernels_moe import random_experts
from experiments.timing import Job, gb_per_s, measure_ceilings, time_jobs
from kdtree_jax import cli, plots
from pallas_kernels import int4_moe_triton as moe_triton
from pallas_kernels import ops
from pallas_kernels.triton_call import triton_call

flags.DEFINE_integer("experts", 384, "experts per matrix (K2.6: 384)")
flags.DEFINE_integer("hidden", 7168, "D (K2.6: 7168)")
flags.DEFINE_integer("inter", 2048, "I (K2.6: 2048)")
flags.DEFINE_list("tokens", ["1", "8"], "M of the op; the stream reads the experts its top-8 routing touches")
flags.DEFINE_list("stages", ["3", "4"], "pipeline stages of the stream kernels")
flags.DEFINE_integer("id_sets", 8, "routings rotated over (distinct touched experts: more than the L2 holds)")
flags.DEFINE_integer("reps", 15, "timed calls per variant (median)")
flags.DEFINE_string("launcher", moe_triton.LAUNCHER, "triton_call launcher of the stream kernels")
flags.DEFINE_string("out", "experiments/results/weight_stream.json", "JSON results (a PNG beside it)")
F = flags.FLAGS
TOP_K = 8


@triton.jit
def _stream_kernel(expert_ptr, first_ptr, second_ptr, out_ptr, ROWS: tl.constexpr, ROW_WORDS: tl.constexpr,
                   BN: tl.constexpr, WORDS: tl.constexpr, TILED: tl.constexpr, TWO: tl.constexpr):
    """Program (expert slot b, rows n): the [BN, ROW_WORDS] words of rows n of expert expert[b] (-1: a padding slot,
    nothing read) in first [E, ROWS, ROW_WORDS] (and second, TWO: gate_up's two matrices), WORDS words of each row
    per step, each converted to bf16 and summed by a tensor-core dot (which makes Triton's pipeliner copy the steps
    ahead into shared memory, as it does the kernels' words: plain loads are not pipelined); TILED: the words stored as
    [E, ROWS / BN, ROW_WORDS / WORDS, BN, WORDS]. out [blocks * programs * BN, 16] f32."""
    b, n = tl.program_id(0), tl.program_id(1)
    e = tl.load(expert_ptr + b).to(tl.int64)
    if e < 0:
        return
    r = tl.arange(0, BN)
    w = tl.arange(0, WORDS)
    steps: tl.constexpr = ROW_WORDS // WORDS
    ones = tl.full((WORDS, 16), 1.0, tl.bfloat16)
    acc = tl.zeros((BN, 16), tl.float32)
    for step in tl.range(0, steps):
        if TILED:
            at = e * ROWS * ROW_WORDS + ((n * steps + step) * BN + r[:, None]) * WORDS + w[None, :]
        else:
            at = e * ROWS * ROW_WORDS + (n * BN + r[:, None]) * ROW_WORDS + step * WORDS + w[None, :]
        acc = tl.dot(tl.load(first_ptr + at).to(tl.bfloat16), ones, acc)
        if TWO:
            acc = tl.dot(tl.load(second_ptr + at).to(tl.bfloat16), ones, acc)
    rows_out = (b * tl.num_programs(1) + n) * BN + r
    tl.store(out_ptr + rows_out[:, None] * 16 + tl.arange(0, 16)[None, :], acc)


def tiled(words, bn: int, step_words: int):
    """[E, N, W] -> the same words as [E, N / BN, W / step_words, BN, step_words] (flattened back to [E, N, W])."""
    e, n, w = words.shape
    t = words.reshape(e, n // bn, bn, w // step_words, step_words).transpose(0, 1, 3, 2, 4)
    return t.reshape(e, n, w)


def stream(expert_ids, first, second, *, bn: int, step_words: int, warps: int, stages: int, tiled_layout: bool):
    """The stream kernel over the touched experts expert_ids [B] (-1: padding; one program row each)."""
    _, rows, row_words = first.shape
    if rows % bn or row_words % step_words:
        raise ValueError(f"weight_stream: a [{rows}, {row_words}] matrix is not whole [{bn}, {step_words}] tiles")
    programs = rows // bn
    out = jax.ShapeDtypeStruct((expert_ids.shape[0] * programs * bn, 16), jnp.float32)
    return triton_call(expert_ids, first, first if second is None else second, kernel=_stream_kernel,
                       out_shape=out, grid=(expert_ids.shape[0], programs), num_warps=warps, num_stages=stages,
                       launcher=F.launcher, ROWS=rows, ROW_WORDS=row_words, BN=bn, WORDS=step_words,
                       TILED=tiled_layout, TWO=second is not None)


def result_row(*, tokens: int, touched: float, copy_gbps: float, variant: str, us: float, expert_bytes: int,
               **extra) -> dict:
    """One table row: `variant` moved expert_bytes per touched expert in `us`, as GB/s and a fraction of copy."""
    gbps = gb_per_s(expert_bytes * touched, us)
    return dict(tokens=tokens, touched=touched, variant=variant, us=us, GBps=gbps, copy_fraction=gbps / copy_gbps,
                **extra)


def main(_):
    if jax.default_backend() != "gpu":
        cli.fail("weight_stream.py times the H200's memory system: run it on the GPU")
    ceil = measure_ceilings(F.reps, quick=False)
    experts = random_experts(jax.random.key(0), F.experts, F.hidden, F.inter)
    rng = np.random.default_rng(0)
    rows = []
    for m in (int(t) for t in F.tokens):
        ids_sets = [np.stack([rng.choice(F.experts, TOP_K, replace=False) for _ in range(m)])
                    for _ in range(F.id_sets)]
        distinct = [np.unique(ids).astype(np.int32) for ids in ids_sets]
        width = max(len(d) for d in distinct)    # one shape for every set (-1 pads): one compile, warmed up
        touched = [jnp.asarray(np.pad(d, (0, width - len(d)), constant_values=-1)) for d in distinct]
        weights = jnp.full((m, TOP_K), 1.0 / TOP_K, jnp.bfloat16)
        xs = [jax.random.normal(jax.random.key(i), (m, F.hidden), jnp.bfloat16) for i in range(F.id_sets)]
        cfg = moe_triton.default_config(m * TOP_K, F.experts)
        down_bn, down_words, _ = cfg.down_tiling()
        words = {"gate_up": 2 * experts.gate_packed[0].size * 4, "down": experts.down_packed[0].size * 4}
        scales = {"gate_up": 2 * experts.gate_scale[0].nbytes, "down": experts.down_scale[0].nbytes}
        jobs = [Job("op", jax.jit(lambda x, ids, ex: ops.int4_moe(x, ex, ids, weights)),
                    [(xs[i], jnp.asarray(ids_sets[i], jnp.int32), experts) for i in range(F.id_sets)])]
        layouts = {"rows": (experts.gate_packed, experts.up_packed, experts.down_packed)}
        tilings = ((cfg.block_n, cfg.words), (cfg.block_n, cfg.words), (down_bn, down_words))
        layouts["tiles"] = tuple(jax.block_until_ready(tiled(a, *t)) for a, t in zip(layouts["rows"], tilings))
        for layout, (gate, up, down) in layouts.items():
            for stages in (int(s) for s in F.stages):
                kw = dict(stages=stages, tiled_layout=layout == "tiles", warps=cfg.num_warps)
                jobs.append(Job(f"gate_up:{layout}:{stages}", jax.jit(
                    lambda ids, g, u, kw=kw: stream(ids, g, u, bn=cfg.block_n, step_words=cfg.words, **kw)),
                    [(t, gate, up) for t in touched]))
                jobs.append(Job(f"down:{layout}:{stages}", jax.jit(
                    lambda ids, d, kw=kw: stream(ids, d, None, bn=down_bn, step_words=down_words, **kw)),
                    [(t, down) for t in touched]))
        times = time_jobs(jobs, F.reps)
        n_touched = float(np.mean([len(d) for d in distinct]))     # the sets' work differs by a few experts
        op_kernels = times["op"].get("kernels_us", {})
        case = dict(tokens=m, touched=n_touched, copy_gbps=ceil["copy_GBps"])
        for name, t in times.items():        # the streams read the words only, the op also the scales
            part = name.split(":")[0]
            moved = words[part] if part in words else sum(words.values()) + sum(scales.values())
            rows.append(result_row(**case, variant=name, us=t["us"], expert_bytes=moved, busy_us=t.get("busy_us"),
                                   kernels_us=t.get("kernels_us")))
        if "_gate_up_kernel" in op_kernels:      # the op's own two kernels, for the table
            rows += [result_row(**case, variant=f"{part}:op_kernel", us=op_kernels[f"_{part}_kernel"],
                                expert_bytes=words[part] + scales[part]) for part in ("gate_up", "down")]
    print(f"copy ceiling {ceil['copy_GBps']:.0f} GB/s")
    print(f"{'M':>5s} {'touched':>7s} {'variant':24s} {'us':>8s} {'GB/s':>7s} {'of copy':>7s}")
    for r in rows:
        print(f"{r['tokens']:5d} {r['touched']:7.1f} {r['variant']:24s} {r['us']:8.1f} {r['GBps']:7.0f} "
              f"{r['copy_fraction']:7.1%}")
    meta = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, launcher=F.launcher,
                code=os.environ.get("KDTREE_CODE", ""))
    os.makedirs(os.path.dirname(os.path.abspath(F.out)), exist_ok=True)
    with open(F.out, "w") as f:
        json.dump(dict(meta=meta, ceilings={k: v for k, v in ceil.items() if k != "timings"}, rows=rows), f, indent=1)
    plot(rows, os.path.splitext(F.out)[0] + ".png", ceil["copy_GBps"])


def plot(rows, path: str, copy_gbps: float) -> None:
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rows)), 4))
    x = np.arange(len(rows))
    ax.bar(x, [r["GBps"] for r in rows])
    ax.axhline(copy_gbps, color="k", linestyle="--", label=f"copy ceiling {copy_gbps:.0f} GB/s")
    ax.set_xticks(x, [f"M={r['tokens']} {r['variant']}" for r in rows], rotation=90, fontsize=7)
    ax.set_ylabel("weight bytes / kernel time (GB/s)")
    ax.set_title("int4_moe weight streams: the kernels' pattern (rows) vs contiguous tiles")
    ax.legend()
    plots.save(fig, path)


if __name__ == "__main__":
    cli.run(main)
