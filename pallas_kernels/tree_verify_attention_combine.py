"""The split-K combine of the tree-verify attention kernels as one Triton kernel (launched by `triton_call`).

With num_splits > 1 both attention kernels leave partials: per split p, stream s and query row r an output
out[p, s, r] over its piece of the cache and that piece's running max m[p, s, r] and sum l[p, s, r]. The Triton kernel
writes out unnormalised (f32), the Mosaic GPU one normalised within the split (bf16). The op's output is

  result[s, r] = sum_p w_p * o_p / sum_p w_p * l_p,   w_p = exp(m_p - max_p m_p),
  o_p = out[p, s, r] (unnormalised) or l_p * out[p, s, r] (normalised)

and 0 for a row with nothing to attend (every l_p = 0). The reference is `tree_verify_attention.combine_partials`
(XLA: three launches). One program combines a tile of rows and columns of one stream over every split, `tiling`'s
BS splits per step, in two passes: the rows' largest max, then the weighted outputs added element by element into
registers (summed over the splits once, at the end). Its tiles take up to 128 contiguous columns of each row.
The one-pass kernel before it (a running max, its sums rescaled as it grew, and a reduction across threads at every
step over 16-column tiles) took 7.9 / 12.6 us at 132 / 256 splits of 64 bf16 rows on the H200, against XLA's busy
9.0 / 9.9, so XLA combined above 132 splits (kernels.md, "Tenth session"); this one: kernels.md, "Seventeenth
session".
"""
from __future__ import annotations

import jax
import triton
import triton.language as tl

from pallas_kernels import tree_verify_attention as op

LAUNCHER = "xla"     # compiled into XLA's executable, like the attention kernels
BLOCK_ROWS = 16
MAX_BLOCK_COLS = 128               # 256 B of a bf16 partial row per load
MIN_BLOCK_COLS = 32
TARGET_PROGRAMS = 256              # fewer rows, then narrower columns per program until the grid has this many
TILE_ELEMENTS = 4096               # f32 elements of one step's [splits, rows, columns] tile (32 per thread)
PIPELINED_STAGES = 3               # steps of loads in flight where there are PIPELINE_FROM_STEPS steps or more
PIPELINE_FROM_STEPS = 4            # (fewer: 1 stage; kernels.md, "Seventeenth session")


@triton.jit
def _combine_kernel(out_ptr, max_ptr, sum_ptr, result_ptr, SPLITS: tl.constexpr, STREAMS: tl.constexpr,
                    PART_ROWS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, PART_COLS: tl.constexpr,
                    BS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, MAX_BS: tl.constexpr,
                    NORMALIZED: tl.constexpr, STAGES: tl.constexpr):
    """Program (row tile, column tile, stream): out [SPLITS, STREAMS, PART_ROWS, PART_COLS], max / sum [SPLITS,
    STREAMS, PART_ROWS] -> result [STREAMS, ROWS, COLS] (its first ROWS rows and COLS columns). Two passes over the
    splits: the rows' largest max (MAX_BS splits a step), then the weighted outputs and sums (BS a step) added
    element by element into [BS, BR, BC] / [BS, BR] registers (no step waits on another's arithmetic, no reduction
    across threads until the end), the loads of STAGES steps in flight."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    s = tl.program_id(2)
    row_ok = rows < ROWS
    col_ok = cols < COLS
    tops = tl.full((MAX_BS, BR), float("-inf"), tl.float32)
    for first in tl.range(0, SPLITS, MAX_BS):
        split = first + tl.arange(0, MAX_BS)
        ok = (split < SPLITS)[:, None] & row_ok[None, :]
        tops = tl.maximum(tops, tl.load(max_ptr + ((split * STREAMS + s) * PART_ROWS)[:, None] + rows[None, :],
                                        mask=ok, other=float("-inf")))
    top = tl.max(tops, axis=0)
    base = tl.where(top == float("-inf"), 0.0, top)    # a row no split saw: weights 0, not NaN
    totals = tl.zeros((BS, BR), tl.float32)
    acc = tl.zeros((BS, BR, BC), tl.float32)
    for first in tl.range(0, SPLITS, BS, num_stages=STAGES):
        split = first + tl.arange(0, BS)
        ok = (split < SPLITS)[:, None] & row_ok[None, :]
        part = ((split * STREAMS + s) * PART_ROWS)[:, None] + rows[None, :]                       # [BS, BR]
        weight = tl.exp(tl.load(max_ptr + part, mask=ok, other=float("-inf")) - base[None, :])
        weighted_sum = weight * tl.load(sum_ptr + part, mask=ok, other=0.0)
        out = tl.load(out_ptr + part.to(tl.int64)[:, :, None] * PART_COLS + cols[None, None, :],
                      mask=ok[:, :, None] & col_ok[None, None, :], other=0.0)                     # [BS, BR, BC]
        totals += weighted_sum
        factor = weighted_sum if NORMALIZED else weight
        acc += factor[:, :, None] * out.to(tl.float32)
    total = tl.sum(totals, axis=0)
    inverse = tl.where(total > 0, 1.0 / total, 0.0)
    tl.store(result_ptr + (s * ROWS + rows).to(tl.int64)[:, None] * COLS + cols[None, :],
             (tl.sum(acc, axis=0) * inverse[:, None]).to(result_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def tiling(num_splits: int, num_streams: int, rows: int, cols: int, *, tile_elements: int = TILE_ELEMENTS,
           target_programs: int = TARGET_PROGRAMS) -> tuple[int, int, int]:
    """(splits, rows, columns) per program step: the widest column tile up to MAX_BLOCK_COLS (contiguous loads), the
    most rows up to BLOCK_ROWS, then fewer rows and narrower columns (down to MIN_BLOCK_COLS) until the grid has
    target_programs programs; as many splits as keep a step's tile within tile_elements."""
    width = min(MAX_BLOCK_COLS, triton.next_power_of_2(cols))
    block_rows = min(BLOCK_ROWS, triton.next_power_of_2(rows))

    def programs():
        return num_streams * triton.cdiv(rows, block_rows) * triton.cdiv(cols, width)

    while block_rows > 1 and programs() < target_programs:
        block_rows //= 2
    while width > MIN_BLOCK_COLS and programs() < target_programs:
        width //= 2
    splits = max(1, min(triton.next_power_of_2(num_splits), tile_elements // (block_rows * width)))
    return splits, block_rows, width


def max_block_splits(num_splits: int, block_splits: int, block_rows: int) -> int:
    """Splits per step of the first pass (the max; [splits, rows] tiles): all of them, up to TILE_ELEMENTS / rows,
    at least the second pass's block_splits."""
    return max(block_splits, min(triton.next_power_of_2(num_splits), TILE_ELEMENTS // block_rows))


def stages_for(num_splits: int, block_splits: int) -> int:
    """Steps of loads in flight: PIPELINED_STAGES from PIPELINE_FROM_STEPS steps over the splits, else 1."""
    return PIPELINED_STAGES if triton.cdiv(num_splits, block_splits) >= PIPELINE_FROM_STEPS else 1


def combine(call, out, row_max, row_sum, *, rows: int, cols: int, dtype, normalized: bool,
            block: tuple[int, int, int] | None = None, stages: int | None = None, num_warps: int = 4):
    """Partials out [P, S, R, Cp] (f32 unnormalised, or `normalized` within each split in any float dtype),
    row_max / row_sum [P, S, R] f32 (R >= rows, Cp >= cols) -> [S, rows, cols] in dtype, through
    `call(*operands, kernel=, out_shape=, grid=, num_warps=, num_stages=, **constexprs)` (`triton_call` bound to a
    launcher on the GPU; Triton's interpreter in the tests). block: (splits, rows, columns) per step, powers of two
    (default `tiling`; many splits over many rows take many steps of a few splits: the split heuristics keep P small
    there); stages: steps of loads in flight (default `stages_for`); num_warps per program."""
    if out.ndim != 4:
        raise ValueError(f"combine: partials out {out.shape} must be [P, S, R, Cp]")
    splits, streams, part_rows, part_cols = out.shape
    if row_max.shape != (splits, streams, part_rows) or row_sum.shape != row_max.shape or part_rows < rows \
            or part_cols < cols:
        raise ValueError(f"combine: partials out {out.shape}, max {row_max.shape}, sum {row_sum.shape} must be "
                         f"[P, S, R, Cp], [P, S, R], [P, S, R] with R >= rows={rows} and Cp >= cols={cols}")
    block_splits, block_rows, width = block or tiling(splits, streams, rows, cols)
    stages = stages_for(splits, block_splits) if stages is None else stages
    if min(block_splits, block_rows, width) < 1 or any(b & (b - 1) for b in (block_splits, block_rows, width)) \
            or stages < 1:
        raise ValueError(f"combine: block {(block_splits, block_rows, width)} must be three powers of two and "
                         f"stages={stages} >= 1")
    return call(out, row_max, row_sum, kernel=_combine_kernel,
                out_shape=jax.ShapeDtypeStruct((streams, rows, cols), dtype),
                grid=(triton.cdiv(rows, block_rows), triton.cdiv(cols, width), streams), num_warps=num_warps,
                num_stages=stages, SPLITS=splits, STREAMS=streams, PART_ROWS=part_rows, ROWS=rows, COLS=cols,
                PART_COLS=part_cols, BS=block_splits, BR=block_rows, BC=width,
                MAX_BS=max_block_splits(splits, block_splits, block_rows),
                NORMALIZED=normalized, STAGES=stages)


def merge(call, out, row_max, row_sum, *, rows: int, cols: int, dtype, normalized: bool):
    """`combine`'s result, by the Triton kernel, or by XLA's `combine_partials` when `call` is None (no Triton: a
    Mosaic GPU kernel in interpret mode)."""
    if call is not None:
        return combine(call, out, row_max, row_sum, rows=rows, cols=cols, dtype=dtype, normalized=normalized)
    return op.combine_partials(out, row_max, row_sum, normalized=normalized)[:, :rows, :cols].astype(dtype)
