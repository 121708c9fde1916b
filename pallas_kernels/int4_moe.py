"""Routed-expert MLP with INT4 weights: the op, its weight layout, its pure-JAX reference and the routing of
(token, slot) pairs into blocks of one expert that the GPU kernel (`int4_moe_triton.py`) consumes.

  out[m] = sum_j topk_weights[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])),  e = topk_ids[m, j]

An id outside [0, E) (an expert of another device under expert parallelism) contributes zero.

Weights arrive in the compressed-tensors layout (pallas_kernels/int4_layout.py) and are repacked once at load by
`Int4Experts.from_compressed_tensors`. The repack permutes the nibbles inside each 256-wide block of inputs so that
nibble i of the block's 32 words holds the 32 inputs of quantisation group i: unpacking one nibble position of a
[rows, 32] word tile gives one whole group, with a single scale per output row, which the kernel applies as it turns
the nibbles into bf16 (no interleave, no int -> float conversion). The nibbles hold q in two's complement (not
compressed-tensors' q + 8), the form Mosaic GPU's int4 -> bf16 conversion takes, so that the Mosaic GPU block matmul
reads the same words (`int4_matmul_mgpu`: its K positions in this order, the activations permuted to match).

Routing (`route_pairs`): the pairs are sorted by expert and cut into blocks of block_m pairs, each block holding one
expert's tokens, so that a kernel reads only the experts actually touched. The Pallas-Triton kernel this module held
until the sixth session lost to the Triton kernel at every token count and went (experiments/notes/kernels.md).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.int4_layout import NIBBLES_PER_WORD, unpack_int4

GROUP = 32                            # quantisation group along the input dim (compressed-tensors, K2.x)
BLOCK_IN = GROUP * NIBBLES_PER_WORD   # inputs per repacked block: one group per nibble position


class Int4Experts(NamedTuple):
    """E routed experts in the kernel's layout. For gate [I, D], up [I, D] and down [D, I] (W [out, in]):

    *_packed int32 [E, out, in_p / 8], in_p = in rounded up to a multiple of 256: in each block of 256 inputs, word w
        (of 32) holds input 32 * i + w of the block in bits [4i, 4i + 4), q in two's complement; padding inputs hold
        q = 0. Read as int4 [E, out, in_p] (nibble i of word w at position 8 w + i), position p of a block holds input
        32 (p % 8) + p // 8: `int4_positions`.
    *_scale [E, in_p / 32, out], the scales' dtype: scale of group g (inputs 32g .. 32g + 31) for output row o.
    """
    NIBBLES = "twos_complement"   # the encoding of q in each nibble, recorded in checkpoints (kdtree_jax.checkpoint)

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
        q = unpack_int4(p) & 0xF                                            # [out, in] nibbles, two's complement
        out_dim, in_dim = q.shape
        pad = -in_dim % BLOCK_IN
        q = jnp.pad(q, ((0, 0), (0, pad)))
        q = q.reshape(out_dim, -1, NIBBLES_PER_WORD, BLOCK_IN // NIBBLES_PER_WORD).astype(jnp.uint32)
        shifts = (4 * jnp.arange(NIBBLES_PER_WORD, dtype=jnp.uint32))[None, None, :, None]
        words = jnp.sum(q << shifts, axis=2, dtype=jnp.uint32)             # disjoint bits: sum == or
        words = lax.bitcast_convert_type(words.reshape(out_dim, -1), jnp.int32)
        sc = jnp.pad(sc, ((0, 0), (0, pad // GROUP)))
        return words, sc.T
    return lax.map(one, (packed, scale))


def unpack_kernel_layout(packed):
    """Kernel layout packed [E, out, in_p/8] (word w of a 256-input block holds input 32 i + w in nibble i, in two's
    complement) -> the values int32 [E, out, in_p] in [-8, 7], in input order."""
    e, out_dim, words = packed.shape
    shifts = 4 * jnp.arange(NIBBLES_PER_WORD, dtype=jnp.int32)
    blocks = packed.reshape(e, out_dim, words // GROUP, 1, GROUP)
    q = (((blocks >> shifts[None, None, None, :, None]) & 0xF) ^ 8) - 8          # [E, out, blocks, 8, 32]
    return q.reshape(e, out_dim, -1)


def int4_positions(packed):
    """Kernel layout packed int32 [E, out, in_p/8] -> int4 [E, out, in_p] (a bitcast), nibble i of word w at position
    8 w + i: position p of each 256-input block holds input 32 (p % 8) + p // 8, of the block's group p % 8."""
    e, out_dim, words = packed.shape
    return lax.bitcast_convert_type(packed, jnp.int4).reshape(e, out_dim, words * NIBBLES_PER_WORD)


def inputs_to_positions(a, axis: int = -1):
    """a [..., in, ...] -> [..., in_p, ...] along `axis`, padded with zeros to in_p (a multiple of 256) and permuted
    into `int4_positions`' order: the operand that meets those weights position by position."""
    axis = axis % a.ndim
    pad = -a.shape[axis] % BLOCK_IN
    a = jnp.pad(a, [(0, pad if d == axis else 0) for d in range(a.ndim)])
    blocks = a.reshape(*a.shape[:axis], -1, NIBBLES_PER_WORD, GROUP, *a.shape[axis + 1:])     # [.., i, w, ..]
    return jnp.swapaxes(blocks, axis + 1, axis + 2).reshape(*a.shape)                        # position 8 w + i


def position_scales(scale):
    """Group-major scales [E, in_p/32, out] -> f32 [E, out, in_p], the scale of each of `int4_positions`' positions
    (group 8 (p // 256) + p % 8)."""
    p = jnp.arange(scale.shape[1] * GROUP)
    return jnp.swapaxes(scale.astype(jnp.float32), 1, 2)[:, :, p // BLOCK_IN * NIBBLES_PER_WORD + p % NIBBLES_PER_WORD]


def expand_scales(scale):
    """Group-major scales [E, in/32, out] -> f32 [E, out, in], one per weight."""
    return jnp.repeat(jnp.swapaxes(scale, 1, 2).astype(jnp.float32), GROUP, axis=2)


def dequantize_kernel_layout(packed, scale, in_dim: int):
    """Kernel layout (packed [E, out, in_p/8], scale [E, in_p/32, out]) -> W [E, out, in_dim] f32."""
    return (unpack_kernel_layout(packed).astype(jnp.float32) * expand_scales(scale))[:, :, :in_dim]


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


class Routing(NamedTuple):
    block_expert: jax.Array   # [B] int32: the expert of each block; E for blocks past the last
    block_token: jax.Array    # [B, block_m] int32: token of each row; M for padding rows
    block_weight: jax.Array   # [B, block_m] f32: routing weight of each row; 0 for padding rows
    pair_row: jax.Array       # [M * K] int32: row of blocks-by-rows where each pair's result lands
    pair_ok: jax.Array        # [M * K] bool: the pair's expert lies in [0, E)
    expert_pairs: jax.Array   # [E] int32: pairs per expert (each expert's run of rows, blocks cut from it)

    def pair_row_or_none(self) -> jax.Array:
        """[M * K] int32: each pair's row, -1 for a pair whose expert is not in [0, E) (the combines' input)."""
        return jnp.where(self.pair_ok, self.pair_row, -1)


def num_route_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the blocks `route_pairs` needs: every expert's last block may be partly empty."""
    return pl.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


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
    num_blocks = num_route_blocks(n_pairs, num_experts, block_m)
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
    return Routing(block_expert, block_token, block_weight, pair_row, key < num_experts, counts)
