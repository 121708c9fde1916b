"""Tree-verify attention as a Triton kernel (launched by `triton_call`): `ops.tree_verify_attention`'s kernel where
the Mosaic GPU one does not fit the call (fewer than 64 query rows per stream, f32, other widths:
`ops.attention_backend`).

The op's semantics, tiling (`AttentionConfig`, `default_config`), input check and split-K combine are those of
`tree_verify_attention.py` (shared, not copied). The T x H (node, head) rows of a stream form query tiles
[block_q, C + R]; a program streams its piece of the prefix in blocks of block_k rows with an online softmax (the
576-wide score as two dots), the last piece also takes the tree block under `visible`; one split normalises and
writes the output, more write partials (acc, max, sum) that `tree_verify_attention_combine.merge` joins (one more
Triton kernel through the same `call`).

Measured on the H200 against the Pallas-Triton kernel it replaced (the same program): 3-7% slower on most cases,
equal at 8 query rows, 1.18x faster with one split (kernels.md, "Eighth session"). On the CPU it runs in Triton's
interpreter against the reference (tests/test_attention_triton_interpreter.py), compiles for sm_90
(tests/test_tree_verify_attention_triton.py) and lowers for an H200 (tests/test_triton_call.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import tree_verify_attention as op
from pallas_kernels import tree_verify_attention_combine as combine
from pallas_kernels.triton_call import bound_to

LAUNCHER = "xla"     # compiled into XLA's executable: no per-call gap (kernels.md, "Launching Triton kernels")
F32_MAX_BLOCK_K = 32  # f32 operands (IEEE dots): a 64-row q tile and 64-row cache blocks ask 295 KB of shared memory
_NEG_INF = tl.constexpr(op.NEG_INF)


@triton.jit
def _load_rows(ptr, stream, start, row_ok, SIZE: tl.constexpr, ROWS_PER_STREAM: tl.constexpr, WIDTH: tl.constexpr,
               WIDTH_P: tl.constexpr):
    """Rows [start, start + SIZE) of ptr's stream `stream` ([S, ROWS_PER_STREAM, WIDTH]) as [SIZE, WIDTH_P]: masked
    rows and padding columns read 0. The stream's offset is one 64-bit scalar; the offsets within a stream are
    32-bit (a stream's rows hold fewer than 2**31 elements), and the column mask exists only where there is padding
    (a mask constant along the row keeps the loads vectorised)."""
    rows = start + tl.arange(0, SIZE)
    cols = tl.arange(0, WIDTH_P)
    base = ptr + stream.to(tl.int64) * (ROWS_PER_STREAM * WIDTH)
    offsets = rows[:, None] * WIDTH + cols[None, :]
    if WIDTH_P == WIDTH:
        return tl.load(base + offsets, mask=row_ok[:, None], other=0.0)
    return tl.load(base + offsets, mask=row_ok[:, None] & (cols < WIDTH)[None, :], other=0.0)


@triton.jit
def _attend(acc, row_max, row_sum, q_lat, q_rope, c_kv_ptr, k_rope_ptr, stream, start, col_ok, allowed,
            SCALE: tl.constexpr, CAPACITY: tl.constexpr, LAT: tl.constexpr, LAT_P: tl.constexpr,
            ROPE: tl.constexpr, ROPE_P: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    """One block of BK cache rows from `start` into the online softmax (allowed [BQ, BK])."""
    k_lat = _load_rows(c_kv_ptr, stream, start, col_ok, BK, CAPACITY, LAT, LAT_P)
    k_rope = _load_rows(k_rope_ptr, stream, start, col_ok, BK, CAPACITY, ROPE, ROPE_P)
    logits = (tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
              + tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)) * SCALE
    logits = tl.where(allowed, logits, _NEG_INF)
    new_max = tl.maximum(row_max, tl.max(logits, axis=1))
    alpha = tl.exp(row_max - new_max)
    prob = tl.where(allowed, tl.exp(logits - new_max[:, None]), 0.0)
    row_sum = row_sum * alpha + tl.sum(prob, axis=1)
    acc = acc * alpha[:, None] + tl.dot(prob.to(k_lat.dtype), k_lat, input_precision=PRECISION)
    return acc, new_max, row_sum


@triton.jit
def _attention_kernel(prefix_ptr, visible_ptr, q_lat_ptr, q_rope_ptr, c_kv_ptr, k_rope_ptr, out_ptr, max_ptr, sum_ptr,
                      SCALE: tl.constexpr, NUM_NODES: tl.constexpr, NUM_HEADS: tl.constexpr, STREAMS: tl.constexpr,
                      CAPACITY: tl.constexpr, LAT: tl.constexpr, LAT_P: tl.constexpr, ROPE: tl.constexpr,
                      ROPE_P: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      PRECISION: tl.constexpr):
    """Program (qi, split, s): query tile qi of stream s against piece `split` of its prefix, and the tree block if
    it is the last piece. NUM_SPLITS == 1: out [S, rows, LAT] normalised in the output dtype (max_ptr / sum_ptr
    unused); else out [P, S, rows, LAT_P] f32 unnormalised, max / sum [P, S, rows]."""
    qi = tl.program_id(0)
    split = tl.program_id(1)
    s = tl.program_id(2)
    ROWS: tl.constexpr = NUM_NODES * NUM_HEADS
    rows = qi * BQ + tl.arange(0, BQ)
    row_ok = rows < ROWS
    q_lat = _load_rows(q_lat_ptr, s, qi * BQ, row_ok, BQ, ROWS, LAT, LAT_P)
    q_rope = _load_rows(q_rope_ptr, s, qi * BQ, row_ok, BQ, ROWS, ROPE, ROPE_P)
    prefix = tl.load(prefix_ptr + s)
    acc = tl.zeros((BQ, LAT_P), tl.float32)
    row_max = tl.full((BQ,), _NEG_INF, tl.float32)
    row_sum = tl.zeros((BQ,), tl.float32)

    num_blocks = tl.cdiv(prefix, BK)
    per_split = tl.cdiv(num_blocks, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, num_blocks)
    for b in range(lo, hi):
        col_ok = b * BK + tl.arange(0, BK) < prefix
        acc, row_max, row_sum = _attend(acc, row_max, row_sum, q_lat, q_rope, c_kv_ptr, k_rope_ptr, s, b * BK,
                                        col_ok, col_ok[None, :], SCALE, CAPACITY, LAT, LAT_P,
                                        ROPE, ROPE_P, BK, PRECISION)

    node = tl.minimum(rows // NUM_HEADS, NUM_NODES - 1)
    tree_blocks = (split == NUM_SPLITS - 1).to(tl.int32) * tl.cdiv(NUM_NODES, BK)
    for b in range(0, tree_blocks):
        u = b * BK + tl.arange(0, BK)                                   # tree node of each column
        col_ok = u < NUM_NODES
        visible = tl.load(visible_ptr + (s * NUM_NODES + node)[:, None] * NUM_NODES
                          + tl.minimum(u, NUM_NODES - 1)[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0)
        acc, row_max, row_sum = _attend(acc, row_max, row_sum, q_lat, q_rope, c_kv_ptr, k_rope_ptr, s,
                                        prefix + b * BK, col_ok, visible != 0, SCALE, CAPACITY, LAT, LAT_P, ROPE,
                                        ROPE_P, BK, PRECISION)

    cols = tl.arange(0, LAT_P)
    if NUM_SPLITS == 1:
        inverse = tl.where(row_sum > 0, 1.0 / row_sum, 0.0)
        out = (acc * inverse[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (s * ROWS + rows).to(tl.int64)[:, None] * LAT + cols[None, :], out,
                 mask=row_ok[:, None] & (cols < LAT)[None, :])
    else:
        part = (split * STREAMS + s) * ROWS + rows
        tl.store(out_ptr + part.to(tl.int64)[:, None] * LAT_P + cols[None, :], acc, mask=row_ok[:, None])
        tl.store(max_ptr + part, row_max, mask=row_ok)
        tl.store(sum_ptr + part, row_sum, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "launcher"))
def tree_verify_attention(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, *, scale: float,
                          config: op.AttentionConfig | None = None, interpret: bool = False,
                          launcher: str = LAUNCHER):
    """The Triton kernel with the signature and semantics of `tree_verify_attention_reference`: q_lat [S, T, H, C],
    q_rope [S, T, H, R], c_kv [S, N, C], k_rope [S, N, R], prefix_len [S] int32 in [0, N - T], visible [S, T, T]
    bool -> out [S, T, H, C] in q_lat's dtype (f32 accumulation). interpret: not available (a ValueError);
    launcher: `triton_call.LAUNCHERS`."""
    call = bound_to(launcher, interpret=interpret, op="tree_verify_attention_triton.tree_verify_attention",
                    reference="tree_verify_attention.tree_verify_attention_reference (or ops.tree_verify_attention)")
    return run_attention(call, q_lat, q_rope, c_kv, k_rope, prefix_len, visible, scale, config)


def launch_config(config: op.AttentionConfig, dtype) -> op.AttentionConfig:
    """The tiling a call runs with: f32 operands take one stage and cache blocks of at most F32_MAX_BLOCK_K rows
    (221 KB of shared memory on the H200 by Triton's compile for sm_90, under its 227 KB)."""
    if dtype == jnp.float32:
        return dataclasses.replace(config, block_k=min(config.block_k, F32_MAX_BLOCK_K), num_stages=1)
    return config


def run_attention(call, q_lat, q_rope, c_kv, k_rope, prefix_len, visible, scale: float,
                  config: op.AttentionConfig | None):
    """The host side through `call(*operands, kernel=, out_shape=, grid=, num_warps=, num_stages=, **constexprs)`
    (`triton_call` on the GPU; the tests pass Triton's interpreter on the CPU)."""
    op.check_shapes(q_lat, q_rope, c_kv, k_rope, prefix_len, visible)
    dtypes = {x.dtype for x in (q_lat, q_rope, c_kv, k_rope)}
    if len(dtypes) > 1:
        raise ValueError(f"tree_verify_attention_triton: q_lat, q_rope, c_kv and k_rope must share one dtype (its dots "
                         f"take one), got {sorted(str(d) for d in dtypes)}: cast the queries to the cache's dtype")
    s, t, h, c = q_lat.shape
    r = q_rope.shape[3]
    rows = t * h
    cfg = launch_config(config or op.default_config(s, rows, c_kv.shape[1], c, r, c_kv.dtype.itemsize), c_kv.dtype)
    lat_p, rope_p = op.dot_width(c), op.dot_width(r)
    per_row = jax.ShapeDtypeStruct((cfg.num_splits, s, rows), jnp.float32)
    if cfg.num_splits == 1:
        out_shape = (jax.ShapeDtypeStruct((s, rows, c), q_lat.dtype), jax.ShapeDtypeStruct((1,), jnp.float32),
                     jax.ShapeDtypeStruct((1,), jnp.float32))
    else:
        out_shape = (jax.ShapeDtypeStruct((cfg.num_splits, s, rows, lat_p), jnp.float32), per_row, per_row)
    out, row_max, row_sum = call(
        jnp.asarray(prefix_len, jnp.int32), jnp.asarray(visible, jnp.bool_), q_lat.reshape(s, rows, c),
        q_rope.reshape(s, rows, r), c_kv, k_rope, kernel=_attention_kernel, out_shape=out_shape,
        grid=(triton.cdiv(rows, cfg.block_q), cfg.num_splits, s), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, SCALE=float(scale), NUM_NODES=t, NUM_HEADS=h, STREAMS=s, CAPACITY=c_kv.shape[1],
        LAT=c, LAT_P=lat_p, ROPE=r, ROPE_P=rope_p, BQ=cfg.block_q, BK=cfg.block_k, NUM_SPLITS=cfg.num_splits,
        PRECISION="ieee" if c_kv.dtype == jnp.float32 else "tf32")
    if cfg.num_splits > 1:
        out = combine.merge(call, out, row_max, row_sum, rows=rows, cols=c, dtype=q_lat.dtype, normalized=False)
    return out.reshape(s, t, h, c)
