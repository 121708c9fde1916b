"""The exact mode's reductions (`DecodeSpec.exact`): every token row gets bitwise the same result whether it runs
alone (an AR step, M = 1), as a node of a tree verify, or beside other streams.

A reduction's order may change with the problem's shape: a GEMM picks its algorithm, blocking and split-K from
(M, K, N) (on the CPU an M = 1 product runs as a GEMV, summing K in another order), and a row's softmax sum pairs its
terms by their position in the row. The functions here never let a row's result depend on anything but the row.
Where kernels run compiled on the GPU (`ops.exact_dense_takes`, `ops.exact_kernels_take`) each is one kernel whose
tiling is fixed by the model's shapes (`skinny_matmul`, `batch_invariant_triton`); elsewhere (the CPU, and the
references) XLA runs it in fixed-shape pieces:

- `matmul`: the rows padded to whole tiles of ROW_TILE and the tiles run one after another (`lax.map`), so every
  product is the same (ROW_TILE, K) x (N, K)^T problem, and a row's sum runs in the one order that problem has;
  `absorbed_head_matmul` the same for each head.
- `rms_norm`: a row's sum of squares as `row_sum`, a `matmul` by ones (an XLA reduce may order a row's terms by
  how many rows there are: measured on the CPU); the kernel sums it in fixed steps along the row. The router's sum
  over its top-k slots runs left to right (`router_topk`).
- `attention`: each query attends over its own sequence in position order, the committed prefix followed by its
  ancestors in the block (a tree node's keys are gathered from the rows where the verify wrote them): the AR step at
  the same position sees the same keys at the same indices. The reference pads the sequence to the cache's capacity
  and runs QUERY_TILE queries a step as one batched product of fixed shape (the softmax's sum is one more column of
  the value product); the kernel walks it in fixed steps of positions with an online softmax.
- `routed_experts`: the (token, expert) pairs in blocks of PAIR_TILE pairs of one expert (`int4_moe.route_pairs`),
  each pair a row of its block's fixed-shape products, and a token's k results added in slot order, whatever the
  number of tokens sharing an expert.

The references' products are `fixed_dot`: operands and result behind `lax.optimization_barrier`, so that each
compiles to the same GEMM wherever it sits (without the barriers an H100 run was bitwise at batch 1 and not at
batch 8: a `lax.map` of one tile is inlined while one of several stays a loop, and XLA:GPU fused and autotuned the
same product two ways; decode.md, "Exact mode").
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import batch_invariant_triton, exact_layout, int4_moe, ops

ROW_TILE = 64  # rows per product: the verify of a 63-node tree at one stream is one tile, as is an AR step of 64
QUERY_TILE = 16  # queries per step of `attention` (each still over its own key sequence: a batched product)


def jit_options(exact: bool) -> dict:
    """jax.jit's keywords for a function holding the exact forward: XLA's excess precision off, so that every
    rounding to bf16 the code writes happens wherever XLA fuses it (with it on, XLA dropped a product's rounding
    before the residual outside a shard_map and kept it inside: the forward on a data mesh and without one differed
    by up to 0.03 in a logit, tests/test_sharding.py). None for the default forward."""
    return dict(compiler_options={"xla_allow_excess_precision": False}) if exact else {}


def fixed_dot(a, b, *, b_nk: bool = False):
    """a [..., K] . b [K, N] (jnp.dot; b_nk: b [N, K], a dense weight as the model stores it), or a batch of them
    a [Q, M, K] . b [Q, K, N] (jnp.matmul) -> f32, as a product of its own: no producer or consumer fused into it."""
    a, b = lax.optimization_barrier((a, b))
    if b_nk:
        y = lax.dot_general(a, b, (((a.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    else:
        product = jnp.matmul if a.ndim == b.ndim == 3 else jnp.dot
        y = product(a, b, preferred_element_type=jnp.float32)
    return lax.optimization_barrier(y)


def matmul(x, w, *, norm_weight=None, eps: float = 1e-6, residual=None, out_dtype=None):
    """x [..., K] @ w^T, w [N, K] (a dense weight as stored, `layers.project`) -> [..., N] (f32 accumulation,
    out_dtype default x's), each row's sum in one order: one
    `skinny_matmul` where `ops.exact_dense_takes` (kernels compiled on the GPU), else fixed-shape tiles.
    norm_weight [K]: the RMSNorm of x by it first, in the kernel's prologue (no launch of its own) or as `rms_norm`
    before the tiles; the two round differently, and a given shape always takes the same one. residual [..., N]:
    added to the product rounded to out_dtype (residual + round(x @ w^T), in f32, rounded), in the kernel's epilogue
    or after the tiles: the same numbers either way."""
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    rows = x.reshape(-1, k)
    out_dtype = out_dtype or x.dtype
    if ops.exact_dense_takes(rows, w):
        return ops.dense(rows, w, norm_weight=norm_weight, eps=eps, residual=residual,
                         out_dtype=out_dtype).reshape(*lead, n)
    if norm_weight is not None:
        rows = rms_norm(rows, norm_weight, eps)
    m = rows.shape[0]
    tiles = -(-m // ROW_TILE)
    rows = jnp.pad(rows, ((0, tiles * ROW_TILE - m), (0, 0))).reshape(tiles, ROW_TILE, k)
    out = lax.map(lambda tile: fixed_dot(tile, w, b_nk=True), rows)
    y = out.reshape(tiles * ROW_TILE, -1)[:m].reshape(*lead, n)
    return y.astype(out_dtype) if residual is None else add_residual(residual, y, out_dtype)


def add_residual(residual, y, out_dtype):
    """residual + y rounded to out_dtype, added in f32 and rounded again: `matmul`'s epilogue (skinny_matmul's too),
    wherever a product's residual is added after it."""
    return (residual.astype(jnp.float32) + y.astype(out_dtype).astype(jnp.float32)).astype(out_dtype)


def rms_norm(x, weight, eps: float):
    """RMSNorm of each row of x [..., K] by weight [K] in f32, rounded to x's dtype, each row's sum of squares in one
    order: one Triton kernel where `ops.exact_kernels_take`, else `rms_norm_reference`."""
    if ops.exact_kernels_take(x):
        return batch_invariant_triton.rms_norm(x, weight, eps=float(eps))
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x, weight, eps: float):
    """`rms_norm` with the row's sum of squares as `row_sum` (a product by ones)."""
    x32 = x.astype(jnp.float32)
    mean_sq = (row_sum(x32 * x32) / x.shape[-1])[..., None]
    return (x32 * lax.rsqrt(mean_sq + eps) * weight.astype(jnp.float32)).astype(x.dtype)


def row_sum(x):
    """x [..., K] -> [...] f32: each row's sum in one order (a `matmul` by a column of ones; a reduce's order may
    change with the number of rows)."""
    return matmul(x.astype(jnp.float32), jnp.ones((1, x.shape[-1]), jnp.float32))[..., 0]


def absorbed_head_matmul(x, kv_b, *, nope: int, key: bool):
    """The absorbed MLA's per-head products with kv_b [C, H, nope + V]: key, q_nope x [..., H, nope] @ W_UK -> [...,
    H, C] (W_UK[h][p, c] = kv_b[c, h, p]); else x [..., H, C] @ W_UV -> [..., H, V] (W_UV[h][c, v] = kv_b[c, h,
    nope + v]); in x's dtype. The kernel reads kv_b in place where `ops.exact_kernels_take` (no transposed copy of
    the weight each step), else `head_matmul_reference` on the transposed slice: the same sums either way."""
    if ops.exact_kernels_take(x, kv_b):
        where = batch_invariant_triton.HeadWeights.absorbed(kv_b, nope, key)
        return batch_invariant_triton.head_matmul(x, kv_b, out_dtype=x.dtype, where=where)
    w = jnp.transpose(kv_b[..., :nope], (1, 2, 0)) if key else jnp.transpose(kv_b[..., nope:], (1, 0, 2))
    return head_matmul_reference(x, w)


def head_matmul_reference(x, w, *, out_dtype=None):
    """Per-head products x [..., H, K] @ w [H, K, N] -> [..., H, N] as `matmul` for each head, one after another (the
    reference of `absorbed_head_matmul`'s kernel)."""
    xh = jnp.moveaxis(x, -2, 0)                                           # [H, ..., K]
    out = lax.map(lambda args: matmul(args[0], args[1].T, out_dtype=out_dtype or x.dtype), (xh, w))
    return jnp.moveaxis(out, 0, -2)


def gated_mlp(x, gate, up, down, out_dtype=None):
    """`layers.gated_mlp` with `matmul`: x [..., D], gate / up [I, D], down [D, I] -> [..., D] in out_dtype (default
    x's)."""
    return matmul(jax.nn.silu(matmul(x, gate)) * matmul(x, up), down, out_dtype=out_dtype)


def block_sequences(prefix_len, visible, capacity: int):
    """Each query's keys in position order: [S, T, N] int32, the cache row holding position n of query t's sequence
    (rows < prefix_len, then the block rows of its ancestors and itself in depth order), -1 past its own position.

    prefix_len [S]; visible [S, T, T] bool (`exact_layout.ancestors_in_depth_order`)."""
    num_nodes = visible.shape[-1]
    ancestors, depth = exact_layout.ancestors_in_depth_order(visible)      # [S, T, T], [S, T]
    n = jnp.arange(capacity)
    u = n[None, None, :] - prefix_len[:, None, None]                       # [S, 1, N]: index into the block
    block_row = prefix_len[:, None, None] + jnp.take_along_axis(ancestors, jnp.clip(u, 0, num_nodes - 1).repeat(
        visible.shape[1], axis=1), axis=-1)
    rows = jnp.where(u < 0, n[None, None, :], block_row)
    return jnp.where(u <= depth[..., None], rows, -1).astype(jnp.int32)


def attention(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, *, scale: float):
    """Tree-verify attention (`tree_verify_attention_reference`'s contract), each query over its position-ordered
    sequence: q_lat [S, T, H, C], q_rope [S, T, H, R], c_kv [S, N, C], k_rope [S, N, R], prefix_len [S], visible
    [S, T, T] -> [S, T, H, C] in q_lat's dtype. The Triton kernel where `ops.exact_kernels_take`, else
    `attention_reference`."""
    if ops.exact_kernels_take(q_lat, c_kv):
        return batch_invariant_triton.attention(q_lat, q_rope.astype(q_lat.dtype), c_kv, k_rope.astype(c_kv.dtype),
                                                prefix_len, visible, scale=scale)
    return attention_reference(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, scale=scale)


def attention_reference(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, *, scale: float):
    """`attention` in XLA: each query's sequence (`block_sequences`) padded to the cache's capacity, QUERY_TILE
    queries a step of one batched product of fixed shape."""
    s, t, h, c = q_lat.shape
    rows = block_sequences(prefix_len, visible, c_kv.shape[1])             # [S, T, N]
    q = jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1).reshape(s * t, h, -1)
    keys = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)    # [S, N, C + R]
    stream = jnp.repeat(jnp.arange(s), t)
    rows = rows.reshape(s * t, -1)
    queries = s * t
    tiles = -(-queries // QUERY_TILE)
    pad = tiles * QUERY_TILE - queries                                      # padding queries see key 0 only
    q = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(tiles, QUERY_TILE, h, -1)
    stream = jnp.pad(stream, (0, pad)).reshape(tiles, QUERY_TILE)
    rows = jnp.pad(rows, ((0, pad), (0, 0)), constant_values=-1).at[queries:, 0].set(0).reshape(
        tiles, QUERY_TILE, -1)

    def tile(args):
        q1, s1, rows1 = args                                                # [Q, H, C + R], [Q], [Q, N]
        k1 = keys[s1[:, None], jnp.maximum(rows1, 0)]                       # [Q, N, C + R]
        logits = fixed_dot(q1, jnp.swapaxes(k1, 1, 2)) * scale             # [Q, H, N]
        logits = jnp.where(rows1[:, None, :] >= 0, logits, -jnp.inf)
        prob = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)).astype(c_kv.dtype)
        ones = jnp.ones((*k1.shape[:2], 1), c_kv.dtype)
        out = fixed_dot(prob, jnp.concatenate([k1[..., :c], ones], axis=-1))  # the sum: a column
        return out[..., :c] / out[..., c:]

    out = lax.map(tile, (q, stream, rows)).reshape(tiles * QUERY_TILE, h, c)[:queries]
    return out.reshape(s, t, h, c).astype(q_lat.dtype)


def routed_experts(x, expert_weights: Callable, num_experts: int, ids, weights, *, stacked=None, int4=None):
    """The routed experts, each (token, expert) pair one row of a fixed-shape block of PAIR_TILE pairs of one expert
    (`int4_moe.route_pairs`), a token's k results added in slot order: x [M, D]; expert_weights(e) -> (gate [D, I],
    up [D, I], down [I, D]) of expert e; ids [M, k] (outside [0, num_experts): zero weight); weights [M, k] -> [M, D]
    f32. stacked: (gate [E, D, I], up [E, D, I], down [E, I, D]) in x's dtype where the experts are held so, int4:
    the `Int4Experts` where they are INT4: the Triton kernels run on them where `ops.exact_kernels_take`; else
    `routed_experts_reference`."""
    if stacked is not None and ops.exact_kernels_take(x, *stacked):
        return batch_invariant_triton.routed_experts(x, *stacked, ids, weights)
    if int4 is not None and ops.exact_kernels_take(x):
        return batch_invariant_triton.int4_routed_experts(x, int4, ids, weights)
    routing = int4_moe.route_pairs(ids, weights, num_experts, exact_layout.PAIR_TILE)
    y = routed_experts_reference(x, expert_weights, routing.block_token, jnp.minimum(routing.block_expert,
                                                                                      num_experts - 1))
    return exact_layout.add_slots(y.reshape(-1, x.shape[-1]), routing.pair_row_or_none(), weights)


def routed_experts_reference(x, expert_weights: Callable, rows, expert):
    """Each block's products in XLA, one block after another (each expert's weights taken once a block): x [M, D],
    expert_weights as `routed_experts`, rows [B, PAIR_TILE] (the token of each row, M: none), expert [B] -> y [B,
    PAIR_TILE, D] f32 (an empty row: zeros)."""
    xs = jnp.pad(x, ((0, 1), (0, 0)))[rows]                                # [B, PAIR_TILE, D]; row M: zeros

    def one(args):
        x1, e = args                                                        # [PAIR_TILE, D], ()
        gate, up, down = expert_weights(e)
        return fixed_dot((jax.nn.silu(fixed_dot(x1, gate)) * fixed_dot(x1, up)).astype(x.dtype), down)

    return lax.map(one, (xs, expert))
