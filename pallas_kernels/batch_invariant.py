"""Batch-invariant references of the target forward's reductions: every token row gets bitwise the same result
whether it runs alone (an AR step, M = 1), as a node of a tree verify, or beside other streams.

A reduction's order may change with the problem's shape: a GEMM picks its algorithm, blocking and split-K from
(M, K, N) (on the CPU an M = 1 product runs as a GEMV, summing K in another order), and a row's softmax sum pairs its
terms by their position in the row. The functions here never let a row's result depend on anything but the row:

- `matmul`: the rows are padded to whole tiles of ROW_TILE and the tiles run one after another (`lax.map`), so every
  product is the same (ROW_TILE, K) x (K, N) problem, and a row's sum runs in the one order that problem has.
- `row_sum`, `slot_sum`: a row's sum as a `matmul` by ones (an XLA reduce may order a row's terms by how many rows
  there are: measured on the CPU) or, over a few top-k slots, left to right.
- `attention`: each query attends over its own sequence in position order, the committed prefix followed by its
  ancestors in the block (a tree node's keys are gathered from the rows where the verify wrote them), padded to the
  cache's capacity: the AR step at the same position sees the same keys at the same indices, and the fixed-shape
  per-query products run over identical rows (the softmax's sum is one more column of the value product).
- `routed_experts`: each (token, expert) pair is its own fixed-shape GEMV chain, and a token's k results are added in
  slot order, whatever the number of tokens sharing an expert.

Every product is `fixed_dot`: its operands and result pass through `lax.optimization_barrier`, so that it compiles
to the same GEMM wherever it sits. Without them XLA:GPU fused a product with its neighbours differently by context:
a `lax.map` of one tile (M <= ROW_TILE) is inlined while one of several tiles stays a loop fed by a dynamic slice,
and the two fusions were autotuned apart (H100: batch 1 bitwise, batch 8 not; decode.md, "Exact mode").

These are the CPU path and the reference of the exact mode (`DecodeSpec.exact`); the invariance of the same fixed
shapes under XLA:GPU's GEMM autotuning, and kernels with a fixed tile order, are the GPU's part (experiments/notes/
decode.md, "Exact mode").
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

ROW_TILE = 64  # rows per product: the verify of a 63-node tree at one stream is one tile, as is an AR step of 64


def fixed_dot(a, b):
    """a [..., K] . b [K, N] (jnp.dot) -> f32, as a product of its own: no producer or consumer fused into it."""
    a, b = lax.optimization_barrier((a, b))
    return lax.optimization_barrier(jnp.dot(a, b, preferred_element_type=jnp.float32))


def matmul(x, w, *, out_dtype=None):
    """x [..., K] @ w [K, N] -> [..., N] (f32 accumulation, out_dtype default x's), each row's sum in one order."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    tiles = -(-m // ROW_TILE)
    rows = jnp.pad(rows, ((0, tiles * ROW_TILE - m), (0, 0))).reshape(tiles, ROW_TILE, k)
    out = lax.map(lambda tile: fixed_dot(tile, w), rows)
    return out.reshape(tiles * ROW_TILE, -1)[:m].reshape(*lead, w.shape[-1]).astype(out_dtype or x.dtype)


def row_sum(x):
    """x [..., K] -> [...] f32: each row's sum in one order (a `matmul` by a column of ones; a reduce's order may
    change with the number of rows)."""
    return matmul(x.astype(jnp.float32), jnp.ones((x.shape[-1], 1), jnp.float32))[..., 0]


def slot_sum(x):
    """x [..., k] -> [...]: the k entries added left to right (few: top-k slots)."""
    out = x[..., 0]
    for j in range(1, x.shape[-1]):
        out = out + x[..., j]
    return out


def head_matmul(x, w, *, out_dtype=None):
    """Per-head products: x [..., H, K] @ w [H, K, N] -> [..., H, N] (`matmul` for each head, one after another)."""
    xh = jnp.moveaxis(x, -2, 0)                                           # [H, ..., K]
    out = lax.map(lambda args: matmul(*args, out_dtype=out_dtype or x.dtype), (xh, w))
    return jnp.moveaxis(out, 0, -2)


def gated_mlp(x, gate, up, down):
    """`layers.gated_mlp` with `matmul`: x [..., D], gate / up [D, I], down [I, D] -> [..., D] in x's dtype."""
    return matmul(jax.nn.silu(matmul(x, gate)) * matmul(x, up), down)


def block_sequences(prefix_len, visible, capacity: int):
    """Each query's keys in position order: [S, T, N] int32, the cache row holding position n of query t's sequence
    (rows < prefix_len, then the block rows of its visible tokens in block order), -1 past its own position.

    prefix_len [S]; visible [S, T, T] bool, a token's visible block tokens its ancestors and itself (a tree lists a
    parent before its children, so block order is depth order)."""
    num_nodes = visible.shape[-1]
    ancestors = jnp.argsort(~visible, axis=-1, stable=True)                 # [S, T, T]: visible tokens first
    count = jnp.sum(visible, axis=-1)                                      # [S, T]
    n = jnp.arange(capacity)
    u = n[None, None, :] - prefix_len[:, None, None]                       # [S, 1, N]: index into the block
    block_row = prefix_len[:, None, None] + jnp.take_along_axis(ancestors, jnp.clip(u, 0, num_nodes - 1).repeat(
        visible.shape[1], axis=1), axis=-1)
    rows = jnp.where(u < 0, n[None, None, :], block_row)
    return jnp.where(u < count[..., None], rows, -1).astype(jnp.int32)


def attention(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, *, scale: float):
    """Tree-verify attention (`tree_verify_attention_reference`'s contract), each query over its position-ordered
    sequence (`block_sequences`): q_lat [S, T, H, C], q_rope [S, T, H, R], c_kv [S, N, C], k_rope [S, N, R],
    prefix_len [S], visible [S, T, T] -> [S, T, H, C] in q_lat's dtype."""
    s, t, h, c = q_lat.shape
    rows = block_sequences(prefix_len, visible, c_kv.shape[1])             # [S, T, N]
    q = jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1).reshape(s * t, h, -1)
    keys = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)    # [S, N, C + R]
    stream = jnp.repeat(jnp.arange(s), t)

    def one(args):
        q1, s1, rows1 = args                                                # [H, C + R], (), [N]
        k1 = keys[s1][jnp.maximum(rows1, 0)]                                # [N, C + R]
        logits = fixed_dot(q1, k1.T) * scale
        logits = jnp.where(rows1[None, :] >= 0, logits, -jnp.inf)
        prob = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)).astype(c_kv.dtype)
        values = jnp.concatenate([k1[:, :c], jnp.ones((k1.shape[0], 1), c_kv.dtype)], axis=-1)  # the sum: a column
        out = fixed_dot(prob, values)
        return out[:, :c] / out[:, c:]

    out = lax.map(one, (q, stream, rows.reshape(s * t, -1)))
    return out.reshape(s, t, h, c).astype(q_lat.dtype)


def routed_experts(x, expert_weights: Callable, num_experts: int, ids, weights):
    """The routed experts, one (token, expert) pair at a time: x [M, D]; expert_weights(e) -> (gate [D, I],
    up [D, I], down [I, D]) of expert e; ids [M, k] (outside [0, num_experts): zero weight); weights [M, k]
    -> [M, D] f32, the k slots added in slot order."""
    m, k = ids.shape
    ok = (ids >= 0) & (ids < num_experts)

    def pair(args):
        x1, e = args                                                        # [1, D], ()
        gate, up, down = expert_weights(e)
        return fixed_dot((jax.nn.silu(fixed_dot(x1, gate)) * fixed_dot(x1, up)).astype(x.dtype), down)[0]

    pairs = jnp.repeat(x, k, axis=0)[:, None, :]                           # [M * k, 1, D]
    y = lax.map(pair, (pairs, jnp.where(ok, ids, 0).reshape(-1))).reshape(m, k, x.shape[-1])
    w = jnp.where(ok, weights, 0.0).astype(jnp.float32)
    out = jnp.zeros((m, x.shape[-1]), jnp.float32)
    for j in range(k):
        out = out + w[:, j, None] * y[:, j]
    return out
