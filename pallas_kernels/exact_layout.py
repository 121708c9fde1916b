"""Index layouts of the exact mode, shared by its reference (`batch_invariant`) and its Triton kernels
(`batch_invariant_triton`): a tree node's ancestors in depth order (its keys in position order), and the
(token, expert) pairs in tiles of one expert (each pair a row of a fixed-shape product)."""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

PAIR_TILE = 16  # (token, expert) pairs of one expert per tile: tl.dot's smallest row count


def ancestors_in_depth_order(visible):
    """visible [S, T, T] bool (node t sees its ancestors and itself; a tree lists a parent before its children, so
    block order is depth order) -> (ancestors [S, T, T] int32: the block index of node t's ancestor at depth j for
    j <= depth, itself at j = depth, then its unseen nodes; depth [S, T] int32: its number of ancestors)."""
    ancestors = jnp.argsort(~visible, axis=-1, stable=True).astype(jnp.int32)
    depth = jnp.sum(visible, axis=-1, dtype=jnp.int32) - 1
    return ancestors, depth


class PairTiles(NamedTuple):
    """The M k (token, expert) pairs of ids [M, k] sorted by expert, in tiles of PAIR_TILE pairs of one expert.

    rows [tiles, PAIR_TILE] int32: the token of each slot (M: an empty slot); expert [tiles] int32 (0 for an empty
    tile); tile, slot [P] int32: where the p-th pair in expert order sits (tile == tiles for a pair whose id is
    outside [0, num_experts)); order [P] int32: the pair (m k + j) at the p-th place. tiles = ceil(P / PAIR_TILE) +
    min(E, P), a static count (each expert's last tile may be partly empty)."""
    rows: jnp.ndarray
    expert: jnp.ndarray
    tile: jnp.ndarray
    slot: jnp.ndarray
    order: jnp.ndarray


def pair_tiles(ids, num_experts: int) -> PairTiles:
    """ids [M, k] int32 (outside [0, num_experts): no pair) -> `PairTiles`."""
    m, k = ids.shape
    pairs = m * k
    ok = (ids >= 0) & (ids < num_experts)
    expert = jnp.where(ok, ids, num_experts).reshape(-1)                   # [P]; num_experts: no expert here
    order = jnp.argsort(expert, stable=True).astype(jnp.int32)
    sorted_expert = expert[order]
    counts = jnp.bincount(expert, length=num_experts + 1)
    first_pair = jnp.cumsum(counts) - counts                               # [E + 1]
    tiles_of = -(-counts[:num_experts] // PAIR_TILE)
    first_tile = jnp.cumsum(tiles_of) - tiles_of                           # [E]
    num_tiles = -(-pairs // PAIR_TILE) + min(num_experts, pairs)
    local = sorted_expert < num_experts
    rank = jnp.arange(pairs) - first_pair[sorted_expert]
    tile = jnp.where(local, first_tile[jnp.minimum(sorted_expert, num_experts - 1)] + rank // PAIR_TILE, num_tiles)
    slot = rank % PAIR_TILE
    rows = jnp.full((num_tiles, PAIR_TILE), m, jnp.int32).at[tile, slot].set(order // k, mode="drop")
    tile_expert = jnp.zeros((num_tiles,), jnp.int32).at[tile].set(sorted_expert, mode="drop")
    return PairTiles(rows, tile_expert, tile.astype(jnp.int32), slot.astype(jnp.int32), order)


def add_slots(y_tiles, tiles: PairTiles, ids, weights, num_experts: int):
    """y_tiles [tiles, PAIR_TILE, D] f32 (each pair's expert output in its slot), ids / weights [M, k] -> [M, D] f32:
    a token's k weighted outputs added in slot order (a pair with an id outside [0, num_experts) adds 0)."""
    m, k = ids.shape
    y_sorted = y_tiles.at[tiles.tile, tiles.slot].get(mode="fill", fill_value=0.0)   # [P, D]
    y = jnp.zeros_like(y_sorted).at[tiles.order].set(y_sorted).reshape(m, k, y_tiles.shape[-1])
    w = jnp.where((ids >= 0) & (ids < num_experts), weights, 0.0).astype(jnp.float32)
    out = jnp.zeros((m, y_tiles.shape[-1]), jnp.float32)
    for j in range(k):
        out = out + w[:, j, None] * y[:, j]
    return out
