"""Routed-expert MLP with INT4 weights as Triton kernels (launched by `triton_call`): the GPU's int4_moe.

The op of `int4_moe.py` (its semantics, the repacked compressed-tensors layout `Int4Experts`, the reference
`int4_moe_reference` and the routing of (token, slot) pairs into blocks of one expert, `route_pairs`); `ops.int4_moe`
runs it on the GPU. Three kernels: gate and up for a block of pairs in one pass over x, writing silu(gate) * up; down,
scaled by each pair's routing weight; the sum of each token's pairs (`_combine_kernel`, in slot order: deterministic,
like the reference). With `gate_up_splits` > 1 the gate and up pass is split along D and a fourth kernel adds the
splits' f32 partial sums (`_gate_up_reduce_kernel`, in split order) before silu(gate) * up.

The step (bf16): a program holds block_n output rows; per step it loads `words` packed words of each row (of the 32
words of a 256-input block) and turns them, two words at a time, into eight bf16 tiles [block_n, words], one per
nibble position i, i.e. per quantisation group of the block (`_DEQUANT_BF16X2`: ~2 instructions per weight, the
group scale applied in bf16x2). Nibble i's tile meets the block's tokens at inputs 32 i + w, a contiguous slice of
x, in one tensor-core dot (wgmma, the tile straight from registers); the eight dots share one f32 accumulator.

f32 activations (tests, references) take an exact path: all 8 nibbles unpacked to f32 (the pattern 0x4B000000 | (n ^ 8)
is 2^23 + q + 8 for the two's complement nibble n of q: an XOR and a subtraction), scaled, and multiplied in one IEEE
dot with x's columns permuted to match (`_block_columns`).

Triton compiles on any machine, which the CPU tests use to build the kernels for sm_90 (tests/test_int4_moe_triton.py)
and to lower the op for an H200 through XLA's Triton custom call (tests/test_triton_call.py).
Tilings and measurements: experiments/notes/kernels.md, "int4_moe in Triton".
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
from pallas_kernels.triton_call import LAUNCHERS, bound_to


@dataclasses.dataclass(frozen=True)
class TritonMoeConfig:
    """Tiling: block_m pairs (tokens of one expert) per block, block_n output rows per program, `words` packed words
    per row per step (16 or 32: 128 or 256 inputs); num_warps and num_stages as in Triton. The down kernel takes
    down_block_n, down_words and down_num_stages where given (its rows are D, its inputs only I; fewer stages fit two
    of its blocks on an SM), else block_n, words and num_stages.
    gate_up_splits: programs along D per gate_up tile (split-K: each writes f32 partial sums of gate and up, which
    `_gate_up_reduce_kernel` adds in split order before silu; more programs where few experts leave SMs idle). The
    partials take splits x rows x 2 x I x 4 bytes (rows: the routed blocks' pairs): meant for small M.
    group_by_block: launch a block's programs (its row tiles) next to each other (grid [tiles, blocks]) instead of
    one row tile of every block after another ([blocks, tiles]): the block's inputs (x rows for gate_up, h rows for
    down) are then read from DRAM once and from L2 by the rest (ncu at M=4096: down moved 14.9 GB for 3.2 GB of
    weights; kernels.md, "Thirteenth session").
    fma: the products as f32 multiply-adds on the CUDA cores (`_nibble_fmas`) instead of tensor-core dots, for
    blocks of one pair (block_m=1: an expert's pairs are blocks next to each other on the grid, whose weight tiles
    the second block reads from L2) and programs of 16-256 rows. A wgmma takes 16 token rows and here its A operand
    from registers, so each of a step's nibble dots waits for the one before (16 dependent waits a step in gate_up's
    PTX); for one token the multiply-adds cost one instruction a weight and nothing waits."""
    block_m: int = 16
    block_n: int = 64
    words: int = 32
    num_warps: int = 4
    num_stages: int = 3
    down_block_n: int | None = None
    down_words: int | None = None
    down_num_stages: int | None = None
    gate_up_splits: int = 1
    group_by_block: bool = False
    fma: bool = False

    def __post_init__(self):
        if self.fma and self.block_m != 1:
            raise ValueError(f"TritonMoeConfig(fma=True) takes one pair a block: block_m=1, not {self.block_m}")
        # a wgmma's 16 token rows and 64 output rows; the multiply-adds take one token row
        (low_m, high_m), low_n = ((1, 1), 16) if self.fma else ((16, 256), 64)
        for name, low, high in (("block_m", low_m, high_m), ("block_n", low_n, 256),
                                ("down_block_n", low_n, 256), ("gate_up_splits", 1, 8)):
            value = getattr(self, name)
            if value is not None and (not low <= value <= high or value & (value - 1)):
                raise ValueError(f"TritonMoeConfig.{name}={value} must be a power of two in [{low}, {high}]")
        for name in ("words", "down_words"):
            if getattr(self, name) not in (16, 32) and (name == "words" or getattr(self, name) is not None):
                raise ValueError(f"TritonMoeConfig.{name}={getattr(self, name)} must be 16 or 32 (128 or 256 inputs "
                                 "per step)")
        for name in ("num_stages", "down_num_stages"):
            if getattr(self, name) is not None and not 1 <= getattr(self, name) <= 8:
                raise ValueError(f"TritonMoeConfig.{name}={getattr(self, name)} must be in [1, 8]")

    def down_tiling(self) -> tuple[int, int, int]:
        """(rows per program, words per step, pipeline stages) of the down kernel."""
        return self.down_block_n or self.block_n, self.down_words or self.words, self.down_num_stages or self.num_stages


MAX_GRID_Y = 65535        # CUDA's limit on a grid's second and third axes
WIDE_ROWS_PAIRS = 32      # from this many pairs the small-block tiling takes 128-row programs (measured at 8 pairs,
                          # M = 1, and 64, M = 8; the threshold between them is not measured)


def default_config(num_pairs: int, num_experts: int) -> TritonMoeConfig:
    """Blocks of 16 tokens while a touched expert sees a handful of them, of 32 while it sees a few dozen (each
    expert's weights still streamed about once), of 128 once the GEMMs are dense. With 16-token blocks: 128 output
    rows per program once there are WIDE_ROWS_PAIRS pairs (M = 8: 487 against 585 us with 64 rows); below, the few
    experts' gate_up rows need 64-row programs to cover the SMs (M = 1: 128 rows left gate_up at 77 against 48 us),
    4 stages, and 128-row programs for down (30 against 34 us). kernels.md, "Tenth session". From 32-token blocks a
    block's programs launch together (group_by_block, unless the blocks overflow the grid's second axis): M=1024
    4.68 -> 3.69 ms; at M=4096 10.86 ms against 11.48, and 9.86 with the down kernel at two stages (two blocks per
    SM; ncu: down's DRAM traffic 14.9 -> 3.8 GB). kernels.md, "Fourteenth session"."""
    per_expert = num_pairs / num_experts
    if per_expert < 16 and num_pairs >= WIDE_ROWS_PAIRS:
        return TritonMoeConfig(block_m=16, block_n=128, words=32, num_warps=4, num_stages=3)
    if per_expert < 16:
        return TritonMoeConfig(block_m=16, block_n=64, words=32, num_warps=4, num_stages=4, down_block_n=128)
    block_m = 32 if per_expert < 48 else 128
    grouped = ref.num_route_blocks(num_pairs, num_experts, block_m) <= MAX_GRID_Y
    if per_expert < 48:
        return TritonMoeConfig(block_m=block_m, block_n=64, words=32, num_warps=4, num_stages=3,
                               group_by_block=grouped)
    return TritonMoeConfig(block_m=block_m, block_n=128, words=16, num_warps=8, num_stages=3, down_num_stages=2,
                           group_by_block=grouped)


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
    order of `_block_columns`: q * scale (q the nibble in two's complement), exact in f32 before the final rounding."""
    shifts = 4 * tl.arange(0, 8)
    nibbles = (words[:, :, None] >> shifts[None, None, :]) & 0xF                       # [BN, WORDS, 8]
    values = _nibble_value(nibbles)
    values = values * scale.to(tl.float32)[:, None, :]
    return tl.reshape(values, (BN, 8 * WORDS)).to(dtype)


# bf16x2 dequantization of two packed words, 16 weights, in 32 instructions: per byte, one prmt gathers the byte of
# both words into the two 16-bit halves, and-xor with 0x000F000F / 0x43084308 turns the low nibbles (after a shift,
# the high ones; q in two's complement, so n ^ 8 = q + 8) into the bf16 pair 136 + q, sub.bf16x2 136 makes them q
# (exact) and mul.bf16x2 applies the group's scale (the one rounding, to bf16). Operands: $0-$7 the 8 nibbles
# (bf16x2 each), $8 $9 the words, $10-$17 the scales of nibbles 0-7 (bf16x2). Elementwise: the low half of every
# register is one element, the high half the other, whichever two elements Triton packs.
_DEQUANT_BF16X2 = tl.constexpr("\n".join(["{", ".reg .b32 t, u, lo, hi, off;", "mov.b32 off, 0x43084308;"] + [
    line for b in range(4) for line in (
        f"prmt.b32 t, $8, $9, 0x{0x0400 + b * 0x0101:04x};",
        "shr.b32 u, t, 4;",
        "lop3.b32 lo, t, 0x000F000F, 0x43084308, 0x6A;",
        "lop3.b32 hi, u, 0x000F000F, 0x43084308, 0x6A;",
        "sub.rn.bf16x2 lo, lo, off;",
        "sub.rn.bf16x2 hi, hi, off;",
        f"mul.rn.bf16x2 ${2 * b}, lo, ${10 + 2 * b};",
        f"mul.rn.bf16x2 ${2 * b + 1}, hi, ${11 + 2 * b};")] + ["}"]))


@triton.jit
def _group_columns(scales):
    """scales [BN, 8] -> its 8 columns, [BN] each, in group order."""
    c0, c1 = tl.split(tl.reshape(scales, (scales.shape[0], 2, 2, 2)))     # column 4 a + 2 b + c: c, then b, then a
    b0c0, b1c0 = tl.split(c0)
    b0c1, b1c1 = tl.split(c1)
    g0, g4 = tl.split(b0c0)
    g2, g6 = tl.split(b1c0)
    g1, g5 = tl.split(b0c1)
    g3, g7 = tl.split(b1c1)
    return g0, g1, g2, g3, g4, g5, g6, g7


@triton.jit
def _dequantize_bf16(words, scale_ptr, rows, ROW_STRIDE: tl.constexpr):
    """words int32 [BN, W]; the scales of rows [BN] at scale_ptr (group of nibble 0; nibble i's is ROW_STRIDE * i
    further) -> the 8 nibble tiles q * scale, bf16 [BN, W] each (`_DEQUANT_BF16X2`). The scales come in one
    [BN, 8] load, contiguous along the rows, which Triton's pipeliner copies ahead asynchronously with the weights
    (eight [BN] loads of 2-byte elements it issues synchronously: warps stalled on them, kernels.md)."""
    scales = tl.load(scale_ptr + rows[:, None] + ROW_STRIDE * tl.arange(0, 8)[None, :])
    columns = _group_columns(scales)
    return tl.inline_asm_elementwise(
        _DEQUANT_BF16X2, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
        [words] + [column[:, None] for column in columns],
        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)


@triton.jit
def _dequantize_f32(words, scale_ptr, rows, ROW_STRIDE: tl.constexpr):
    """`_dequantize_bf16`'s 8 nibble tiles in f32, exact (`_dequantize`'s bit pattern), for f32 activations."""
    scales = tl.load(scale_ptr + rows[:, None] + ROW_STRIDE * tl.arange(0, 8)[None, :]).to(tl.float32)
    s0, s1, s2, s3, s4, s5, s6, s7 = _group_columns(scales)
    return (_nibble_f32(words, 0, s0), _nibble_f32(words, 1, s1), _nibble_f32(words, 2, s2),
            _nibble_f32(words, 3, s3), _nibble_f32(words, 4, s4), _nibble_f32(words, 5, s5),
            _nibble_f32(words, 6, s6), _nibble_f32(words, 7, s7))


@triton.jit
def _nibble_f32(words, i: tl.constexpr, scale):
    """words int32 [BN, W], scale f32 [BN] -> q * scale [BN, W] of nibble i."""
    return _nibble_value((words >> (4 * i)) & 0xF) * scale[:, None]


@triton.jit
def _nibble_value(nibbles):
    """Nibbles (int32, 0-15: q in two's complement) -> q as f32, exact: 2^23 + q + 8 - (2^23 + 8)."""
    return (nibbles ^ 0x4B000008).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _nibble_tiles(words, scale_ptr, rows, ROW_STRIDE: tl.constexpr, dtype: tl.constexpr):
    """The 8 nibble tiles [BN, W] of words int32 [BN, W]: bf16 (`_dequantize_bf16`) or f32 (`_dequantize_f32`)."""
    if dtype == tl.bfloat16:
        tiles = _dequantize_bf16(words, scale_ptr, rows, ROW_STRIDE)
    else:
        tiles = _dequantize_f32(words, scale_ptr, rows, ROW_STRIDE)
    return tiles


@triton.jit
def _nibble_act(act_ptr, i: tl.constexpr, act_cols, ACT_WIDTH: tl.constexpr, ok):
    """Nibble i's activations at act_ptr + 32 i ([BM, W] or [W]), 0 where not ok ([BM, 1] or a scalar) and past
    ACT_WIDTH (act_cols [W]: nibble 0's columns)."""
    if ACT_WIDTH % 256 == 0:
        act = tl.load(act_ptr + 32 * i, mask=ok, other=0.0)
    else:
        act = tl.load(act_ptr + 32 * i, mask=ok & (act_cols + 32 * i < ACT_WIDTH), other=0.0)
    return act


@triton.jit
def _nibble_dots(tiles, act_ptr, act_cols, ACT_WIDTH: tl.constexpr, rows_ok, acc):
    """acc + sum_i tiles[i] . act_i^T: tiles the 8 nibble tiles [BN, W] of `_dequantize_bf16`, act_ptr [BM, W] the
    pointers of nibble 0's inputs at columns act_cols [W] (nibble i's are 32 i further) of rows ACT_WIDTH wide, of
    which only the rows_ok [BM] are read: a block's padding rows count as 0 (down's h tiles are mostly padding rows
    at M <= 64; measured, kernels.md, "Eighteenth session"). The mask is constant along a row, so the loads stay
    vectorized; where the width is not a whole number of 256-input blocks the columns are masked too."""
    for i in tl.static_range(8):
        acc = tl.dot(tiles[i], tl.trans(_nibble_act(act_ptr, i, act_cols, ACT_WIDTH, rows_ok[:, None])), acc)
    return acc


@triton.jit
def _nibble_fmas(tiles, act_ptr, act_cols, ACT_WIDTH: tl.constexpr, rows_ok, acc):
    """`_nibble_dots` for one token row (BM = 1) as f32 multiply-adds into lanes: acc [BN, W] + tiles[i] * act_i
    for each nibble i, one multiply-add a weight; the lanes are summed once, after the last step
    (`_rows_by_tokens`). The row's activations are loaded as a [W] vector, in the tiles' column layout."""
    row = tl.reshape(act_ptr, (act_cols.shape[0],))
    ok = tl.max(rows_ok.to(tl.int32), axis=0) > 0
    for i in tl.static_range(8):
        act = _nibble_act(row, i, act_cols, ACT_WIDTH, ok).to(tl.float32)
        acc += tiles[i].to(tl.float32) * act[None, :]
    return acc


@triton.jit
def _nibble_products(tiles, act_ptr, act_cols, ACT_WIDTH: tl.constexpr, rows_ok, acc, FMA: tl.constexpr):
    """`_nibble_fmas` (acc [BN, W]) or `_nibble_dots` (acc [BN, BM])."""
    if FMA:
        acc = _nibble_fmas(tiles, act_ptr, act_cols, ACT_WIDTH, rows_ok, acc)
    else:
        acc = _nibble_dots(tiles, act_ptr, act_cols, ACT_WIDTH, rows_ok, acc)
    return acc


@triton.jit
def _zero_acc(BM: tl.constexpr, BN: tl.constexpr, WORDS: tl.constexpr, FMA: tl.constexpr):
    """An accumulator of `_nibble_products`: [BN, WORDS] lanes (FMA, BM = 1) or [BN, BM], f32 zeros."""
    if FMA:
        acc = tl.zeros((BN, WORDS), tl.float32)
    else:
        acc = tl.zeros((BN, BM), tl.float32)
    return acc


@triton.jit
def _rows_by_tokens(acc, FMA: tl.constexpr):
    """`_nibble_products`' accumulator as sums [BN, BM]: the lanes of the FMA one added (in a fixed order)."""
    if FMA:
        acc = tl.sum(acc, axis=1)[:, None]
    return acc


@triton.jit
def _clamped_rows(rows, NUM_ROWS: tl.constexpr, GRID_ROWS: tl.constexpr):
    """A block's rows [BN] clamped to the matrix's NUM_ROWS, the grid covering GRID_ROWS >= NUM_ROWS rows; left as
    they are when the grid covers exactly the matrix in whole blocks, so that Triton still sees them contiguous (vector
    loads of the scales). (Unclamped rows past NUM_ROWS would read the next expert's weights, and 0 * NaN is NaN.)"""
    if NUM_ROWS == GRID_ROWS and NUM_ROWS % int(rows.shape[0]) == 0:
        return rows
    return tl.minimum(rows, NUM_ROWS - 1)


@triton.jit
def _block_and_tile(GROUP_BY_BLOCK: tl.constexpr):
    """(block b, row tile n) of this program, from grid [blocks, tiles] or, GROUP_BY_BLOCK, [tiles, blocks]."""
    if GROUP_BY_BLOCK:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _gate_up_kernel(block_expert_ptr, block_token_ptr, x_ptr, gate_q_ptr, gate_s_ptr, up_q_ptr, up_s_ptr, h_ptr,
                    NUM_EXPERTS: tl.constexpr, NUM_TOKENS: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                    ROW_WORDS: tl.constexpr, H_COLS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    WORDS: tl.constexpr, SPLITS: tl.constexpr, ROWS: tl.constexpr, GROUP_BY_BLOCK: tl.constexpr,
                    FMA: tl.constexpr, STAGES: tl.constexpr):
    """Program (block b, rows n, split s): h[b's BM rows, n's BN columns] = silu(x W_gate^T) * (x W_up^T), its
    expert's (0 on the block's padding rows); with SPLITS > 1, over the split's 1 / SPLITS of D, the f32 sums
    x W_gate^T and x W_up^T into h_ptr [SPLITS, ROWS, 2, H_COLS] at [s, b's rows, 0 / 1, n's columns]
    (`_gate_up_reduce_kernel` finishes h). FMA: the products as multiply-adds (`_nibble_fmas`)."""
    b, n = _block_and_tile(GROUP_BY_BLOCK)
    steps: tl.constexpr = ROW_WORDS // WORDS // SPLITS
    first = tl.program_id(2) * steps
    if SPLITS == 1:
        first = 0
    e = tl.load(block_expert_ptr + b)
    if e < NUM_EXPERTS:
        dtype = x_ptr.dtype.element_ty
        tok = tl.load(block_token_ptr + b * BM + tl.arange(0, BM))
        tok_ok = tok < NUM_TOKENS
        tok = tl.minimum(tok, NUM_TOKENS - 1)
        rows = n * BN + tl.arange(0, BN)
        rows_in = _clamped_rows(rows, INTER, H_COLS)
        word = tl.arange(0, WORDS)
        group = tl.arange(0, 8)
        expert_words = e.to(tl.int64) * INTER * ROW_WORDS
        gate_q = gate_q_ptr + expert_words + rows_in[:, None] * ROW_WORDS + word[None, :]
        up_q = up_q_ptr + expert_words + rows_in[:, None] * ROW_WORDS + word[None, :]
        expert_scales = e.to(tl.int64) * (ROW_WORDS // 4) * INTER
        acc_g = _zero_acc(BM, BN, WORDS, FMA)
        acc_u = _zero_acc(BM, BN, WORDS, FMA)
        for step in tl.range(first, first + steps, num_stages=STAGES):
            block = step * WORDS // 32
            w_gate = tl.load(gate_q + step * WORDS)
            w_up = tl.load(up_q + step * WORDS)
            if FMA or dtype == tl.bfloat16:
                scale_at = expert_scales + block * 8 * INTER
                cols = tl.multiple_of(block * 256 + (step * WORDS) % 32, WORDS) + word                  # nibble 0
                act_at = x_ptr + tok[:, None] * HIDDEN + cols[None, :]                   # [BM, W]
                tiles = _nibble_tiles(w_gate, gate_s_ptr + scale_at, rows_in, INTER, dtype)
                acc_g = _nibble_products(tiles, act_at, cols, HIDDEN, tok_ok, acc_g, FMA)
                tiles = _nibble_tiles(w_up, up_s_ptr + scale_at, rows_in, INTER, dtype)
                acc_u = _nibble_products(tiles, act_at, cols, HIDDEN, tok_ok, acc_u, FMA)
            else:
                scale_at = expert_scales + (block * 8 + group)[None, :] * INTER + rows_in[:, None]       # [BN, 8]
                cols = _block_columns(step, WORDS)
                act = tl.load(x_ptr + tok[None, :] * HIDDEN + cols[:, None],
                              mask=(cols < HIDDEN)[:, None] & tok_ok[None, :], other=0.0)              # [8 W, BM]
                w_g = _dequantize(w_gate, tl.load(gate_s_ptr + scale_at), dtype, BN, WORDS)
                acc_g = tl.dot(w_g, act, acc_g, input_precision="ieee")
                w_u = _dequantize(w_up, tl.load(up_s_ptr + scale_at), dtype, BN, WORDS)
                acc_u = tl.dot(w_u, act, acc_u, input_precision="ieee")
        g = _rows_by_tokens(acc_g, FMA)                                                        # [BN, BM]
        u = _rows_by_tokens(acc_u, FMA)
        if SPLITS == 1:
            h = g * tl.sigmoid(g) * u
            out_rows = b * BM + tl.arange(0, BM)
            tl.store(h_ptr + out_rows[None, :].to(tl.int64) * H_COLS + rows[:, None], h.to(dtype),
                     mask=(rows < H_COLS)[:, None])
        else:
            out_rows = b * BM + tl.arange(0, BM)
            part = h_ptr + ((tl.program_id(2) * ROWS + out_rows[None, :]).to(tl.int64) * 2) * H_COLS + rows[:, None]
            tl.store(part, g, mask=(rows < H_COLS)[:, None])
            tl.store(part + H_COLS, u, mask=(rows < H_COLS)[:, None])


@triton.jit
def _gate_up_reduce_kernel(block_token_ptr, part_ptr, h_ptr, NUM_TOKENS: tl.constexpr, ROWS: tl.constexpr,
                           H_COLS: tl.constexpr, SPLITS: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr):
    """Program (rows r, columns c): h[r's RB rows, c's CB columns] = silu(g) * u, g and u the sums over the splits
    (in split order) of the f32 partials part [SPLITS, ROWS, 2, H_COLS]; padding rows (token NUM_TOKENS) read nothing
    and get 0."""
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    cols = tl.program_id(1) * CB + tl.arange(0, CB)
    ok = (tl.load(block_token_ptr + rows) < NUM_TOKENS)[:, None] & (cols < H_COLS)[None, :]
    at = part_ptr + rows[:, None].to(tl.int64) * 2 * H_COLS + cols[None, :]
    g = tl.zeros((RB, CB), tl.float32)
    u = tl.zeros((RB, CB), tl.float32)
    for s in tl.static_range(SPLITS):
        g += tl.load(at + s * ROWS * 2 * H_COLS, mask=ok, other=0.0)
        u += tl.load(at + s * ROWS * 2 * H_COLS + H_COLS, mask=ok, other=0.0)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + rows[:, None].to(tl.int64) * H_COLS + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=(cols < H_COLS)[None, :])


@triton.jit
def _down_kernel(block_expert_ptr, block_token_ptr, block_weight_ptr, h_ptr, down_q_ptr, down_s_ptr, y_ptr,
                 NUM_EXPERTS: tl.constexpr, NUM_TOKENS: tl.constexpr, HIDDEN: tl.constexpr, ROW_WORDS: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, WORDS: tl.constexpr, GROUP_BY_BLOCK: tl.constexpr,
                 FMA: tl.constexpr, STAGES: tl.constexpr):
    """Program (block b, rows n): y[b's BM rows, n's BN columns] = weight * (h W_down^T), its expert's (the block's
    padding rows of y are not written). FMA: the products as multiply-adds (`_nibble_fmas`)."""
    b, n = _block_and_tile(GROUP_BY_BLOCK)
    e = tl.load(block_expert_ptr + b)
    if e < NUM_EXPERTS:
        dtype = h_ptr.dtype.element_ty
        h_cols: tl.constexpr = ROW_WORDS * 8
        pair_rows = b * BM + tl.arange(0, BM)
        tok_ok = tl.load(block_token_ptr + pair_rows) < NUM_TOKENS
        rows = n * BN + tl.arange(0, BN)
        rows_in = _clamped_rows(rows, HIDDEN, HIDDEN)
        word = tl.arange(0, WORDS)
        group = tl.arange(0, 8)
        down_q = down_q_ptr + e.to(tl.int64) * HIDDEN * ROW_WORDS + rows_in[:, None] * ROW_WORDS + word[None, :]
        expert_scales = e.to(tl.int64) * (ROW_WORDS // 4) * HIDDEN
        acc = _zero_acc(BM, BN, WORDS, FMA)
        for step in tl.range(0, ROW_WORDS // WORDS, num_stages=STAGES):
            block = step * WORDS // 32
            w = tl.load(down_q + step * WORDS)
            if FMA or dtype == tl.bfloat16:
                cols = tl.multiple_of(block * 256 + (step * WORDS) % 32, WORDS) + word                  # nibble 0
                act_at = h_ptr + pair_rows[:, None].to(tl.int64) * h_cols + cols[None, :]                # [BM, W]
                tiles = _nibble_tiles(w, down_s_ptr + expert_scales + block * 8 * HIDDEN, rows_in, HIDDEN, dtype)
                acc = _nibble_products(tiles, act_at, cols, h_cols, tok_ok, acc, FMA)
            else:
                scale_rows = block * 8 + group
                scale = tl.load(down_s_ptr + expert_scales + scale_rows[None, :] * HIDDEN + rows_in[:, None])
                cols = _block_columns(step, WORDS)
                act = tl.load(h_ptr + pair_rows[None, :].to(tl.int64) * h_cols + cols[:, None])        # [8 W, BM]
                acc = tl.dot(_dequantize(w, scale, dtype, BN, WORDS), act, acc, input_precision="ieee")
        weight = tl.load(block_weight_ptr + pair_rows)
        y = _rows_by_tokens(acc, FMA) * weight[None, :]
        tl.store(y_ptr + pair_rows[None, :].to(tl.int64) * HIDDEN + rows[:, None], y.to(dtype),
                 mask=tok_ok[None, :] & (rows < HIDDEN)[:, None])


@triton.jit
def _combine_kernel(pair_row_ptr, y_ptr, out_ptr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr, BD: tl.constexpr):
    """Program (token m, columns d): out[m, d] = sum over m's K pairs, in slot order, of y[pair_row, d] (f32; a pair
    whose row is -1, an expert of another device, adds nothing)."""
    _sum_pairs(pair_row_ptr, pair_row_ptr, y_ptr, out_ptr, TOP_K, HIDDEN, BD, False)


@triton.jit
def _weighted_combine_kernel(pair_row_ptr, pair_weight_ptr, y_ptr, out_ptr, TOP_K: tl.constexpr,
                             HIDDEN: tl.constexpr, BD: tl.constexpr):
    """`_combine_kernel` with each pair's row scaled by its f32 weight pair_weight [M * K] (y not yet weighted)."""
    _sum_pairs(pair_row_ptr, pair_weight_ptr, y_ptr, out_ptr, TOP_K, HIDDEN, BD, True)


@triton.jit
def _sum_pairs(pair_row_ptr, pair_weight_ptr, y_ptr, out_ptr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
               BD: tl.constexpr, WEIGHTED: tl.constexpr):
    m = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    col_ok = cols < HIDDEN
    acc = tl.zeros((BD,), tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pair_row_ptr + m * TOP_K + j)
        y = tl.load(y_ptr + row.to(tl.int64) * HIDDEN + cols, mask=col_ok & (row >= 0), other=0.0).to(tl.float32)
        if WEIGHTED:
            y = tl.where(row >= 0, y * tl.load(pair_weight_ptr + m * TOP_K + j), 0.0)
        acc += y
    tl.store(out_ptr + m.to(tl.int64) * HIDDEN + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _route_kernel(ids_ptr, weights_ptr, block_expert_ptr, block_token_ptr, block_weight_ptr, pair_row_ptr,
                  NUM_PAIRS: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, NUM_TOKENS: tl.constexpr,
                  NUM_BLOCKS: tl.constexpr, BM: tl.constexpr, PAIRS_P: tl.constexpr, BINS: tl.constexpr,
                  BLOCKS_P: tl.constexpr):
    """One program: `int4_moe.route_pairs` of ids int32 [NUM_PAIRS] (pair = token * TOP_K + slot) and weights
    [NUM_PAIRS] -> block_expert [NUM_BLOCKS], block_token / block_weight [NUM_BLOCKS * BM], pair_row [NUM_PAIRS]
    (-1 for an expert outside [0, E)). PAIRS_P, BINS, BLOCKS_P: powers of two >= NUM_PAIRS, E + 1, NUM_BLOCKS."""
    lane = tl.arange(0, PAIRS_P)
    ids = tl.load(ids_ptr + lane, mask=lane < NUM_PAIRS, other=NUM_EXPERTS)
    key = tl.where((ids >= 0) & (ids < NUM_EXPERTS), ids, NUM_EXPERTS)     # another device's expert, padding: E
    bins = tl.arange(0, BINS)
    counts = tl.where(bins < NUM_EXPERTS, tl.histogram(key, BINS), 0)                 # pairs per expert [BINS]
    blocks = (counts + BM - 1) // BM
    block_begin = tl.cumsum(blocks, 0) - blocks
    pair_begin = tl.cumsum(counts, 0) - counts
    ordered = tl.sort(key * PAIRS_P + lane)          # by expert, then pair: argsort(key, stable=True)
    pair = ordered % PAIRS_P
    expert = ordered // PAIRS_P
    routed = expert < NUM_EXPERTS
    within = tl.minimum(expert, NUM_EXPERTS - 1)
    rank = lane - tl.gather(pair_begin, within, 0)                                    # the pair's place in its run
    row = tl.gather(block_begin, within, 0) * BM + rank
    all_rows = tl.arange(0, BLOCKS_P * BM)
    all_blocks = tl.arange(0, BLOCKS_P)
    tl.store(block_token_ptr + all_rows, NUM_TOKENS, mask=all_rows < NUM_BLOCKS * BM)     # padding rows first
    tl.store(block_weight_ptr + all_rows, 0.0, mask=all_rows < NUM_BLOCKS * BM)
    tl.store(block_expert_ptr + all_blocks, NUM_EXPERTS, mask=all_blocks < NUM_BLOCKS)
    tl.debug_barrier()                               # then the routed rows over them
    tl.store(block_token_ptr + row, pair // TOP_K, mask=routed)
    tl.store(block_weight_ptr + row, tl.load(weights_ptr + pair, mask=routed, other=0.0).to(tl.float32), mask=routed)
    tl.store(block_expert_ptr + row // BM, expert, mask=routed & (rank % BM == 0))
    tl.store(pair_row_ptr + pair, tl.where(routed, row, -1), mask=pair < NUM_PAIRS)


# Pairs `_route_kernel` sorts in one program (top-8: M <= 64); more go through XLA. Measured on the H200 (kernels.md,
# "Tenth session"): the kernel 2.5 / 3.2 / 6.0 / 40 us at 8 / 64 / 512 / 2048 pairs, XLA's routing ~18-25 us in ten
# launches.
MAX_ROUTED_PAIRS = 512


COMBINE_COLUMNS = 1024     # hidden columns per combine program
REDUCE_COLUMNS = 256       # columns of h per split-K reduce program,
REDUCE_ROWS = 32           # and at most this many rows (more spill registers: 12 KB of stack at 128)
# Through XLA's Triton custom call the gate_up and down kernels ran 2-3x slower on the H200 than Triton 3.6 compiles
# them (kernels.md, "Launching Triton kernels"): jax-triton launches them unless `set_default_launcher` says otherwise
# (experiments: bench_k26.py --moe_launcher).
LAUNCHER = "jax_triton"
_default = {"launcher": LAUNCHER}


def set_default_launcher(launcher: str = LAUNCHER) -> None:
    """The launcher of int4_moe calls that name none (`triton_call.LAUNCHERS`), from the next trace on."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r} is not one of {LAUNCHERS}")
    _default["launcher"] = launcher


def launch_config(config: TritonMoeConfig, dtype) -> TritonMoeConfig:
    """The tiling a call runs with: f32 activations (tests, references) take at most two stages, whose 4-byte tiles
    overflow the H200's shared memory at three with the large tiling (237 KB asked)."""
    if dtype == jnp.float32:
        return dataclasses.replace(config, num_stages=min(config.num_stages, 2),
                                   down_num_stages=min(config.down_tiling()[2], 2))
    return config


def pipelined(stages: int) -> dict:
    """The launch's num_stages and the step loops' STAGES (their `tl.range(num_stages=)`), one value: Triton's
    pipeliner stages a loop's loads only for dots unless the loop asks, and the multiply-add tilings have none."""
    return dict(num_stages=stages, STAGES=stages)


def int4_moe(x, experts: ref.Int4Experts, topk_ids, topk_weights, *, config: TritonMoeConfig | None = None,
             interpret: bool = False, launcher: str | None = None):
    """Triton kernels with the signature and semantics of `int4_moe_reference`.

    x [M, D] (bf16 or f32), topk_ids [M, K] int, topk_weights [M, K] -> [M, D] in x's dtype (f32 accumulation).
    config: the tiling (default `default_config`; f32 runs with `launch_config`'s stages).
    interpret: not available for Triton kernels (a ValueError: use the reference on the CPU).
    launcher: how the kernels are launched (`triton_call.LAUNCHERS`; default LAUNCHER or `set_default_launcher`'s).
    """
    return _int4_moe(x, experts, topk_ids, topk_weights, config=config, interpret=interpret,
                     launcher=launcher or _default["launcher"])


@functools.partial(jax.jit, static_argnames=("config", "interpret", "launcher"))
def _int4_moe(x, experts, topk_ids, topk_weights, *, config, interpret, launcher):
    call = bound_to(launcher, interpret=interpret, op="int4_moe_triton.int4_moe",
                    reference="int4_moe.int4_moe_reference (or ops.int4_moe)")
    return run_kernels(call, x, experts, topk_ids, topk_weights, config)


def run_kernels(call, x, experts: ref.Int4Experts, topk_ids, topk_weights, config: TritonMoeConfig | None,
                xla_routing: bool = False):
    """int4_moe's host side: check, route, and launch the kernels through `call(*operands, kernel=, out_shape=,
    grid=, num_warps=, num_stages=, **constexprs)` (`triton_call` on the GPU; the tests pass Triton's interpreter on
    the CPU). xla_routing: route through XLA at every M (`route`; the benchmark's peer of the routing kernel)."""
    ref.check_inputs(x, experts, topk_ids, topk_weights)
    if x.size >= 2 ** 31:
        raise ValueError(f"int4_moe_triton: x {x.shape} has 2^31 or more elements, past the kernels' 32-bit offsets "
                         f"into x: call it on fewer than {2 ** 31 // x.shape[1]} tokens at a time")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"int4_moe_triton takes x in bfloat16 or float32, got {x.dtype}; cast x first")
    m, d = x.shape
    num_experts, inter = experts.num_experts, experts.intermediate_size
    cfg = launch_config(config or default_config(topk_ids.size, num_experts), x.dtype)
    block_expert, block_token, block_weight, pair_row = route(call, topk_ids, topk_weights, num_experts, cfg.block_m,
                                                              xla_routing)
    num_blocks = block_expert.shape[0]
    rows = num_blocks * cfg.block_m
    gate_words, down_words = experts.gate_packed.shape[2], experts.down_packed.shape[2]
    inter_padded = down_words * NIBBLES_PER_WORD       # every column of h is written; padding meets zero down weights
    launch = dict(num_warps=cfg.num_warps, **pipelined(cfg.num_stages), BM=cfg.block_m, BN=cfg.block_n,
                  WORDS=cfg.words, GROUP_BY_BLOCK=cfg.group_by_block, FMA=cfg.fma)
    if cfg.group_by_block and num_blocks > MAX_GRID_Y:
        raise ValueError(f"group_by_block puts the {num_blocks} routed blocks on the grid's second axis, which CUDA "
                         f"caps at {MAX_GRID_Y}: use group_by_block=False or a larger block_m")

    def grid(tiles: int, *more: int) -> tuple[int, ...]:
        return (tiles, num_blocks, *more) if cfg.group_by_block else (num_blocks, tiles, *more)

    splits = cfg.gate_up_splits
    if (gate_words // cfg.words) % splits:
        raise ValueError(f"gate_up_splits={splits} does not divide the {gate_words // cfg.words} steps of "
                         f"{cfg.words} words over D={d}: choose a divisor")
    h_shape = jax.ShapeDtypeStruct((rows, inter_padded), x.dtype)
    partials = jax.ShapeDtypeStruct((splits, rows, 2, inter_padded), jnp.float32)     # split-K's gate and up sums
    h = call(
        block_expert, block_token, x, experts.gate_packed, experts.gate_scale, experts.up_packed,
        experts.up_scale, kernel=_gate_up_kernel, out_shape=h_shape if splits == 1 else partials,
        grid=grid(triton.cdiv(inter_padded, cfg.block_n), splits), NUM_EXPERTS=num_experts, NUM_TOKENS=m,
        HIDDEN=d, INTER=inter, ROW_WORDS=gate_words, H_COLS=inter_padded, SPLITS=splits, ROWS=rows, **launch)
    if splits > 1:
        columns, row_block = min(REDUCE_COLUMNS, inter_padded), min(REDUCE_ROWS, cfg.block_m)
        h = call(block_token, h, kernel=_gate_up_reduce_kernel, out_shape=h_shape,
                 grid=(rows // row_block, triton.cdiv(inter_padded, columns)), NUM_TOKENS=m, ROWS=rows,
                 H_COLS=inter_padded, SPLITS=splits, RB=row_block, CB=columns, num_warps=4, num_stages=1)
    down_n, down_step_words, down_stages = cfg.down_tiling()
    y = call(
        block_expert, block_token, block_weight, h, experts.down_packed, experts.down_scale,
        kernel=_down_kernel, out_shape=jax.ShapeDtypeStruct((rows, d), x.dtype),
        grid=grid(triton.cdiv(d, down_n)), NUM_EXPERTS=num_experts, NUM_TOKENS=m, HIDDEN=d,
        ROW_WORDS=down_words, **dict(launch, BN=down_n, WORDS=down_step_words, **pipelined(down_stages)))
    return combine_pairs(call, pair_row, y, topk_ids.shape, x.dtype)


def combine_pairs(call, pair_row, y, topk_shape: tuple[int, int], out_dtype, pair_weight=None):
    """out [M, D] (out_dtype) = for each token, the sum in slot order of y [R, D]'s rows pair_row [M * K] (-1: none),
    each scaled by pair_weight [M * K] (f32) where given (`_weighted_combine_kernel`; else y is already weighted)."""
    m, top_k = topk_shape
    d = y.shape[1]
    weighted = () if pair_weight is None else (pair_weight.astype(jnp.float32),)
    return call(pair_row, *weighted, y, kernel=_weighted_combine_kernel if weighted else _combine_kernel,
                out_shape=jax.ShapeDtypeStruct((m, d), out_dtype), grid=(m, triton.cdiv(d, COMBINE_COLUMNS)),
                TOP_K=top_k, HIDDEN=d, BD=COMBINE_COLUMNS, num_warps=4, num_stages=1)


def route(call, topk_ids, topk_weights, num_experts: int, block_m: int, xla_routing: bool = False):
    """`int4_moe.route_pairs` for the kernels: (block_expert [B], block_token [B * block_m], block_weight
    [B * block_m], pair_row [M * K] with -1 for a pair whose expert is outside [0, E)). Up to MAX_ROUTED_PAIRS pairs
    in `_route_kernel` (one launch where XLA's sort, cumsums and gathers take about ten), above (or with
    xla_routing) through XLA."""
    num_pairs = topk_ids.size
    if num_pairs > MAX_ROUTED_PAIRS or xla_routing:
        routing = ref.route_pairs(topk_ids, topk_weights, num_experts, block_m)
        return (routing.block_expert, routing.block_token.reshape(-1), routing.block_weight.reshape(-1),
                routing.pair_row_or_none())
    num_blocks = ref.num_route_blocks(num_pairs, num_experts, block_m)
    return call(topk_ids.reshape(num_pairs).astype(jnp.int32), topk_weights.reshape(num_pairs), kernel=_route_kernel,
                out_shape=(jax.ShapeDtypeStruct((num_blocks,), jnp.int32),
                           jax.ShapeDtypeStruct((num_blocks * block_m,), jnp.int32),
                           jax.ShapeDtypeStruct((num_blocks * block_m,), jnp.float32),
                           jax.ShapeDtypeStruct((num_pairs,), jnp.int32)),
                grid=(1,), num_warps=4, num_stages=1, NUM_PAIRS=num_pairs, TOP_K=topk_ids.shape[1],
                NUM_EXPERTS=num_experts, NUM_TOKENS=topk_ids.shape[0], NUM_BLOCKS=num_blocks, BM=block_m,
                PAIRS_P=triton.next_power_of_2(num_pairs), BINS=triton.next_power_of_2(num_experts + 1),
                BLOCKS_P=triton.next_power_of_2(num_blocks))
