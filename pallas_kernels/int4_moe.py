"""Routed-expert MLP with INT4 weights: a Pallas-Triton grouped-GEMM kernel and its pure-JAX reference.

  out[m] = sum_j topk_weights[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])),  e = topk_ids[m, j]

An id outside [0, E) (an expert of another device under expert parallelism) contributes zero.

Weights arrive in the compressed-tensors layout (pallas_kernels/int4_layout.py) and are repacked once at load by
`Int4Experts.from_compressed_tensors`. The repack permutes the nibbles inside each 256-wide block of inputs so that
nibble i of the block's 32 words holds the 32 inputs of quantisation group i: unpacking one nibble position of a
[rows, 32] word tile gives one whole group, whose single scale per output row is applied to the f32 product after a
dot on the raw integers (exact in bf16, built from the nibbles with integer ops only: see `_group_dot`). No
per-element scale multiply, no interleave, no int -> float conversion.

Kernel: the (token, slot) pairs are sorted by expert and cut into blocks of block_m pairs, each block holding one
expert's tokens, so only the experts actually touched are read. Kernel 1 computes gate and up for a block in one pass
over x (fused) and writes silu(gate) * up; kernel 2 computes down and scales each row by its routing weight; the
weighted rows are summed per token. Both GEMMs are written with the weight tile on the left ([out rows, 32] x
[32, tokens]), since the token count of a block is small at decode.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.int4_layout import NIBBLES_PER_WORD, unpack_int4
from pallas_kernels import MIN_DOT_DIM, dot_nt, pallas_call

GROUP = 32                            # quantisation group along the input dim (compressed-tensors, K2.x)
BLOCK_IN = GROUP * NIBBLES_PER_WORD   # inputs per repacked block: one group per nibble position


class Int4Experts(NamedTuple):
    """E routed experts in the kernel's layout. For gate [I, D], up [I, D] and down [D, I] (W [out, in]):

    *_packed int32 [E, out, in_p / 8], in_p = in rounded up to a multiple of 256: in each block of 256 inputs, word w
        (of 32) holds input 32 * i + w of the block in bits [4i, 4i + 4), stored as q + 8; padding inputs hold q = 0.
    *_scale [E, in_p / 32, out], the scales' dtype: scale of group g (inputs 32g .. 32g + 31) for output row o.
    """
    gate_packed: jax.Array
    gate_scale: jax.Array
    up_packed: jax.Array
    up_scale: jax.Array
    down_packed: jax.Array
    down_scale: jax.Array

    @property
    def num_experts(self) -> int:
        return self.gate_packed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.down_packed.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.gate_packed.shape[1]

    @classmethod
    def from_compressed_tensors(cls, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale):
        """One-time repack of stacked compressed-tensors weights.

        gate/up: weight_packed int32 [E, I, D/8], weight_scale [E, I, D/32]; down: [E, D, I/8], [E, D, I/32].
        """
        e, i, d8 = gate_packed.shape
        d = d8 * NIBBLES_PER_WORD
        expected = {"gate_packed": (gate_packed, (e, i, d // 8)), "gate_scale": (gate_scale, (e, i, d // GROUP)),
                    "up_packed": (up_packed, (e, i, d // 8)), "up_scale": (up_scale, (e, i, d // GROUP)),
                    "down_packed": (down_packed, (e, d, i // 8)), "down_scale": (down_scale, (e, d, i // GROUP))}
        for name, (array, shape) in expected.items():
            if tuple(array.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(array.shape)}, expected {shape} for E={e}, I={i}, D={d} "
                                 f"(compressed-tensors layout, group {GROUP}; D and I must be multiples of {GROUP})")
        return cls(*repack_linear(gate_packed, gate_scale), *repack_linear(up_packed, up_scale),
                   *repack_linear(down_packed, down_scale))

    def dequantize(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(gate [E, I, D], up [E, I, D], down [E, D, I]) in f32, exactly q * scale."""
        d, i = self.hidden_size, self.intermediate_size
        return (dequantize_kernel_layout(self.gate_packed, self.gate_scale, d),
                dequantize_kernel_layout(self.up_packed, self.up_scale, d),
                dequantize_kernel_layout(self.down_packed, self.down_scale, i))


@jax.jit
def repack_linear(packed, scale):
    """compressed-tensors (packed [E, out, in/8], scale [E, out, in/32]) -> the kernel layout; one expert at a time."""
    def one(args):
        p, sc = args
        q = unpack_int4(p) + 8                                              # [out, in] nibbles
        out_dim, in_dim = q.shape
        pad = -in_dim % BLOCK_IN
        q = jnp.pad(q, ((0, 0), (0, pad)), constant_values=8)
        q = q.reshape(out_dim, -1, NIBBLES_PER_WORD, BLOCK_IN // NIBBLES_PER_WORD).astype(jnp.uint32)
        shifts = (4 * jnp.arange(NIBBLES_PER_WORD, dtype=jnp.uint32))[None, None, :, None]
        words = jnp.sum(q << shifts, axis=2, dtype=jnp.uint32)             # disjoint bits: sum == or
        words = lax.bitcast_convert_type(words.reshape(out_dim, -1), jnp.int32)
        sc = jnp.pad(sc, ((0, 0), (0, pad // GROUP)))
        return words, sc.T
    return lax.map(one, (packed, scale))


def dequantize_kernel_layout(packed, scale, in_dim: int):
    """Kernel layout (packed [E, out, in_p/8], scale [E, in_p/32, out]) -> W [E, out, in_dim] f32."""
    e, out_dim, words = packed.shape
    shifts = 4 * jnp.arange(NIBBLES_PER_WORD, dtype=jnp.int32)
    blocks = packed.reshape(e, out_dim, words // GROUP, 1, GROUP)
    q = ((blocks >> shifts[None, None, None, :, None]) & 0xF) - 8                # [E, out, blocks, 8, 32]
    w = q.astype(jnp.float32) * jnp.swapaxes(scale, 1, 2).astype(jnp.float32).reshape(
        e, out_dim, words // GROUP, NIBBLES_PER_WORD, 1)
    return w.reshape(e, out_dim, -1)[:, :, :in_dim]


def check_inputs(x, experts: Int4Experts, topk_ids, topk_weights):
    if x.ndim != 2 or x.shape[1] != experts.hidden_size:
        raise ValueError(f"x {x.shape} must be [M, D={experts.hidden_size}]")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {topk_ids.shape} and topk_weights {topk_weights.shape} must both be [M={x.shape[0]}, "
                         "top_k]")


def int4_moe_reference(x, experts: Int4Experts, topk_ids, topk_weights):
    """Pure JAX: dequantize each slot's expert, gather, einsum in f32.

    x [M, D], topk_ids [M, K] int, topk_weights [M, K] -> [M, D] in x's dtype.
    """
    check_inputs(x, experts, topk_ids, topk_weights)
    num_experts = experts.num_experts
    d, i = experts.hidden_size, experts.intermediate_size
    hi = lax.Precision.HIGHEST
    xf = x.astype(jnp.float32)
    out = jnp.zeros(x.shape, jnp.float32)
    for j in range(topk_ids.shape[1]):   # one slot at a time keeps the gathered weights at [M, out, in]
        ids = topk_ids[:, j]
        ok = (ids >= 0) & (ids < num_experts)
        e = jnp.where(ok, ids, 0)
        gate = dequantize_kernel_layout(experts.gate_packed[e], experts.gate_scale[e], d)
        up = dequantize_kernel_layout(experts.up_packed[e], experts.up_scale[e], d)
        down = dequantize_kernel_layout(experts.down_packed[e], experts.down_scale[e], i)
        g = jnp.einsum("mid,md->mi", gate, xf, precision=hi)
        u = jnp.einsum("mid,md->mi", up, xf, precision=hi)
        y = jnp.einsum("mdi,mi->md", down, jax.nn.silu(g) * u, precision=hi)
        out = out + jnp.where(ok, topk_weights[:, j].astype(jnp.float32), 0.0)[:, None] * y
    return out.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Tiling: block_m pairs (tokens of one expert) per block, block_n output rows per program (powers of two).

    use_mma: each group's [block_n, 32] x [32, block_m] product on the tensor cores (a dot; block_m >= 16), or, when
    False, as broadcast multiplies and a sum on the CUDA cores (block_m <= 16, any power of two): no padding of a
    block's few tokens to 16 and no trip of the dequantized tile through the dot operand layout.
    """
    block_m: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    use_mma: bool = True

    def __post_init__(self):
        low, high = (MIN_DOT_DIM, None) if self.use_mma else (1, MIN_DOT_DIM)
        if self.block_m < low or (high and self.block_m > high) or self.block_m & (self.block_m - 1):
            raise ValueError(f"MoeConfig.block_m={self.block_m} must be a power of two in [{low}, {high or 'inf'}) "
                             f"with use_mma={self.use_mma}")
        if not MIN_DOT_DIM <= self.block_n <= BLOCK_IN or self.block_n & (self.block_n - 1):
            raise ValueError(f"MoeConfig.block_n={self.block_n} must be a power of two in [{MIN_DOT_DIM}, {BLOCK_IN}]")


# Pairs up to which the small-block tiling pipelines 5 weight tiles instead of 4: one token's top-8 ran 214 vs 241 us
# at K2.6 shapes on the H200, while 64 pairs lost with 5 (1353 vs 1161 us; experiments/results/kernels_sweep.json).
DEEP_PIPELINE_MAX_PAIRS = 8


def default_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """Small blocks while a touched expert sees a handful of tokens; larger ones once the GEMMs are dense."""
    tokens_per_expert = num_pairs / num_experts
    if tokens_per_expert < 16:
        stages = 5 if num_pairs <= DEEP_PIPELINE_MAX_PAIRS else 4
        return MoeConfig(block_m=16, block_n=64, num_warps=4, num_stages=stages)
    return MoeConfig(block_m=64, block_n=128, num_warps=8, num_stages=3)


class Routing(NamedTuple):
    block_expert: jax.Array   # [B] int32: the expert of each block; E for blocks past the last
    block_token: jax.Array    # [B, block_m] int32: token of each row; M for padding rows
    block_weight: jax.Array   # [B, block_m] f32: routing weight of each row; 0 for padding rows
    pair_row: jax.Array       # [M * K] int32: row of blocks-by-rows where each pair's result lands
    pair_ok: jax.Array        # [M * K] bool: the pair's expert lies in [0, E)


def route_pairs(topk_ids, topk_weights, num_experts: int, block_m: int) -> Routing:
    """Sort the (token, slot) pairs by expert and cut each expert's run into blocks of block_m rows."""
    m, k = topk_ids.shape
    n_pairs = m * k
    ids = topk_ids.reshape(n_pairs).astype(jnp.int32)
    key = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    order = jnp.argsort(key, stable=True)                                   # pair indices, grouped by expert
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    counts = jnp.sum(key[None, :] == experts[:, None], axis=1, dtype=jnp.int32)  # [E]
    blocks = pl.cdiv(counts, block_m)
    block_end = jnp.cumsum(blocks)
    block_begin = block_end - blocks
    pair_begin = jnp.cumsum(counts) - counts
    num_blocks = pl.cdiv(n_pairs, block_m) + min(num_experts, n_pairs)        # static bound on the blocks needed
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    block_expert = jnp.sum(block_end[None, :] <= b[:, None], axis=1, dtype=jnp.int32)
    e = jnp.minimum(block_expert, num_experts - 1)
    slot = (b - block_begin[e])[:, None] * block_m + jnp.arange(block_m, dtype=jnp.int32)[None, :]
    row_ok = (block_expert < num_experts)[:, None] & (slot < counts[e][:, None])
    pair = order[jnp.clip(pair_begin[e][:, None] + slot, 0, n_pairs - 1)]
    block_token = jnp.where(row_ok, pair // k, m).astype(jnp.int32)
    block_weight = jnp.where(row_ok, topk_weights.reshape(n_pairs)[pair].astype(jnp.float32), 0.0)
    rank = jnp.zeros(n_pairs, jnp.int32).at[order].set(jnp.arange(n_pairs, dtype=jnp.int32))
    ke = jnp.minimum(key, num_experts - 1)
    pair_row = block_begin[ke] * block_m + rank - pair_begin[ke]
    return Routing(block_expert, block_token, block_weight, pair_row, key < num_experts)


# bf16 bit pattern 0x4300 | n is the number 128 + n for a nibble n: the tile is built with integer ops only (no
# int -> float conversion, a quarter-rate instruction), and the offset 128 + 8 is taken out after the dot through
# the sum of the activations: dot(128 + n, x) - 136 * sum(x) = dot(n - 8, x).
BF16_MAGIC = 0x4300
BF16_MAGIC_OFFSET = 136


# f32 bit pattern 0x4B000000 | n is the number 2^23 + n for a nibble n: minus 2^23 + 8 it is n - 8, exactly.
F32_MAGIC = 0x4B000000
F32_MAGIC_OFFSET = float(2 ** 23 + 8)


def _group_product(words, i: int, act, use_mma: bool):
    """Nibble position i of words [rows, 32] (one group of integer weights) . act [cols, 32]^T -> [rows, cols] f32,
    on the tensor cores (`_group_dot`) or the CUDA cores (`_group_fma`)."""
    return _group_dot(words, i, act) if use_mma else _group_fma(words, i, act)


def _group_fma(words, i: int, act):
    """`_group_dot` as f32 multiplies and a sum over the group: the integer weights built with integer ops only."""
    nib = (words >> (4 * i)) & 0xF
    w = lax.bitcast_convert_type(nib | F32_MAGIC, jnp.float32) - F32_MAGIC_OFFSET          # [rows, 32]
    return jnp.sum(w[:, None, :] * act.astype(jnp.float32)[None, :, :], axis=2)


def _group_dot(words, i: int, act):
    """Nibble position i of words [rows, 32] (one group of integer weights) . act [cols, 32]^T -> [rows, cols] f32."""
    nib = (words >> (4 * i)) & 0xF
    if act.dtype != jnp.bfloat16:
        return dot_nt((nib - 8).astype(act.dtype), act)
    tile = lax.bitcast_convert_type((nib | BF16_MAGIC).astype(jnp.int16), jnp.bfloat16)
    act_sum = jnp.sum(act.astype(jnp.float32), axis=1)
    return dot_nt(tile, act) - BF16_MAGIC_OFFSET * act_sum[None, :]


def _gate_up_kernel(block_expert_ref, block_token_ref, x_ref, gate_q_ref, gate_s_ref, up_q_ref, up_s_ref, h_ref, *,
                    num_experts: int, num_tokens: int, hidden: int, inter: int, cfg: MoeConfig):
    """Block b, output rows n: h[b rows, n rows] = silu(x W_gate^T) * (x W_up^T) for the block's expert."""
    b, n = pl.program_id(0), pl.program_id(1)
    e = block_expert_ref[b]

    @pl.when(e < num_experts)
    def _():
        bm, bn = cfg.block_m, cfg.block_n
        tok = block_token_ref[b, pl.ds(0, bm)]
        tok_ok = tok < num_tokens
        tok = jnp.minimum(tok, num_tokens - 1)
        out_rows = pl.ds(n * bn, bn)
        out_ok = n * bn + jnp.arange(bn) < inter

        def step(kb, carry):
            acc_g, acc_u = carry
            gate_words = plgpu.load(gate_q_ref.at[e, out_rows, pl.ds(kb * GROUP, GROUP)], mask=out_ok[:, None],
                                    other=0)
            up_words = plgpu.load(up_q_ref.at[e, out_rows, pl.ds(kb * GROUP, GROUP)], mask=out_ok[:, None], other=0)
            for i in range(NIBBLES_PER_WORD):
                cols = kb * BLOCK_IN + i * GROUP + jnp.arange(GROUP)
                xg = plgpu.load(x_ref.at[tok[:, None], cols[None, :]], mask=tok_ok[:, None] & (cols < hidden)[None, :],
                                other=0)                                                        # [bm, 32]
                g = kb * NIBBLES_PER_WORD + i
                gate_s = plgpu.load(gate_s_ref.at[e, g, out_rows], mask=out_ok, other=0).astype(jnp.float32)
                up_s = plgpu.load(up_s_ref.at[e, g, out_rows], mask=out_ok, other=0).astype(jnp.float32)
                acc_g += gate_s[:, None] * _group_product(gate_words, i, xg, cfg.use_mma)
                acc_u += up_s[:, None] * _group_product(up_words, i, xg, cfg.use_mma)
            return acc_g, acc_u

        zeros = jnp.zeros((bn, bm), jnp.float32)
        acc_g, acc_u = lax.fori_loop(0, gate_q_ref.shape[2] // GROUP, step, (zeros, zeros))
        h = acc_g * jax.nn.sigmoid(acc_g) * acc_u                                                # [bn, bm]
        plgpu.store(h_ref.at[pl.ds(b * bm, bm), out_rows], h.T.astype(h_ref.dtype))


def _down_kernel(block_expert_ref, block_token_ref, block_weight_ref, h_ref, down_q_ref, down_s_ref, y_ref, *,
                 num_experts: int, num_tokens: int, hidden: int, cfg: MoeConfig):
    """Block b, output rows n: y[b rows, n rows] = weight * (h W_down^T) for the block's expert."""
    b, n = pl.program_id(0), pl.program_id(1)
    e = block_expert_ref[b]

    @pl.when(e < num_experts)
    def _():
        bm, bn = cfg.block_m, cfg.block_n
        out_rows = pl.ds(n * bn, bn)
        out_ok = n * bn + jnp.arange(bn) < hidden

        def step(kb, acc):
            words = plgpu.load(down_q_ref.at[e, out_rows, pl.ds(kb * GROUP, GROUP)], mask=out_ok[:, None], other=0)
            for i in range(NIBBLES_PER_WORD):
                hg = h_ref[pl.ds(b * bm, bm), pl.ds(kb * BLOCK_IN + i * GROUP, GROUP)]              # [bm, 32]
                s = plgpu.load(down_s_ref.at[e, kb * NIBBLES_PER_WORD + i, out_rows], mask=out_ok,
                               other=0).astype(jnp.float32)
                acc += s[:, None] * _group_product(words, i, hg, cfg.use_mma)
            return acc

        acc = lax.fori_loop(0, down_q_ref.shape[2] // GROUP, step, jnp.zeros((bn, bm), jnp.float32))
        weight = block_weight_ref[b, pl.ds(0, bm)]
        tok_ok = block_token_ref[b, pl.ds(0, bm)] < num_tokens
        y = (acc * weight[None, :]).T.astype(y_ref.dtype)                                       # [bm, bn]
        plgpu.store(y_ref.at[pl.ds(b * bm, bm), out_rows], y, mask=tok_ok[:, None] & out_ok[None, :])


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def int4_moe(x, experts: Int4Experts, topk_ids, topk_weights, *, config: MoeConfig | None = None,
             interpret: bool = False):
    """Pallas kernel with the signature and semantics of `int4_moe_reference`.

    x [M, D], topk_ids [M, K] int, topk_weights [M, K] -> [M, D] in x's dtype (f32 accumulation).
    """
    check_inputs(x, experts, topk_ids, topk_weights)
    m, d = x.shape
    num_experts, inter = experts.num_experts, experts.intermediate_size
    cfg = config or default_config(topk_ids.size, num_experts)
    routing = route_pairs(topk_ids, topk_weights, num_experts, cfg.block_m)
    num_blocks = routing.block_expert.shape[0]
    rows = num_blocks * cfg.block_m
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    inter_padded = experts.down_packed.shape[2] * NIBBLES_PER_WORD   # every column of h is written (padding = 0)
    h = pallas_call(
        functools.partial(_gate_up_kernel, num_experts=num_experts, num_tokens=m, hidden=d, inter=inter, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct((rows, inter_padded), x.dtype),
        grid=(num_blocks, inter_padded // cfg.block_n),
        compiler_params=params, interpret=interpret, name="int4_moe_gate_up",
    )(routing.block_expert, routing.block_token, x, experts.gate_packed, experts.gate_scale, experts.up_packed,
      experts.up_scale)
    y = pallas_call(
        functools.partial(_down_kernel, num_experts=num_experts, num_tokens=m, hidden=d, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct((rows, d), x.dtype),
        grid=(num_blocks, pl.cdiv(d, cfg.block_n)),
        compiler_params=params, interpret=interpret, name="int4_moe_down",
    )(routing.block_expert, routing.block_token, routing.block_weight, h, experts.down_packed, experts.down_scale)
    return combine_pairs(y, routing.pair_row.reshape(m, -1), routing.pair_ok.reshape(m, -1)).astype(x.dtype)


def combine_pairs(y, rows, ok):
    """out[m] = sum_j y[rows[m, j]] over the pairs with ok[m, j]: y [R, D], rows/ok [M, K] -> [M, D] f32.

    K row gathers added in f32, one slot at a time (one fusion), instead of materialising the [M*K, D] gather and
    reducing it afterwards."""
    out = jnp.zeros((rows.shape[0], y.shape[1]), jnp.float32)
    for j in range(rows.shape[1]):
        out = out + jnp.where(ok[:, j, None], y[jnp.where(ok[:, j], rows[:, j], 0)].astype(jnp.float32), 0.0)
    return out
