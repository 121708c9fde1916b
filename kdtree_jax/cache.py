"""The MLA latent KV cache: per layer `c_kv [S, N, C]` and `k_rope [S, N, R]`, plus per-stream lengths.

Row j of stream s holds the token at position j for j < length[s] (the committed prefix). A block of T new tokens
(a prompt chunk, one AR token, or the B+1 nodes of a draft tree) is written to rows length .. length+T-1 before
attention; for a tree, node i sits in row length + i until compaction moves the accepted rows into place.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kdtree_jax.config import ModelConfig


class KVCache(NamedTuple):
    c_kv: tuple  # per layer [S, N, C]
    k_rope: tuple  # per layer [S, N, R]
    length: jax.Array  # [S] int32: committed rows per stream

    @property
    def capacity(self) -> int:
        return self.c_kv[0].shape[1]

    @property
    def num_streams(self) -> int:
        return self.c_kv[0].shape[0]


def init_cache(cfg: ModelConfig, num_streams: int, capacity: int, dtype=None) -> KVCache:
    dtype = dtype or cfg.dtype
    c = tuple(jnp.zeros((num_streams, capacity, cfg.kv_lora_rank), dtype) for _ in range(cfg.num_layers))
    r = tuple(jnp.zeros((num_streams, capacity, cfg.qk_rope_head_dim), dtype) for _ in range(cfg.num_layers))
    return KVCache(c, r, jnp.zeros((num_streams,), jnp.int32))


def check_capacity(capacity: int, needed: int, what: str) -> None:
    """Host-side guard, called before any compute: the cache never silently truncates."""
    if needed > capacity:
        raise ValueError(f"{what} needs {needed} cache rows but the cache holds {capacity}; "
                         f"raise the cache capacity (--cache_len) or shorten the prompt / max_new_tokens")


def write_rows(layer_cache, rows, offsets):
    """layer_cache [S, N, ...] <- rows [S, T, ...] at rows offsets[s] .. offsets[s]+T-1 of each stream."""
    def one(c, x, o):
        return jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (o,) + (0,) * (c.ndim - 1))
    return jax.vmap(one)(layer_cache, rows, offsets)


def write_first_rows(layer_cache, rows, offsets, count):
    """layer_cache [S, N, ...] <- the first count[s] of rows [S, T, ...] at rows offsets[s] .. of each stream; the
    other rows are dropped (never clamped onto earlier rows, as a slice written past N would be)."""
    t, n = rows.shape[1], layer_cache.shape[1]
    j = jnp.arange(t)[None, :]
    at = jnp.where(j < count[:, None], offsets[:, None] + j, n)              # [S, T]; n: dropped
    return jax.vmap(lambda c, x, i: c.at[i].set(x.astype(c.dtype), mode="drop"))(layer_cache, rows, at)


def compact(cache: KVCache, path, num_accepted, active) -> KVCache:
    """Commit the root and the accepted tree nodes of each active stream.

    path [S, D+1] node indices (path[:, 0] = 0, the root; -1 padding), num_accepted [S], active [S] bool. Rows
    length + path[j] move to length + j for j = 1..D (a gather then one write, so overlap is safe); rows past the new
    length are garbage. The length of an active stream advances by 1 + num_accepted; other streams keep theirs.
    """
    src = cache.length[:, None] + jnp.maximum(path[:, 1:], 0)  # [S, D]

    def move(layer):
        gathered = jnp.take_along_axis(layer, src[:, :, None], axis=1)
        return write_rows(layer, gathered, cache.length + 1)

    return KVCache(tuple(move(c) for c in cache.c_kv), tuple(move(r) for r in cache.k_rope),
                   cache.length + jnp.where(active, 1 + num_accepted, 0))
