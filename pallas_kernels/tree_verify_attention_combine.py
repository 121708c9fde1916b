"""The split-K combine of the tree-verify attention kernels as one Triton kernel (launched by `triton_call`).

With num_splits > 1 both attention kernels leave partials: per split p, stream s and query row r an output
out[p, s, r] over its piece of the cache and that piece's running max m[p, s, r] and sum l[p, s, r]. The Triton kernel
writes out unnormalised (f32), the Mosaic GPU one normalised within the split (bf16). The op's output is

  result[s, r] = sum_p w_p * o_p / sum_p w_p * l_p,   w_p = exp(m_p - max_p m_p),
  o_p = out[p, s, r] (unnormalised) or l_p * out[p, s, r] (normalised)

and 0 for a row with nothing to attend (every l_p = 0). The reference is `tree_verify_attention.combine_partials`
(XLA: three launches). One program combines a tile of rows and columns of one stream over every split in one pass,
`tiling`'s BS splits per step, rescaling its sums when the running max grows. Measured on the H200 (device time,
bf16 partials of 64 rows, kernels.md "Tenth session"): 1.7 / 2.7 / 4.9 / 7.9 / 12.6 us at 8 / 32 / 66 / 132 / 256
splits against XLA's busy 2.3 / 5.5 / 7.4 / 9.0 / 9.9 (the two-pass version before it: 11.2 us at 132, 19.0 at
256); loads kept in flight over 2-3 steps made it slower. So `merge` runs the kernel up to MAX_KERNEL_SPLITS = 132
splits and XLA's combine above.
"""
from __future__ import annotations

import jax
import triton
import triton.language as tl

from pallas_kernels import tree_verify_attention as op

LAUNCHER = "xla"     # compiled into XLA's executable, like the attention kernels
BLOCK_ROWS = 16
MAX_BLOCK_COLS = 128
MIN_BLOCK_COLS = 16
TARGET_PROGRAMS = 2 * op.NUM_SMS   # narrower column tiles until the grid fills the GPU twice
TILE_ELEMENTS = 4096               # f32 elements of one step's [splits, rows, columns] tile (32 per thread)
MAX_KERNEL_SPLITS = 132            # measured: above, XLA's combine is faster (module docstring)
STAGES = 1                         # steps of loads in flight (2-3 measured slower: kernels.md, "Tenth session")


@triton.jit
def _combine_kernel(out_ptr, max_ptr, sum_ptr, result_ptr, SPLITS: tl.constexpr, STREAMS: tl.constexpr,
                    PART_ROWS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, PART_COLS: tl.constexpr,
                    BS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, NORMALIZED: tl.constexpr,
                    STAGES: tl.constexpr):
    """Program (row tile, column tile, stream): out [SPLITS, STREAMS, PART_ROWS, PART_COLS], max / sum [SPLITS,
    STREAMS, PART_ROWS] -> result [STREAMS, ROWS, COLS] (its first ROWS rows and COLS columns). One pass over the
    splits, BS a step, with a running max (the sums and outputs rescaled when it grows), the loads of STAGES steps
    in flight."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    s = tl.program_id(2)
    row_ok = rows < ROWS
    col_ok = cols < COLS
    top = tl.full((BR,), float("-inf"), tl.float32)
    total = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, BC), tl.float32)
    for first in tl.range(0, SPLITS, BS, num_stages=STAGES):
        split = first + tl.arange(0, BS)
        ok = (split < SPLITS)[:, None] & row_ok[None, :]
        part = ((split * STREAMS + s) * PART_ROWS)[:, None] + rows[None, :]                       # [BS, BR]
        row_max = tl.load(max_ptr + part, mask=ok, other=float("-inf"))
        row_sum = tl.load(sum_ptr + part, mask=ok, other=0.0)
        out = tl.load(out_ptr + part.to(tl.int64)[:, :, None] * PART_COLS + cols[None, None, :],
                      mask=ok[:, :, None] & col_ok[None, None, :], other=0.0)                     # [BS, BR, BC]
        new_top = tl.maximum(top, tl.max(row_max, axis=0))
        base = tl.where(new_top == float("-inf"), 0.0, new_top)    # nothing seen yet: weights 0, not NaN
        rescale = tl.exp(top - base)
        weight = tl.exp(row_max - base[None, :])
        weighted_sum = weight * row_sum
        total = total * rescale + tl.sum(weighted_sum, axis=0)
        factor = weighted_sum if NORMALIZED else weight
        acc = acc * rescale[:, None] + tl.sum(factor[:, :, None] * out.to(tl.float32), axis=0)
        top = new_top
    inverse = tl.where(total > 0, 1.0 / total, 0.0)
    tl.store(result_ptr + (s * ROWS + rows).to(tl.int64)[:, None] * COLS + cols[None, :],
             (acc * inverse[:, None]).to(result_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tiling(num_splits: int, num_streams: int, rows: int, cols: int) -> tuple[int, int, int]:
    """(splits, rows, columns) per program step: rows up to BLOCK_ROWS, the widest column tile (a power of two in
    [MIN_BLOCK_COLS, MAX_BLOCK_COLS]) whose grid still has TARGET_PROGRAMS programs, and as many splits as keep a
    step's tile within TILE_ELEMENTS."""
    block_rows = min(BLOCK_ROWS, triton.next_power_of_2(rows))
    width = MAX_BLOCK_COLS
    while width > MIN_BLOCK_COLS and num_streams * triton.cdiv(rows, block_rows) * triton.cdiv(cols, width) \
            < TARGET_PROGRAMS:
        width //= 2
    splits = max(1, min(triton.next_power_of_2(num_splits), TILE_ELEMENTS // (block_rows * width)))
    return splits, block_rows, width


def combine(call, out, row_max, row_sum, *, rows: int, cols: int, dtype, normalized: bool,
            block: tuple[int, int, int] | None = None, stages: int = STAGES, num_warps: int = 4):
    """Partials out [P, S, R, Cp] (f32 unnormalised, or `normalized` within each split in any float dtype),
    row_max / row_sum [P, S, R] f32 (R >= rows, Cp >= cols) -> [S, rows, cols] in dtype, through
    `call(*operands, kernel=, out_shape=, grid=, num_warps=, num_stages=, **constexprs)` (`triton_call` bound to a
    launcher on the GPU; Triton's interpreter in the tests). block: (splits, rows, columns) per step, powers of two
    (default `tiling`); stages: steps of loads in flight; num_warps per program."""
    if out.ndim != 4:
        raise ValueError(f"combine: partials out {out.shape} must be [P, S, R, Cp]")
    splits, streams, part_rows, part_cols = out.shape
    if row_max.shape != (splits, streams, part_rows) or row_sum.shape != row_max.shape or part_rows < rows \
            or part_cols < cols:
        raise ValueError(f"combine: partials out {out.shape}, max {row_max.shape}, sum {row_sum.shape} must be "
                         f"[P, S, R, Cp], [P, S, R], [P, S, R] with R >= rows={rows} and Cp >= cols={cols}")
    block_splits, block_rows, width = block or tiling(splits, streams, rows, cols)
    if min(block_splits, block_rows, width) < 1 or any(b & (b - 1) for b in (block_splits, block_rows, width)) \
            or stages < 1:
        raise ValueError(f"combine: block {block} must be three powers of two and stages={stages} >= 1")
    return call(out, row_max, row_sum, kernel=_combine_kernel,
                out_shape=jax.ShapeDtypeStruct((streams, rows, cols), dtype),
                grid=(triton.cdiv(rows, block_rows), triton.cdiv(cols, width), streams), num_warps=num_warps,
                num_stages=stages, SPLITS=splits, STREAMS=streams, PART_ROWS=part_rows, ROWS=rows, COLS=cols,
                PART_COLS=part_cols, BS=block_splits, BR=block_rows, BC=width, NORMALIZED=normalized, STAGES=stages)


def merge(call, out, row_max, row_sum, *, rows: int, cols: int, dtype, normalized: bool):
    """`combine`'s result, by the Triton kernel up to MAX_KERNEL_SPLITS splits and by XLA's `combine_partials`
    above, or always when `call` is None (no Triton: a Mosaic GPU kernel in interpret mode)."""
    if call is not None and out.shape[0] <= MAX_KERNEL_SPLITS:
        return combine(call, out, row_max, row_sum, rows=rows, cols=cols, dtype=dtype, normalized=normalized)
    return op.combine_partials(out, row_max, row_sum, normalized=normalized)[:, :rows, :cols].astype(dtype)
