"""Routed-expert MLP with INT4 weights as Triton kernels called through jax-triton (the maintained GPU path).

Same op as `int4_moe.int4_moe` (signature, semantics, the repacked compressed-tensors layout `Int4Experts`, the
reference `int4_moe_reference`, the routing of (token, slot) pairs into blocks of one expert). What differs is the
inner step: each program reads a [block_n, words] tile of packed weights per step (block_n output rows, `words` of
the 32 words of a 256-input block, i.e. 8 * words inputs), unpacks all 8 nibbles of every word at once into a
[block_n, 8 * words] tile, applies the group scales elementwise and makes ONE dot with the block's tokens, where the
Pallas-Triton kernel made eight K = 32 dots per step and scaled each product.

Unpacking word w's 8 nibbles in place puts input 32 i + w (nibble i, quantisation group i of the block) at position
8 w + i of the tile: the activations are loaded with their columns permuted the same way (`_block_columns`), which is
free, instead of the weights being shuffled. The integer to float conversion uses the f32 pattern 0x4B000000 | n
(= 2^23 + n): one OR and one subtraction, exact, no I2F instruction.

jax-triton imports only where a CUDA jaxlib is installed, so it is imported when a kernel is called; `triton`
itself compiles on any machine, which the CPU tests use to build the PTX for sm_90 (tests/test_int4_moe_triton.py).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import int4_moe as ref
from pallas_kernels.int4_layout import NIBBLES_PER_WORD
from pallas_kernels.triton_call import triton_call

WORDS_PER_BLOCK = ref.BLOCK_IN // NIBBLES_PER_WORD     # 32 words hold one repacked block of 256 inputs


@dataclasses.dataclass(frozen=True)
class TritonMoeConfig:
    """Tiling: block_m pairs (tokens of one expert) per block, block_n output rows per program, `words` packed words
    per row per step (16 or 32: 128 or 256 inputs); num_warps and num_stages as in Triton.

    use_mma: the block's product as one tensor-core dot per step (block_m >= 16), or, when False, on the CUDA cores
    (block_m in 1 .. 8): each dequantized weight times each of the block's tokens, summed over the step's words only
    once at the end, so no dot operand layout and no padding of one token to 16.
    """
    block_m: int = 16
    block_n: int = 64
    words: int = 32
    num_warps: int = 4
    num_stages: int = 4
    use_mma: bool = True

    def __post_init__(self):
        low_m, high_m = (16, 256) if self.use_mma else (1, 8)
        for name, low, high in (("block_m", low_m, high_m), ("block_n", 16, 256)):
            value = getattr(self, name)
            if not low <= value <= high or value & (value - 1):
                raise ValueError(f"TritonMoeConfig.{name}={value} must be a power of two in [{low}, {high}] with "
                                 f"use_mma={self.use_mma}")
        if self.words not in (16, 32):
            raise ValueError(f"TritonMoeConfig.words={self.words} must be 16 or 32 (128 or 256 inputs per step)")


def default_config(num_pairs: int, num_experts: int) -> TritonMoeConfig:
    """By pairs per expert: one or two tokens per touched expert on the CUDA cores, a handful on the tensor cores with
    blocks of 16, dense GEMMs with blocks of 128 (provisional: experiments/notes/kernels.md)."""
    per_expert = num_pairs / num_experts
    if per_expert < 0.5:
        return TritonMoeConfig(block_m=1, block_n=32, num_warps=4, num_stages=3, use_mma=False)
    if per_expert < 2:
        return TritonMoeConfig(block_m=2, block_n=32, num_warps=4, num_stages=3, use_mma=False)
    if per_expert < 16:
        return TritonMoeConfig(block_m=16, block_n=64, words=32, num_warps=4, num_stages=3)
    return TritonMoeConfig(block_m=128, block_n=128, words=16, num_warps=8, num_stages=3)


@triton.jit
def _block_columns(step, WORDS: tl.constexpr):
    """Input columns of tile positions 0 .. 8 WORDS - 1 at step `step`: position 8 w + i holds input 32 i + w of the
    step's 256-input block (steps of 16 words take half a block)."""
    pos = tl.arange(0, 8 * WORDS)
    words_per_block: tl.constexpr = 32
    first_word = (step * WORDS) % words_per_block
    block = (step * WORDS) // words_per_block
    return block * 256 + (pos % 8) * 32 + first_word + pos // 8


@triton.jit
def _dequantize(words, scale, dtype: tl.constexpr, BN: tl.constexpr, WORDS: tl.constexpr):
    """words int32 [BN, WORDS], scale [BN, 8] (group i of the block for nibble i) -> [BN, 8 WORDS] of dtype, in the
    order of `_block_columns`: (nibble - 8) * scale, exact in f32 before the final rounding."""
    shifts = 4 * tl.arange(0, 8)
    nibbles = (words[:, :, None] >> shifts[None, None, :]) & 0xF                       # [BN, WORDS, 8]
    values = (nibbles | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0          # 2^23 + n - (2^23 + 8)
    values = values * scale.to(tl.float32)[:, None, :]
    return tl.reshape(values, (BN, 8 * WORDS)).to(dtype)


@triton.jit
def _dot(w, act, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(w, act, acc, input_precision="ieee")
    return tl.dot(w, act, acc)


@triton.jit
def _gate_up_kernel(block_expert_ptr, block_token_ptr, x_ptr, gate_q_ptr, gate_s_ptr, up_q_ptr, up_s_ptr, h_ptr,
                    NUM_EXPERTS: tl.constexpr, NUM_TOKENS: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                    ROW_WORDS: tl.constexpr, H_COLS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    WORDS: tl.constexpr):
    """Program (block b, rows n): h[b's BM rows, n's BN columns] = silu(x W_gate^T) * (x W_up^T), its expert's."""
    b = tl.program_id(0)
    n = tl.program_id(1)
    e = tl.load(block_expert_ptr + b)
    if e < NUM_EXPERTS:
        dtype = x_ptr.dtype.element_ty
        tok = tl.load(block_token_ptr + b * BM + tl.arange(0, BM))
        tok_ok = tok < NUM_TOKENS
        tok = tl.minimum(tok, NUM_TOKENS - 1)
        rows = n * BN + tl.arange(0, BN)
        rows_in = tl.minimum(rows, INTER - 1)
        word = tl.arange(0, WORDS)
        group = tl.arange(0, 8)
        expert_words = e.to(tl.int64) * INTER * ROW_WORDS
        gate_q = gate_q_ptr + expert_words + rows_in[:, None] * ROW_WORDS + word[None, :]
        up_q = up_q_ptr + expert_words + rows_in[:, None] * ROW_WORDS + word[None, :]
        expert_scales = e.to(tl.int64) * (ROW_WORDS // 4) * INTER
        acc_g = tl.zeros((BN, BM), tl.float32)
        acc_u = tl.zeros((BN, BM), tl.float32)
        for step in tl.range(0, ROW_WORDS // WORDS):
            scale_rows = (step * WORDS // 32) * 8 + group
            scale_at = expert_scales + scale_rows[None, :] * INTER + rows_in[:, None]            # [BN, 8]
            cols = _block_columns(step, WORDS)
            act = tl.load(x_ptr + tok[None, :] * HIDDEN + cols[:, None],
                          mask=(cols < HIDDEN)[:, None] & tok_ok[None, :], other=0.0)            # [8 WORDS, BM]
            w_gate = _dequantize(tl.load(gate_q + step * WORDS), tl.load(gate_s_ptr + scale_at), dtype, BN, WORDS)
            acc_g = _dot(w_gate, act, acc_g, dtype == tl.float32)
            w_up = _dequantize(tl.load(up_q + step * WORDS), tl.load(up_s_ptr + scale_at), dtype, BN, WORDS)
            acc_u = _dot(w_up, act, acc_u, dtype == tl.float32)
        h = acc_g * tl.sigmoid(acc_g) * acc_u                                                  # [BN, BM]
        out_rows = b * BM + tl.arange(0, BM)
        tl.store(h_ptr + out_rows[None, :].to(tl.int64) * H_COLS + rows[:, None], h.to(dtype),
                 mask=(rows < H_COLS)[:, None])


@triton.jit
def _down_kernel(block_expert_ptr, block_token_ptr, block_weight_ptr, h_ptr, down_q_ptr, down_s_ptr, y_ptr,
                 NUM_EXPERTS: tl.constexpr, NUM_TOKENS: tl.constexpr, HIDDEN: tl.constexpr, ROW_WORDS: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, WORDS: tl.constexpr):
    """Program (block b, rows n): y[b's BM rows, n's BN columns] = weight * (h W_down^T), its expert's."""
    b = tl.program_id(0)
    n = tl.program_id(1)
    e = tl.load(block_expert_ptr + b)
    if e < NUM_EXPERTS:
        dtype = h_ptr.dtype.element_ty
        h_cols: tl.constexpr = ROW_WORDS * 8
        pair_rows = b * BM + tl.arange(0, BM)
        rows = n * BN + tl.arange(0, BN)
        rows_in = tl.minimum(rows, HIDDEN - 1)
        word = tl.arange(0, WORDS)
        group = tl.arange(0, 8)
        down_q = down_q_ptr + e.to(tl.int64) * HIDDEN * ROW_WORDS + rows_in[:, None] * ROW_WORDS + word[None, :]
        expert_scales = e.to(tl.int64) * (ROW_WORDS // 4) * HIDDEN
        acc = tl.zeros((BN, BM), tl.float32)
        for step in tl.range(0, ROW_WORDS // WORDS):
            scale_rows = (step * WORDS // 32) * 8 + group
            scale = tl.load(down_s_ptr + expert_scales + scale_rows[None, :] * HIDDEN + rows_in[:, None])
            cols = _block_columns(step, WORDS)
            act = tl.load(h_ptr + pair_rows[None, :].to(tl.int64) * h_cols + cols[:, None])            # [8 WORDS, BM]
            w = _dequantize(tl.load(down_q + step * WORDS), scale, dtype, BN, WORDS)
            acc = _dot(w, act, acc, dtype == tl.float32)
        weight = tl.load(block_weight_ptr + pair_rows)
        tok_ok = tl.load(block_token_ptr + pair_rows) < NUM_TOKENS
        y = acc * weight[None, :]
        tl.store(y_ptr + pair_rows[None, :].to(tl.int64) * HIDDEN + rows[:, None], y.to(dtype),
                 mask=tok_ok[None, :] & (rows < HIDDEN)[:, None])


@triton.jit
def _scaled_nibbles(words, scale_ptr, nibble: tl.constexpr):
    """Nibble `nibble` of words int32 [BN, WORDS] as (n - 8) * scale in f32; scale_ptr [BN] points at its group."""
    values = (((words >> (4 * nibble)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return values * tl.load(scale_ptr).to(tl.float32)[:, None]


@triton.jit
def _gate_up_fma_kernel(block_expert_ptr, block_token_ptr, x_ptr, gate_q_ptr, gate_s_ptr, up_q_ptr, up_s_ptr, h_ptr,
                        NUM_EXPERTS: tl.constexpr, NUM_TOKENS: tl.constexpr, HIDDEN: tl.constexpr,
                        INTER: tl.constexpr, ROW_WORDS: tl.constexpr, H_COLS: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr):
    """`_gate_up_kernel` on the CUDA cores: per step, 32 words of each of BN rows (one 256-input block); products
    accumulated per (token, row, word) in f32 and summed over the words after the last step."""
    b = tl.program_id(0)
    n = tl.program_id(1)
    e = tl.load(block_expert_ptr + b)
    if e < NUM_EXPERTS:
        dtype = x_ptr.dtype.element_ty
        tok = tl.load(block_token_ptr + b * BM + tl.arange(0, BM))
        tok_ok = tok < NUM_TOKENS
        tok = tl.minimum(tok, NUM_TOKENS - 1)
        rows = n * BN + tl.arange(0, BN)
        rows_in = tl.minimum(rows, INTER - 1)
        word = tl.arange(0, 32)
        expert_words = e.to(tl.int64) * INTER * ROW_WORDS
        gate_q = gate_q_ptr + expert_words + rows_in[:, None] * ROW_WORDS + word[None, :]
        up_q = up_q_ptr + expert_words + rows_in[:, None] * ROW_WORDS + word[None, :]
        scales = e.to(tl.int64) * (ROW_WORDS // 4) * INTER + rows_in
        acc_g = tl.zeros((BM, BN, 32), tl.float32)
        acc_u = tl.zeros((BM, BN, 32), tl.float32)
        for step in tl.range(0, ROW_WORDS // 32):
            w_gate = tl.load(gate_q + step * 32)
            w_up = tl.load(up_q + step * 32)
            for i in tl.static_range(8):
                cols = step * 256 + i * 32 + word
                act = tl.load(x_ptr + tok[:, None] * HIDDEN + cols[None, :],
                              mask=tok_ok[:, None] & (cols < HIDDEN)[None, :], other=0.0).to(tl.float32)  # [BM, 32]
                group = (step * 8 + i) * INTER
                acc_g += _scaled_nibbles(w_gate, gate_s_ptr + scales + group, i)[None, :, :] * act[:, None, :]
                acc_u += _scaled_nibbles(w_up, up_s_ptr + scales + group, i)[None, :, :] * act[:, None, :]
        g = tl.sum(acc_g, axis=2)
        u = tl.sum(acc_u, axis=2)
        h = g * tl.sigmoid(g) * u                                                               # [BM, BN]
        out_rows = b * BM + tl.arange(0, BM)
        tl.store(h_ptr + out_rows[:, None].to(tl.int64) * H_COLS + rows[None, :], h.to(dtype),
                 mask=(rows < H_COLS)[None, :])


@triton.jit
def _down_fma_kernel(block_expert_ptr, block_token_ptr, block_weight_ptr, h_ptr, down_q_ptr, down_s_ptr, y_ptr,
                     NUM_EXPERTS: tl.constexpr, NUM_TOKENS: tl.constexpr, HIDDEN: tl.constexpr,
                     ROW_WORDS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """`_down_kernel` on the CUDA cores (see `_gate_up_fma_kernel`)."""
    b = tl.program_id(0)
    n = tl.program_id(1)
    e = tl.load(block_expert_ptr + b)
    if e < NUM_EXPERTS:
        dtype = h_ptr.dtype.element_ty
        h_cols: tl.constexpr = ROW_WORDS * 8
        pair_rows = b * BM + tl.arange(0, BM)
        rows = n * BN + tl.arange(0, BN)
        rows_in = tl.minimum(rows, HIDDEN - 1)
        word = tl.arange(0, 32)
        down_q = down_q_ptr + e.to(tl.int64) * HIDDEN * ROW_WORDS + rows_in[:, None] * ROW_WORDS + word[None, :]
        scales = e.to(tl.int64) * (ROW_WORDS // 4) * HIDDEN + rows_in
        acc = tl.zeros((BM, BN, 32), tl.float32)
        for step in tl.range(0, ROW_WORDS // 32):
            w = tl.load(down_q + step * 32)
            for i in tl.static_range(8):
                cols = step * 256 + i * 32 + word
                act = tl.load(h_ptr + pair_rows[:, None].to(tl.int64) * h_cols + cols[None, :]).to(tl.float32)
                acc += _scaled_nibbles(w, down_s_ptr + scales + (step * 8 + i) * HIDDEN, i)[None, :, :] * act[:, None, :]
        weight = tl.load(block_weight_ptr + pair_rows)
        tok_ok = tl.load(block_token_ptr + pair_rows) < NUM_TOKENS
        y = tl.sum(acc, axis=2) * weight[:, None]                                              # [BM, BN]
        tl.store(y_ptr + pair_rows[:, None].to(tl.int64) * HIDDEN + rows[None, :], y.to(dtype),
                 mask=tok_ok[:, None] & (rows < HIDDEN)[None, :])


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def int4_moe(x, experts: ref.Int4Experts, topk_ids, topk_weights, *, config: TritonMoeConfig | None = None,
             interpret: bool = False):
    """Triton kernels with the signature and semantics of `int4_moe_reference`.

    x [M, D] (bf16 or f32), topk_ids [M, K] int, topk_weights [M, K] -> [M, D] in x's dtype (f32 accumulation).
    interpret: not available for Triton kernels (a ValueError: use the reference or the Pallas kernel on the CPU).
    """
    if interpret:
        raise ValueError("int4_moe_triton has no interpret mode: on the CPU use ops.int4_moe (the reference) or "
                         "int4_moe.int4_moe(..., interpret=True)")
    ref.check_inputs(x, experts, topk_ids, topk_weights)
    m, d = x.shape
    num_experts, inter = experts.num_experts, experts.intermediate_size
    cfg = config or default_config(topk_ids.size, num_experts)
    routing = ref.route_pairs(topk_ids, topk_weights, num_experts, cfg.block_m)
    num_blocks = routing.block_expert.shape[0]
    rows = num_blocks * cfg.block_m
    gate_words, down_words = experts.gate_packed.shape[2], experts.down_packed.shape[2]
    inter_padded = down_words * NIBBLES_PER_WORD       # every column of h is written (padding rows give 0)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, BM=cfg.block_m, BN=cfg.block_n)
    if cfg.use_mma:
        gate_up, down, launch = _gate_up_kernel, _down_kernel, dict(launch, WORDS=cfg.words)
    else:
        gate_up, down = _gate_up_fma_kernel, _down_fma_kernel
    h = triton_call(
        routing.block_expert, routing.block_token, x, experts.gate_packed, experts.gate_scale, experts.up_packed,
        experts.up_scale, kernel=gate_up, out_shape=jax.ShapeDtypeStruct((rows, inter_padded), x.dtype),
        grid=(num_blocks, triton.cdiv(inter_padded, cfg.block_n)), NUM_EXPERTS=num_experts, NUM_TOKENS=m, HIDDEN=d,
        INTER=inter, ROW_WORDS=gate_words, H_COLS=inter_padded, **launch)
    y = triton_call(
        routing.block_expert, routing.block_token, routing.block_weight, h, experts.down_packed, experts.down_scale,
        kernel=down, out_shape=jax.ShapeDtypeStruct((rows, d), x.dtype),
        grid=(num_blocks, triton.cdiv(d, cfg.block_n)), NUM_EXPERTS=num_experts, NUM_TOKENS=m, HIDDEN=d,
        ROW_WORDS=down_words, **launch)
    return ref.combine_pairs(y, routing.pair_row.reshape(m, -1), routing.pair_ok.reshape(m, -1)).astype(x.dtype)
