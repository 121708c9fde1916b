"""The exact mode's RMSNorm, head products, tree-verify attention and routed experts as Triton kernels (launched by
`triton_call`): the GPU kernels of `batch_invariant`'s functions of those names, row-invariant by construction.

rms_norm: program = row, the squares summed lane by lane over K in fixed steps, then across the lanes; the norm
and its weight applied in the same kernel (the reference sums a row as a product by ones: three launches).

head_matmul: program = (16-row tile, column block, head), the sum over K in fixed steps (row tiles on the grid's
first axis, which CUDA does not cap at 65535).

attention: a node's key sequence in position order (position n < prefix is cache row n, position prefix + j the
block row of the node's ancestor at depth j: `exact_layout.ancestors_in_depth_order`, gathered row by row) is cut
into chunks of `attention_chunk` positions, at the same positions for every query (a function of the latent width
and the dtype). Program (node t, stream s, chunk c x head group g) walks its chunk in `attention_block_keys` steps
with an online softmax for 16 heads (one tl.dot tile) and writes an unnormalised partial; a second kernel merges
a node's chunks one after another in chunk order (a cache of one chunk, as the code target's, is normalised in
the first kernel: the same bits, one launch). The AR step of the same token cuts the same keys at the same
positions and merges them in the same order with the same tiles, so each row gets bitwise the AR step's result
whatever T, the tree, where its rows are stored, the cache's capacity and the other streams. The price: each node
reads its stream's whole prefix (from L2 after the first node), where `tree_verify_attention` reads it once per
query tile, and the partials (f32, one [16, C] tile per chunk and head group) go through memory. (The first
version ran one program per node, all H heads in one tile: at K2.6's shapes one program walked 4096 positions for
64 heads, its [64, 512] f32 accumulator far past the registers: 0.92 ms a layer on an H100, k26.md, "Exact mode at
K2.6's shapes".)

routed experts: the (token, expert) pairs in tiles of PAIR_TILE pairs of one expert, laid out by int4_moe's routing
kernel (the blocks of `int4_moe.route_pairs`, one launch); one kernel computes h = silu(x gate) * (x up) per
tile, rounded to x's dtype, over D in EXPERT_BLOCK steps; a second h down over I in EXPERT_BLOCK steps (f32);
int4_moe's weighted combine adds a token's k slots in slot order in f32 (`exact_layout.add_slots`). A pair is
one row of a fixed-shape tile, so its sums do not depend on which pairs share its expert or where in its tile it
sits. Empty tiles return at once (the expert's weights are not read). INT4 experts run int4_moe's own kernels at
one fixed tiling (`int4_routed_experts`).

tl.dot's tile is the same in every call of a model (a function of H, C, R, D, I and the dtype, never of T, M or the
number of streams): the same instructions run in the same order on a row, and a row's result depends on the row
alone. On the CPU both run in Triton's interpreter against the references (tests/test_exact_kernels_interpreter.py);
the bitwise check of a node against its AR step runs on the GPU (tests/test_kernels_gpu.py).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import MIN_DOT_DIM, exact_layout
from pallas_kernels import int4_moe_triton as moe_triton
from pallas_kernels import tree_verify_attention as op
from pallas_kernels.skinny_matmul import FLOATS
from pallas_kernels.triton_call import bound_to

LAUNCHER = "ffi"     # typed custom call, command-buffer compatible (triton_call.py), as skinny_matmul's
EXPERT_BLOCK = 64    # the experts' output columns per program and their K per step
HEAD_BLOCK_N = 64    # the head products' output columns per program
CHUNK_STEPS = 8      # key steps per attention program (`attention_chunk`)
_NEG_INF = tl.constexpr(op.NEG_INF)


def attention_block_keys(lat: int, dtype) -> int:
    """Key positions per step: 64, or 32 for latents wider than 256 (K2.6's 512: a 64-row tile of queries and of keys
    in shared memory), halved for f32. A function of the latent width and the dtype only."""
    keys = 64 if op.dot_width(lat) <= 256 else 32
    return keys // 2 if jnp.dtype(dtype) == jnp.float32 else keys


def attention_chunk(lat: int, dtype) -> int:
    """Key positions per chunk (a program's piece of a query's sequence): CHUNK_STEPS steps. A function of the
    latent width and the dtype only, so an AR step and a tree node cut their sequences at the same positions."""
    return CHUNK_STEPS * attention_block_keys(lat, dtype)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _finite_or_zero(x):
    """x, or 0 where it is NEG_INF (the running max of a row that has seen no key: its weights stay 0, not NaN)."""
    return tl.where(x == _NEG_INF, 0.0, x)


@triton.jit
def _attention_kernel(prefix_ptr, ancestors_ptr, depth_ptr, q_lat_ptr, q_rope_ptr, c_kv_ptr, k_rope_ptr, acc_ptr,
                      max_ptr, sum_ptr, SCALE: tl.constexpr, NUM_NODES: tl.constexpr, NUM_HEADS: tl.constexpr,
                      CAPACITY: tl.constexpr, CHUNKS: tl.constexpr, GROUPS: tl.constexpr, LAT: tl.constexpr,
                      LAT_P: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr, BH: tl.constexpr,
                      BK: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr):
    """Program (node t, stream s, chunk c x head group g): over the node's positions n in [c CHUNK, (c + 1) CHUNK)
    and <= prefix + depth, the BH heads of group g: acc [BH, LAT] = sum_n exp(l_n - max) k_lat[n] (unnormalised),
    max and sum = sum_n exp(l_n - max), l_n = SCALE (q_lat k_lat[n] + q_rope k_rope[n]), into acc [S, T, CHUNKS, H,
    LAT], max / sum [S, T, CHUNKS, H] (f32). With one chunk (the whole capacity) it normalises and writes the
    output [S, T, H, LAT] in its dtype instead (bitwise what the merge makes of one chunk: acc * 1 + 0, then the
    same division) and max / sum are not written. ancestors [S, T, T] int32, depth [S, T] int32
    (`ancestors_in_depth_order`); q_lat [S, T, H, LAT], q_rope [S, T, H, ROPE], c_kv [S, CAPACITY, LAT], k_rope
    [S, CAPACITY, ROPE]. A chunk past the node's position runs no step and writes nothing (the merge never reads
    it)."""
    t, s, cg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, g = cg // GROUPS, cg % GROUPS
    node = s * NUM_NODES + t
    heads = g * BH + tl.arange(0, BH)
    head_ok = heads < NUM_HEADS
    lat, rope = tl.arange(0, LAT_P), tl.arange(0, ROPE_P)
    lat_ok, rope_ok = lat < LAT, rope < ROPE
    q_rows = (node.to(tl.int64) * NUM_HEADS + heads)[:, None]
    q_lat = tl.load(q_lat_ptr + q_rows * LAT + lat[None, :], mask=head_ok[:, None] & lat_ok[None, :], other=0.0)
    q_rope = tl.load(q_rope_ptr + q_rows * ROPE + rope[None, :], mask=head_ok[:, None] & rope_ok[None, :], other=0.0)
    prefix = tl.load(prefix_ptr + s)
    last = prefix + tl.load(depth_ptr + node)                          # the node's own position
    c_base = c_kv_ptr + s.to(tl.int64) * (CAPACITY * LAT)
    r_base = k_rope_ptr + s.to(tl.int64) * (CAPACITY * ROPE)
    acc = tl.zeros((BH, LAT_P), tl.float32)
    row_max = tl.full((BH,), _NEG_INF, tl.float32)
    row_sum = tl.zeros((BH,), tl.float32)
    for b in range(c * (CHUNK // BK), tl.minimum((c + 1) * (CHUNK // BK), tl.cdiv(last + 1, BK))):
        n = b * BK + tl.arange(0, BK)                                   # positions of this step
        j = tl.minimum(tl.maximum(n - prefix, 0), NUM_NODES - 1)        # depth in the block
        ancestor = tl.load(ancestors_ptr + node.to(tl.int64) * NUM_NODES + j, mask=(n <= last) & (n >= prefix),
                           other=0)
        rows = tl.where(n < prefix, n, prefix + ancestor)
        key_ok = (n <= last) & (rows < CAPACITY)                        # a prefix past N - T reads no other stream
        row = rows[:, None]
        k_lat = tl.load(c_base + row * LAT + lat[None, :], mask=key_ok[:, None] & lat_ok[None, :], other=0.0)
        k_rope = tl.load(r_base + row * ROPE + rope[None, :], mask=key_ok[:, None] & rope_ok[None, :], other=0.0)
        logits = tl.zeros((BH, BK), tl.float32)
        logits = _dot(q_lat, tl.trans(k_lat), logits, IEEE)
        logits = _dot(q_rope, tl.trans(k_rope), logits, IEEE) * SCALE
        logits = tl.where(key_ok[None, :], logits, _NEG_INF)
        top = tl.maximum(row_max, tl.max(logits, axis=1))               # -inf while no key was seen
        shift = _finite_or_zero(top)
        alpha = tl.exp(row_max - shift)
        prob = tl.where(key_ok[None, :], tl.exp(logits - shift[:, None]), 0.0)
        row_sum = row_sum * alpha + tl.sum(prob, axis=1)
        acc = _dot(prob.to(k_lat.dtype), k_lat, acc * alpha[:, None], IEEE)
        row_max = top
    part = (node.to(tl.int64) * CHUNKS + c) * NUM_HEADS + heads
    if CHUNKS == 1:
        acc = acc * tl.where(row_sum > 0, 1.0 / row_sum, 0.0)[:, None]
    if c * CHUNK <= last:                                               # a chunk past the node writes nothing
        tl.store(acc_ptr + part[:, None] * LAT + lat[None, :], acc.to(acc_ptr.dtype.element_ty),
                 mask=head_ok[:, None] & lat_ok[None, :])
        if CHUNKS > 1:
            tl.store(max_ptr + part, row_max, mask=head_ok)
            tl.store(sum_ptr + part, row_sum, mask=head_ok)


@triton.jit
def _combine_chunks_kernel(prefix_ptr, depth_ptr, acc_ptr, max_ptr, sum_ptr, out_ptr, NUM_NODES: tl.constexpr,
                           NUM_HEADS: tl.constexpr, CHUNKS: tl.constexpr, LAT: tl.constexpr, LAT_P: tl.constexpr,
                           BH: tl.constexpr, CHUNK: tl.constexpr):
    """Program (node t, stream s, head group g): the node's chunks 0 .. (prefix + depth) // CHUNK (at most the
    last: a prefix past N - T has positions past the cache, which read nothing) merged one after another in chunk
    order (running max, both sums rescaled to it), then normalised: out [S, T, H, LAT] in out's
    dtype (a row with nothing to attend: 0). Partials as `_attention_kernel` writes them."""
    t, s, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    node = s * NUM_NODES + t
    heads = g * BH + tl.arange(0, BH)
    head_ok = heads < NUM_HEADS
    lat = tl.arange(0, LAT_P)
    mask = head_ok[:, None] & (lat < LAT)[None, :]
    last = tl.load(prefix_ptr + s) + tl.load(depth_ptr + node)
    acc = tl.zeros((BH, LAT_P), tl.float32)
    row_max = tl.full((BH,), _NEG_INF, tl.float32)
    row_sum = tl.zeros((BH,), tl.float32)
    for c in range(0, tl.minimum(last // CHUNK, CHUNKS - 1) + 1):
        part = (node.to(tl.int64) * CHUNKS + c) * NUM_HEADS + heads
        chunk_max = tl.load(max_ptr + part, mask=head_ok, other=_NEG_INF)
        shift = _finite_or_zero(tl.maximum(row_max, chunk_max))
        alpha, beta = tl.exp(row_max - shift), tl.exp(chunk_max - shift)
        row_sum = row_sum * alpha + tl.load(sum_ptr + part, mask=head_ok, other=0.0) * beta
        acc = acc * alpha[:, None] + tl.load(acc_ptr + part[:, None] * LAT + lat[None, :], mask=mask,
                                             other=0.0) * beta[:, None]
        row_max = tl.maximum(row_max, chunk_max)
    out = acc * tl.where(row_sum > 0, 1.0 / row_sum, 0.0)[:, None]
    rows = (node.to(tl.int64) * NUM_HEADS + heads)[:, None]
    tl.store(out_ptr + rows * LAT + lat[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def check_attention(q_lat, q_rope, c_kv, k_rope, prefix_len, visible):
    """Raises ValueError naming the problem: `tree_verify_attention`'s shapes, one float dtype for the operands."""
    op.check_shapes(q_lat, q_rope, c_kv, k_rope, prefix_len, visible)
    dtypes = {x.dtype for x in (q_lat, q_rope, c_kv, k_rope)}
    if len(dtypes) > 1 or not dtypes <= set(map(jnp.dtype, FLOATS)):
        raise ValueError(f"batch_invariant_triton.attention: q_lat, q_rope, c_kv and k_rope must share one dtype, "
                         f"bfloat16 or float32 (its dots take one), got {sorted(str(d) for d in dtypes)}: cast the "
                         f"queries to the cache's dtype")


def run_attention(call, q_lat, q_rope, c_kv, k_rope, prefix_len, visible, scale: float, chunk: int | None = None):
    """The host side through `call(*operands, kernel=, out_shape=, grid=, num_warps=, num_stages=, **constexprs)`
    (`triton_call` on the GPU; Triton's interpreter in the tests). Shapes as `batch_invariant.attention`. chunk:
    key positions per program, a multiple of the step (default `attention_chunk`; the tests cut short sequences
    into several)."""
    check_attention(q_lat, q_rope, c_kv, k_rope, prefix_len, visible)
    s, t, h, c = q_lat.shape
    r, capacity = q_rope.shape[3], c_kv.shape[1]
    block_keys = attention_block_keys(c, c_kv.dtype)
    chunk = chunk or attention_chunk(c, c_kv.dtype)
    if chunk % block_keys:
        raise ValueError(f"batch_invariant_triton.attention: chunk = {chunk} is not a multiple of the key step "
                         f"{block_keys}")
    chunks, groups = triton.cdiv(capacity, chunk), triton.cdiv(h, MIN_DOT_DIM)
    ancestors, depth = exact_layout.ancestors_in_depth_order(jnp.asarray(visible, jnp.bool_))
    prefix_len = jnp.asarray(prefix_len, jnp.int32)
    shapes = dict(NUM_NODES=t, NUM_HEADS=h, CHUNKS=chunks, LAT=c, LAT_P=op.dot_width(c), BH=MIN_DOT_DIM, CHUNK=chunk)
    if chunks == 1:   # the output itself (no partials, no merge: one launch)
        out_shape = (jax.ShapeDtypeStruct(q_lat.shape, q_lat.dtype),) + (jax.ShapeDtypeStruct((1,), jnp.float32),) * 2
    else:
        per_head = jax.ShapeDtypeStruct((s, t, chunks, h), jnp.float32)
        out_shape = (jax.ShapeDtypeStruct((s, t, chunks, h, c), jnp.float32), per_head, per_head)
    acc, row_max, row_sum = call(
        prefix_len, ancestors, depth, q_lat, q_rope, c_kv, k_rope, kernel=_attention_kernel, out_shape=out_shape,
        grid=(t, s, chunks * groups), num_warps=4, num_stages=2, SCALE=float(scale), CAPACITY=capacity,
        GROUPS=groups, ROPE=r, ROPE_P=op.dot_width(r), BK=block_keys, IEEE=c_kv.dtype == jnp.float32, **shapes)
    if chunks == 1:
        return acc
    return call(prefix_len, depth, acc, row_max, row_sum, kernel=_combine_chunks_kernel,
                out_shape=jax.ShapeDtypeStruct(q_lat.shape, q_lat.dtype), grid=(t, s, groups), num_warps=4,
                num_stages=1, **shapes)


@functools.partial(jax.jit, static_argnames=("scale", "launcher"))
def attention(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, *, scale: float, launcher: str = LAUNCHER):
    """q_lat [S, T, H, C], q_rope [S, T, H, R], c_kv [S, N, C], k_rope [S, N, R] (one dtype), prefix_len [S] int32,
    visible [S, T, T] bool -> [S, T, H, C] in q_lat's dtype, each query over its own keys in position order."""
    call = bound_to(launcher, interpret=False, op="batch_invariant_triton.attention",
                    reference="batch_invariant.attention_reference")
    return run_attention(call, q_lat, q_rope, c_kv, k_rope, prefix_len, visible, scale)


def norm_block(k: int) -> int:
    """The RMSNorm's elements per step along the row: K's power of two, at most 1024. A function of K alone."""
    return min(1024, triton.next_power_of_2(k))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, K: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row r): out[r] = x[r] / sqrt(sum(x[r]^2) / K + EPS) * w in f32, rounded to out's dtype; the squares
    summed lane by lane over K in BLOCK steps, then across the lanes. x [M, K], w [K], out [M, K]."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    squares = tl.zeros((BLOCK,), tl.float32)
    for k0 in tl.range(0, K, BLOCK):
        x = tl.load(x_ptr + r * K + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        squares += x * x
    root = tl.sqrt_rn(tl.sum(squares, axis=0) / K + EPS)
    for k0 in tl.range(0, K, BLOCK):
        ok = k0 + cols < K
        x = tl.load(x_ptr + r * K + k0 + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + k0 + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * K + k0 + cols, (x / root * w).to(out_ptr.dtype.element_ty), mask=ok)


def run_rms_norm(call, x, weight, eps: float):
    """The host side through `call` (as `run_attention`'s): x [..., K] (bf16 / f32), weight [K] (any float) ->
    [..., K] in x's dtype, one launch, a program a row."""
    k = x.shape[-1]
    if weight.shape != (k,) or x.dtype not in map(jnp.dtype, FLOATS) or not jnp.issubdtype(weight.dtype,
                                                                                            jnp.floating):
        raise ValueError(f"batch_invariant_triton.rms_norm takes x [..., K] (bfloat16 or float32) and a float weight "
                         f"[K]; got x {x.shape} {x.dtype}, weight {weight.shape} {weight.dtype}")
    m = math.prod(x.shape[:-1])
    out = call(x.reshape(m, k), weight, kernel=_rms_norm_kernel, out_shape=jax.ShapeDtypeStruct((m, k), x.dtype),
               grid=(m,), num_warps=4, num_stages=1, K=k, EPS=float(eps), BLOCK=norm_block(k))
    return out.reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("eps", "launcher"))
def rms_norm(x, weight, *, eps: float, launcher: str = LAUNCHER):
    """RMSNorm of each row of x [..., K] by weight [K] -> x's dtype, a row's sum of squares in one order whatever
    the rows (`batch_invariant.rms_norm`'s kernel)."""
    call = bound_to(launcher, interpret=False, op="batch_invariant_triton.rms_norm",
                    reference="batch_invariant.rms_norm_reference")
    return run_rms_norm(call, x, weight, eps)


def head_block_k(k: int) -> int:
    """The head products' K per step: K's power of two, between tl.dot's 16 and 64. A function of K alone."""
    return max(MIN_DOT_DIM, min(64, triton.next_power_of_2(k)))


@triton.jit
def _head_product_kernel(x_ptr, w_ptr, out_ptr, M: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                         N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                         W_OFFSET: tl.constexpr, W_SH: tl.constexpr, W_SK: tl.constexpr, W_SN: tl.constexpr):
    """Program (row tile, column block, head h): out[rows, h, cols] = x[rows, h] w[h, :, cols], the f32 sums over K
    in BK steps, rounded to out's dtype. x [M, H, K], out [M, H, N]; w[h, k, n] at w_ptr + W_OFFSET + h W_SH + k W_SK
    + n W_SN (a [H, K, N] array, or the absorbed MLA's W_UK / W_UV read in place from kv_b: `HeadWeights`); rows
    past M load as zeros and are not written."""
    mt, nb, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = (mt * BM + tl.arange(0, BM)).to(tl.int64)
    row_ok = rows < M
    cols = nb * BN + tl.arange(0, BN)
    col_ok = cols < N
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in tl.range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        xk = tl.load(x_ptr + (rows[:, None] * H + h) * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                     other=0.0)
        wk = tl.load(w_ptr + W_OFFSET + h * W_SH + k[:, None] * W_SK + cols[None, :] * W_SN,
                     mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(xk, wk, acc, IEEE)
    tl.store(out_ptr + (rows[:, None] * H + h) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


class HeadWeights(NamedTuple):
    """Where w[h, k, n] of a head product lies in an array: at offset + h sh + k sk + n sn, for H x K x N."""
    shape: tuple  # (H, K, N)
    strides: tuple  # (sh, sk, sn) in elements
    offset: int = 0

    @staticmethod
    def dense(w) -> "HeadWeights":
        """w itself, [H, K, N] contiguous."""
        h, k, n = w.shape
        return HeadWeights((h, k, n), (k * n, n, 1))

    @staticmethod
    def absorbed(kv_b, nope: int, key: bool) -> "HeadWeights":
        """The absorbed MLA's per-head products read in place from kv_b [C, H, nope + V]: key, W_UK[h][p, c] =
        kv_b[c, h, p] ([H, nope, C]); else W_UV[h][c, v] = kv_b[c, h, nope + v] ([H, C, V]). No transposed copy
        of the weight each step."""
        c, h, width = kv_b.shape
        if key:
            return HeadWeights((h, nope, c), (width, 1, h * width))
        return HeadWeights((h, c, width - nope), (width, h * width, 1), nope)


def run_head_matmul(call, x, w, out_dtype, where: HeadWeights | None = None):
    """The host side through `call` (as `run_attention`'s): x [..., H, K] @ w [H, K, N] -> [..., H, N] in
    out_dtype, one launch: 16-row tiles of the rows, HEAD_BLOCK_N columns a program, one head a program. where:
    w's [H, K, N] inside the array w (default: w is that array, `HeadWeights.dense`)."""
    *lead, h, k = x.shape
    where = where or (HeadWeights.dense(w) if w.ndim == 3 else None)
    if (where is None or tuple(where.shape[:2]) != (h, k) or w.dtype != x.dtype
            or x.dtype not in map(jnp.dtype, FLOATS)):
        raise ValueError(f"batch_invariant_triton.head_matmul takes x [..., H, K] and w [H, K, N] of one dtype "
                         f"(bfloat16 or float32); got x {x.shape} {x.dtype}, w {w.shape} {w.dtype}"
                         + (f" read as {where.shape}" if where is not None else ""))
    m, n = math.prod(lead), where.shape[2]
    sh, sk, sn = where.strides
    out = call(x.reshape(m, h, k), w, kernel=_head_product_kernel,
               out_shape=jax.ShapeDtypeStruct((m, h, n), out_dtype),
               grid=(triton.cdiv(m, MIN_DOT_DIM), triton.cdiv(n, HEAD_BLOCK_N), h), num_warps=4, num_stages=2,
               M=m, H=h, K=k, N=n, BM=MIN_DOT_DIM, BN=HEAD_BLOCK_N, BK=head_block_k(k),
               IEEE=x.dtype == jnp.float32, W_OFFSET=where.offset, W_SH=sh, W_SK=sk, W_SN=sn)
    return out.reshape(*lead, h, n)


@functools.partial(jax.jit, static_argnames=("out_dtype", "where", "launcher"))
def head_matmul(x, w, *, out_dtype=None, where: HeadWeights | None = None, launcher: str = LAUNCHER):
    """x [..., H, K] @ w [H, K, N] -> [..., H, N] in out_dtype (default x's), each head's product of a row in one
    order whatever the rows (`batch_invariant.absorbed_head_matmul`'s kernel). where: w's [H, K, N] inside the array w
    (`HeadWeights`; default w itself)."""
    call = bound_to(launcher, interpret=False, op="batch_invariant_triton.head_matmul",
                    reference="batch_invariant.head_matmul_reference")
    return run_head_matmul(call, x, w, jnp.dtype(out_dtype or x.dtype), where)


@triton.jit
def _gate_up_kernel(x_ptr, rows_ptr, expert_ptr, gate_ptr, up_ptr, h_ptr, M: tl.constexpr, D: tl.constexpr,
                    I: tl.constexpr, BP: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """Program (tile, column block): h[tile, :, block] = silu(x[rows] gate[e]) * (x[rows] up[e]) in x's dtype, the
    sums over D in BLOCK steps. x [M, D]; rows [tiles, BP] (M: empty); expert [tiles]; gate / up [E, D, I];
    h [tiles, BP, I]. An empty tile writes nothing."""
    tile, cb = tl.program_id(0), tl.program_id(1)
    if tl.load(rows_ptr + tile * BP) >= M:
        return
    p = tl.arange(0, BP)
    rows = tl.load(rows_ptr + tile * BP + p)
    row_ok = rows < M
    e = tl.load(expert_ptr + tile).to(tl.int64)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < I
    g = tl.zeros((BP, BLOCK), tl.float32)
    u = tl.zeros((BP, BLOCK), tl.float32)
    for k0 in tl.range(0, D, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        k_ok = k < D
        xk = tl.load(x_ptr + rows.to(tl.int64)[:, None] * D + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                     other=0.0)
        w_off = e * (D * I) + k[:, None] * I + cols[None, :]
        w_ok = k_ok[:, None] & col_ok[None, :]
        g = _dot(xk, tl.load(gate_ptr + w_off, mask=w_ok, other=0.0), g, IEEE)
        u = _dot(xk, tl.load(up_ptr + w_off, mask=w_ok, other=0.0), u, IEEE)
    h = g * tl.sigmoid(g) * u
    out = (tile * BP + p).to(tl.int64)[:, None] * I + cols[None, :]
    tl.store(h_ptr + out, h.to(h_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, rows_ptr, expert_ptr, down_ptr, y_ptr, M: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
                 BP: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    """Program (tile, column block): y[tile, :, block] = h[tile] down[e] in f32, the sums over I in BLOCK steps.
    h [tiles, BP, I]; down [E, I, D]; y [tiles, BP, D]. An empty tile writes nothing."""
    tile, cb = tl.program_id(0), tl.program_id(1)
    if tl.load(rows_ptr + tile * BP) >= M:
        return
    p = tl.arange(0, BP)
    e = tl.load(expert_ptr + tile).to(tl.int64)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < D
    rows = (tile * BP + p).to(tl.int64)[:, None]
    acc = tl.zeros((BP, BLOCK), tl.float32)
    for k0 in tl.range(0, I, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        k_ok = k < I
        hk = tl.load(h_ptr + rows * I + k[None, :], mask=k_ok[None, :], other=0.0)
        dk = tl.load(down_ptr + e * (I * D) + k[:, None] * D + cols[None, :], mask=k_ok[:, None] & col_ok[None, :],
                     other=0.0)
        acc = _dot(hk, dk, acc, IEEE)
    tl.store(y_ptr + rows * D + cols[None, :], acc, mask=col_ok[None, :])


def check_experts(x, gate, up, down, rows, expert):
    """Raises ValueError naming the problem: x [M, D], gate / up [E, D, I], down [E, I, D] of one float dtype,
    rows [tiles, PAIR_TILE] and expert [tiles] int32."""
    m, d = x.shape
    if gate.ndim != 3 or gate.shape[1] != d or up.shape != gate.shape or down.shape != (gate.shape[0], gate.shape[2],
                                                                                          d):
        raise ValueError(f"batch_invariant_triton.expert_tiles takes x [M, D], gate / up [E, D, I], down [E, I, D]; "
                         f"got x {x.shape}, gate {gate.shape}, up {up.shape}, down {down.shape}")
    dtypes = {a.dtype for a in (x, gate, up, down)}
    if len(dtypes) > 1 or not dtypes <= set(map(jnp.dtype, FLOATS)):
        raise ValueError(f"batch_invariant_triton.expert_tiles: x and the experts must share one dtype, bfloat16 or "
                         f"float32; got {sorted(str(t) for t in dtypes)}: cast x to the experts' dtype")
    if rows.ndim != 2 or rows.shape[1] != exact_layout.PAIR_TILE or expert.shape != rows.shape[:1]:
        raise ValueError(f"batch_invariant_triton.expert_tiles: rows {rows.shape} and expert {expert.shape} must be "
                         f"[tiles, {exact_layout.PAIR_TILE}] and [tiles] (`int4_moe.route_pairs`' block_token and "
                         f"block_expert)")


def run_expert_tiles(call, x, gate, up, down, rows, expert):
    """The host side through `call` (as `run_attention`'s): y [tiles, PAIR_TILE, D] f32, each pair's expert output
    in its slot (an empty slot's row: zeros; an empty tile's rows: unwritten)."""
    check_experts(x, gate, up, down, rows, expert)
    (m, d), i, tiles = x.shape, gate.shape[2], rows.shape[0]
    constants = dict(M=m, D=d, I=i, BP=exact_layout.PAIR_TILE, BLOCK=EXPERT_BLOCK, IEEE=x.dtype == jnp.float32)
    rows, expert = jnp.asarray(rows, jnp.int32), jnp.asarray(expert, jnp.int32)
    h = call(x, rows, expert, gate, up, kernel=_gate_up_kernel,
             out_shape=jax.ShapeDtypeStruct((tiles, exact_layout.PAIR_TILE, i), x.dtype),
             grid=(tiles, triton.cdiv(i, EXPERT_BLOCK)), num_warps=4, num_stages=2, **constants)
    return call(h, rows, expert, down, kernel=_down_kernel,
                out_shape=jax.ShapeDtypeStruct((tiles, exact_layout.PAIR_TILE, d), jnp.float32),
                grid=(tiles, triton.cdiv(d, EXPERT_BLOCK)), num_warps=4, num_stages=2, **constants)


def run_routed_experts(call, x, gate, up, down, ids, weights):
    """The routed experts through `call`, four launches: int4_moe's routing kernel (`int4_moe_triton.route`: the
    pairs in blocks of PAIR_TILE rows of one expert, one program), the two expert kernels over those blocks, and
    int4_moe's weighted combine (a token's k slots added in slot order, in f32). x [M, D], gate / up [E, D, I], down
    [E, I, D], ids / weights [M, k] (an id outside [0, E) adds nothing) -> [M, D] f32."""
    block_expert, block_token, _, pair_row = moe_triton.route(call, ids, weights, gate.shape[0], exact_layout.PAIR_TILE)
    y = run_expert_tiles(call, x, gate, up, down, block_token.reshape(-1, exact_layout.PAIR_TILE), block_expert)
    return moe_triton.combine_pairs(call, pair_row, y.reshape(-1, x.shape[1]), ids.shape, jnp.float32,
                                    pair_weight=weights.reshape(-1))


@functools.partial(jax.jit, static_argnames=("launcher",))
def routed_experts(x, gate, up, down, ids, weights, *, launcher: str = LAUNCHER):
    """x [M, D], gate / up [E, D, I], down [E, I, D] (one dtype), ids / weights [M, k] -> [M, D] f32
    (`batch_invariant.routed_experts`' kernels: `run_routed_experts`)."""
    call = bound_to(launcher, interpret=False, op="batch_invariant_triton.routed_experts",
                    reference="batch_invariant.routed_experts_reference")
    return run_routed_experts(call, x, gate, up, down, jnp.asarray(ids, jnp.int32), weights)


# The INT4 experts' tiling in the exact mode: int4_moe's decode tiling (16-pair blocks, 128 rows a program, no
# split-K), whatever M; `ops.int4_moe` picks its tiling (and kernel) by the pairs per expert instead.
EXACT_INT4_CONFIG = moe_triton.TritonMoeConfig(block_m=exact_layout.PAIR_TILE, block_n=128, words=32, num_warps=4,
                                               num_stages=3)


def int4_routed_experts(x, experts, ids, weights, *, launcher: str | None = None):
    """INT4 routed experts (`int4_moe.Int4Experts`) for the exact mode: int4_moe's Triton kernels at
    EXACT_INT4_CONFIG, a tiling fixed whatever M (each pair a row of a 16-row block, the sums over D and I in fixed
    steps, a token's slots added in slot order): x [M, D], ids / weights [M, k] -> [M, D] f32 (rounded to x's dtype
    by the combine first). launcher: int4_moe's (`int4_moe_triton.int4_moe`)."""
    out = moe_triton.int4_moe(x, experts, ids, weights.astype(jnp.float32), config=EXACT_INT4_CONFIG,
                              launcher=launcher)
    return out.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("launcher",))
def expert_tiles(x, gate, up, down, rows, expert, *, launcher: str = LAUNCHER):
    """x [M, D], gate / up [E, D, I], down [E, I, D] (one dtype), rows [tiles, PAIR_TILE], expert [tiles]
    (`int4_moe.route_pairs`) -> y [tiles, PAIR_TILE, D] f32 (`batch_invariant.routed_experts_reference`'s)."""
    call = bound_to(launcher, interpret=False, op="batch_invariant_triton.expert_tiles",
                    reference="batch_invariant.routed_experts_reference")
    return run_expert_tiles(call, x, gate, up, down, rows, expert)
