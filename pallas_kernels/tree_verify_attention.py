"""Tree-verify attention over the MLA latent cache (absorbed form): the op, its pure-JAX reference, and what its two
kernels share (the tiling and split-K heuristics, the input check, the split-K combine).

Query node t of stream s attends to every committed cache row j < prefix_len[s] and to the tree rows
prefix_len[s] + u for which visible[s, t, u] holds (the tree block's own latent KV, written there in node order):

  logits[j] = scale * (q_lat . c_kv[j] + q_rope . k_rope[j]);  out = softmax(logits over allowed j) @ c_kv

The output stays in the latent space (the caller applies W_UV). A query row with no allowed cache row returns
zeros. The same function serves AR decode (T = 1, visible = [[True]]) and ragged prefill (prefix_len = 0,
visible = causal & valid).

Kernels (`ops.attention_backend` picks per call): `tree_verify_attention_mgpu` (Mosaic GPU, 64-row query tiles) and
`tree_verify_attention_triton` (Triton, 16-64-row tiles). Both take the MQA form: the latent K/V are shared by all
heads, so the H heads x T nodes of one stream are the rows of one query tile [block_q, C]. Each program streams
cache blocks with an online softmax (the 576-wide score: C = 512 latent + R = 64 rope). With num_splits > 1 the
cache rows are cut into that many contiguous pieces at run time (from prefix_len, so short prefixes waste nothing),
each program writes a partial (its output, running max and sum) and a combine merges them; the tree block is masked
by `visible`.

What every layer of one forward shares (its prefix_len and visible) is prepared once per forward, not in each
layer's call: `TreeVerifyPlan`, built by `ops.tree_verify_plan` (FlashMLA's per-step scheduler metadata plays the
same part). Built inside each call, the Mosaic GPU kernel's frame bias was a short XLA fusion before the kernel in
every layer, and in a call timed alone the device then idled ~19 us for the host's launch of the kernel (kernels.md,
"Tenth session").
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import MIN_DOT_DIM, inverse_or_zero

# Finite stand-in for -inf in the running max: exp(NEG_INF - NEG_INF) stays 1, never NaN; masked probabilities are
# zeroed explicitly, so a row with nothing allowed keeps sum 0 and returns 0.
NEG_INF = -1e30


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Tiling of the Triton kernel. block_q and block_k are powers of two >= 16."""
    block_q: int = 64       # query rows (node x head pairs) per program
    block_k: int = 64       # cache rows per step of the online softmax
    num_splits: int = 1     # programs per query tile along the prefix; > 1 adds the combine step
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value < MIN_DOT_DIM or value & (value - 1):
                raise ValueError(f"AttentionConfig.{name}={value} must be a power of two >= {MIN_DOT_DIM}")
        if self.num_splits < 1:
            raise ValueError(f"AttentionConfig.num_splits={self.num_splits} must be >= 1")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["frame_bias"],
                   meta_fields=["num_heads", "num_nodes"])
@dataclasses.dataclass(frozen=True)
class TreeVerifyPlan:
    """The part of a forward's tree-verify attention calls made once per forward (`ops.tree_verify_plan`).

    num_heads, num_nodes: the query heads (each device's under head parallelism) and tree nodes T of the calls it
    serves; a call with other counts rejects it. frame_bias: the Mosaic GPU kernel's [S, rows, frame_width(T)] f32
    (`tree_verify_attention_mgpu.frame_bias`), or None where that kernel does not run (the call then needs none).
    """
    num_heads: int
    num_nodes: int
    frame_bias: jax.Array | None = None


# Split-K heuristic (the Triton kernel's; the Mosaic GPU one applies `split_count` to its own tiles): the count that
# minimises (waves of programs) x (blocks per program + PROGRAM_OVERHEAD_BLOCKS). A wave only partly filled costs a
# whole one (H200 sweep, experiments/results/kernels/archive/kernels_sweep.json: 128 or 256 programs of the 64-row tile
# run about as fast as each other, 144 or 160 up to 1.7x slower). NUM_SMS: multiprocessors of an H200. PROGRAMS_PER_SM:
# resident programs per multiprocessor by tile: the 8-warp 64-row tile holds ~200 KB of shared memory (one per SM), the
# 4-warp 16-row tile's four stages of 32-row blocks ~130 KB (one), the 4-warp 32-row tile fits two.
# PROGRAM_OVERHEAD_BLOCKS: a program's fixed cost (q tile, tree block, partial write) in cache blocks; fitted on the
# sweep (0 picks many waves of tiny programs, 1-12 fit equally). RIDGE_FLOP_PER_BYTE: bf16 matmul rate over HBM
# bandwidth on the H200 (about 780 TFLOP/s / 4.3 TB/s), to express a call's floor in bytes. PARTIAL_BUDGET: the partials
# (f32, written and read back) may move at most this fraction of those bytes.
NUM_SMS = 132
PROGRAMS_PER_SM = {16: 1, 32: 2, 64: 1}
PROGRAM_OVERHEAD_BLOCKS = 2
RIDGE_FLOP_PER_BYTE = 180
PARTIAL_BUDGET = 1.0
MIN_BLOCKS_PER_SPLIT = 2
# Decode tile (<= 16 query rows): 32-row cache blocks, 4 stages, so three blocks are in flight while one is scored
# (H=8 T=1 N=32768 on the H200: 18.0 us at 132 splits against 21.7 with 2 stages of 64 rows at 256; kernels.md,
# "Seventeenth session").
DECODE_BLOCK_K = 32
DECODE_STAGES = 4


def default_config(num_streams: int, num_rows: int, capacity: int, lat: int = 512, rope: int = 64,
                   itemsize: int = 2) -> AttentionConfig:
    """A tiling for `num_streams` streams of `num_rows` = T * H query rows over a cache of `capacity` rows."""
    block_k, num_stages = 64, 2
    if num_rows <= 16:
        block_q, num_warps = 16, 4
        block_k, num_stages = DECODE_BLOCK_K, DECODE_STAGES
    elif num_rows <= 32:
        block_q, num_warps = 32, 4
    else:
        block_q, num_warps = 64, 8
    partial_bytes = num_streams * num_rows * pl.next_power_of_2(lat) * 4 * 2
    num_splits = split_count(query_tiles(num_streams, num_rows, block_q), capacity, block_k, wave_slots(block_q),
                             partial_bytes, call_floor_bytes(num_streams, num_rows, capacity, lat, rope, itemsize))
    return AttentionConfig(block_q=block_q, block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                           num_stages=num_stages)


def split_count(tiles: int, capacity: int, block_k: int, slots: int, partial_bytes: int, floor_bytes: float, *,
                min_blocks: int = MIN_BLOCKS_PER_SPLIT, partial_budget: float = PARTIAL_BUDGET) -> int:
    """The split-K count (heuristic above) for `tiles` query tiles over a cache of `capacity` rows in blocks of
    block_k, `slots` programs resident on the GPU at once, partials of `partial_bytes` per split (written and read
    back, at most partial_budget x floor_bytes in all) against a call floor of `floor_bytes`, at least min_blocks
    blocks a split. Ties go to the most splits: at a full cache some of them may get no block, but the cache is
    usually partly filled, and there they split the attended blocks finer (fewer splits lengthened the longest
    program for 23-47% of the prefixes at N=4096; kernels.md, "Twenty-seventh session")."""
    limit = max(1, min(int(partial_budget * floor_bytes // partial_bytes), max_splits(capacity, block_k, min_blocks)))
    blocks = pl.cdiv(capacity, block_k)
    return min(range(1, limit + 1), key=lambda n: (
        pl.cdiv(tiles * n, slots) * (pl.cdiv(blocks, n) + PROGRAM_OVERHEAD_BLOCKS), -n))


def call_floor_bytes(num_streams: int, num_rows: int, capacity: int, lat: int = 512, rope: int = 64,
                     itemsize: int = 2) -> float:
    """A call's floor in bytes: the cache read once, or its FLOPs at the ridge point if more."""
    return max(num_streams * capacity * (lat + rope) * itemsize,
               2 * num_streams * num_rows * capacity * (2 * lat + rope) / RIDGE_FLOP_PER_BYTE)


def dot_width(width: int) -> int:
    """The width a kernel's dots run at for a latent or rope width: a power of two, at least MIN_DOT_DIM (the extra
    columns are loaded as 0)."""
    return max(MIN_DOT_DIM, pl.next_power_of_2(width))


def query_tiles(num_streams: int, num_rows: int, block_q: int) -> int:
    """Programs per split: tiles of block_q query rows over all streams."""
    return num_streams * pl.cdiv(num_rows, block_q)


def wave_slots(block_q: int) -> int:
    """Programs resident at once on the whole GPU for a tile of block_q rows."""
    return NUM_SMS * PROGRAMS_PER_SM[block_q]


def max_splits(capacity: int, block_k: int, min_blocks: int = MIN_BLOCKS_PER_SPLIT) -> int:
    """Most splits of a cache of `capacity` rows: each split gets at least min_blocks blocks."""
    return max(1, capacity // (block_k * min_blocks))


def check_shapes(q_lat, q_rope, c_kv, k_rope, prefix_len, visible):
    if q_lat.ndim != 4 or q_rope.ndim != 4 or q_lat.shape[:3] != q_rope.shape[:3]:
        raise ValueError(f"q_lat {q_lat.shape} and q_rope {q_rope.shape} must be [S, T, H, C] and [S, T, H, R]")
    s, t, _, c = q_lat.shape
    r = q_rope.shape[3]
    if c_kv.ndim != 3 or c_kv.shape[0] != s or c_kv.shape[2] != c:
        raise ValueError(f"c_kv {c_kv.shape} must be [S={s}, N, C={c}]")
    if k_rope.shape != (s, c_kv.shape[1], r):
        raise ValueError(f"k_rope {k_rope.shape} must be [S, N, R] = {(s, c_kv.shape[1], r)}")
    if prefix_len.shape != (s,):
        raise ValueError(f"prefix_len {prefix_len.shape} must be [S={s}]")
    if visible.shape != (s, t, t):
        raise ValueError(f"visible {visible.shape} must be [S, T, T] = {(s, t, t)}")
    if c_kv.shape[1] < t:
        raise ValueError(f"cache capacity N={c_kv.shape[1]} is smaller than the tree block T={t}")


def block_attention_mask(prefix_len, visible, capacity: int):
    """[S, T, N] bool: query t of stream s sees rows j < prefix_len[s] and rows prefix_len[s] + u with visible[s,t,u]."""
    num_nodes = visible.shape[-1]
    rows = jnp.arange(capacity)
    in_prefix = rows[None, None, :] < prefix_len[:, None, None]
    u = rows[None, :] - prefix_len[:, None]  # [S, N]
    in_block = (u >= 0) & (u < num_nodes)
    block_vis = jnp.take_along_axis(visible, jnp.clip(u, 0, num_nodes - 1)[:, None, :].repeat(visible.shape[1], 1),
                                    axis=2)
    return in_prefix | (in_block[:, None, :] & block_vis)


def tree_verify_attention_reference(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, *, scale: float):
    """Pure-JAX tree-verify attention: two einsums + mask + f32 softmax + einsum.

    q_lat [S, T, H, C], q_rope [S, T, H, R], c_kv [S, N, C], k_rope [S, N, R], prefix_len [S] int32,
    visible [S, T, T] bool -> out [S, T, H, C] in q_lat's dtype.
    """
    check_shapes(q_lat, q_rope, c_kv, k_rope, prefix_len, visible)
    hi = lax.Precision.HIGHEST
    logits = (jnp.einsum("sthc,snc->sthn", q_lat, c_kv, precision=hi, preferred_element_type=jnp.float32)
              + jnp.einsum("sthr,snr->sthn", q_rope, k_rope, precision=hi, preferred_element_type=jnp.float32))
    logits = logits * scale
    allowed = block_attention_mask(prefix_len, visible, c_kv.shape[1])[:, :, None, :]  # [S, T, 1, N]
    logits = jnp.where(allowed, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    prob = jnp.where(allowed, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(prob, axis=-1, keepdims=True)
    prob = prob / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("sthn,snc->sthc", prob.astype(c_kv.dtype), c_kv, precision=hi,
                     preferred_element_type=jnp.float32)
    return out.astype(q_lat.dtype)


def combine_partials(out, row_max, row_sum, *, normalized: bool = False):
    """The split-K combine in XLA (the reference of `tree_verify_attention_combine`, and the CPU path): partials out
    [P, S, rows, C] (f32 unnormalised, or `normalized` within each split), row_max / row_sum [P, S, rows] ->
    [S, rows, C] f32, 0 for a row with nothing allowed in any split (row_max may be -inf or NEG_INF there)."""
    top = jnp.max(row_max, axis=0)
    weight = jnp.exp(row_max - jnp.where(jnp.isfinite(top), top, 0.0)[None])
    weighted_sum = weight * row_sum
    scale = weighted_sum if normalized else weight
    merged = jnp.sum(scale[..., None] * out.astype(jnp.float32), axis=0)
    return merged * inverse_or_zero(jnp.sum(weighted_sum, axis=0))[..., None]
