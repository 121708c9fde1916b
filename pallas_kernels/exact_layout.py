"""Index layouts of the exact mode, shared by its reference (`batch_invariant`) and its Triton kernels
(`batch_invariant_triton`): a tree node's ancestors in depth order (its keys in position order), the tile of
(token, expert) pairs of one expert (each pair a row of a fixed-shape product; the pairs are laid out by int4_moe's
routing, `int4_moe.route_pairs` or its kernel), and the sum of a token's slots in slot order."""
from __future__ import annotations

import jax.numpy as jnp

PAIR_TILE = 16  # (token, expert) pairs of one expert per tile: tl.dot's smallest row count


def ancestors_in_depth_order(visible):
    """visible [S, T, T] bool (node t sees its ancestors and itself; a tree lists a parent before its children, so
    block order is depth order) -> (ancestors [S, T, T] int32: the block index of node t's ancestor at depth j for
    j <= depth, itself at j = depth, then its unseen nodes; depth [S, T] int32: its number of ancestors)."""
    ancestors = jnp.argsort(~visible, axis=-1, stable=True).astype(jnp.int32)
    depth = jnp.sum(visible, axis=-1, dtype=jnp.int32) - 1
    return ancestors, depth


def add_slots(y_rows, pair_row, weights):
    """y_rows [R, D] f32 (each pair's expert output at its row of `int4_moe.route_pairs`' blocks), pair_row [M * k]
    int32 (`Routing.pair_row_or_none`: -1 for a pair whose expert is not held), weights [M, k] -> [M, D] f32: a
    token's k weighted outputs added in slot order (a pair that is not held adds 0)."""
    m, k = weights.shape
    held = (pair_row >= 0).reshape(m, k)
    y = jnp.take(y_rows, jnp.maximum(pair_row, 0), axis=0).reshape(m, k, y_rows.shape[-1])
    y = jnp.where(held[..., None], y, 0.0)
    w = jnp.where(held, weights, 0.0).astype(jnp.float32)
    out = jnp.zeros((m, y_rows.shape[-1]), jnp.float32)
    for j in range(k):
        out = out + w[:, j, None] * y[:, j]
    return out
