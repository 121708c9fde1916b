"""The split-K combine of the tree-verify attention kernels as one Triton kernel (launched by `triton_call`).

With num_splits > 1 both attention kernels leave partials: per split p, stream s and query row r an output
out[p, s, r] over its piece of the cache and that piece's running max m[p, s, r] and sum l[p, s, r]. The Triton kernel
writes out unnormalised (f32), the Mosaic GPU one normalised within the split (bf16). The op's output is

  result[s, r] = sum_p w_p * o_p / sum_p w_p * l_p,   w_p = exp(m_p - max_p m_p),
  o_p = out[p, s, r] (unnormalised) or l_p * out[p, s, r] (normalised)

and 0 for a row with nothing to attend (every l_p = 0). The reference is `tree_verify_attention.combine_partials`
(XLA: three launches). One program combines a tile of BLOCK_ROWS rows and block_cols columns of one stream over
every split, one split after the other: on the H200 that took 3.2-3.9 us of device time for 2-8 splits and 7-9 us
for 12-32, in one launch against XLA's three (8-10 us in all), but 20 / 36 / 69 us for 66 / 132 / 256 splits against
XLA's 7-14 (kernels.md, "Eighth session"). So `merge` runs this kernel up to MAX_KERNEL_SPLITS splits and XLA's
combine above; loading many splits per step is the change that would let the kernel take them all.
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
MAX_KERNEL_SPLITS = 16             # measured: above, XLA's combine is faster (module docstring)


@triton.jit
def _combine_kernel(out_ptr, max_ptr, sum_ptr, result_ptr, SPLITS: tl.constexpr, STREAMS: tl.constexpr,
                    PART_ROWS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, PART_COLS: tl.constexpr,
                    BR: tl.constexpr, BC: tl.constexpr, NORMALIZED: tl.constexpr):
    """Program (row tile, column tile, stream): out [SPLITS, STREAMS, PART_ROWS, PART_COLS], max / sum [SPLITS,
    STREAMS, PART_ROWS] -> result [STREAMS, ROWS, COLS] (its first ROWS rows and COLS columns)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    s = tl.program_id(2)
    row_ok = rows < ROWS
    tile_ok = row_ok[:, None] & (cols < COLS)[None, :]
    top = tl.full((BR,), float("-inf"), tl.float32)
    for p in range(SPLITS):
        top = tl.maximum(top, tl.load(max_ptr + (p * STREAMS + s) * PART_ROWS + rows, mask=row_ok,
                                      other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)      # every split empty: weights 0, not NaN
    total = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, BC), tl.float32)
    for p in range(SPLITS):
        part = (p * STREAMS + s) * PART_ROWS + rows
        weight = tl.exp(tl.load(max_ptr + part, mask=row_ok, other=float("-inf")) - top)
        weighted_sum = weight * tl.load(sum_ptr + part, mask=row_ok, other=0.0)
        total += weighted_sum
        out = tl.load(out_ptr + part.to(tl.int64)[:, None] * PART_COLS + cols[None, :], mask=tile_ok, other=0.0)
        acc += (weighted_sum if NORMALIZED else weight)[:, None] * out.to(tl.float32)
    inverse = tl.where(total > 0, 1.0 / total, 0.0)
    tl.store(result_ptr + (s * ROWS + rows).to(tl.int64)[:, None] * COLS + cols[None, :],
             (acc * inverse[:, None]).to(result_ptr.dtype.element_ty), mask=tile_ok)


def block_cols(num_streams: int, rows: int, cols: int) -> int:
    """Columns per program: the widest power of two <= MAX_BLOCK_COLS whose grid still has TARGET_PROGRAMS
    programs, at least MIN_BLOCK_COLS."""
    width = MAX_BLOCK_COLS
    while width > MIN_BLOCK_COLS and num_streams * triton.cdiv(rows, BLOCK_ROWS) * triton.cdiv(cols, width) \
            < TARGET_PROGRAMS:
        width //= 2
    return width


def combine(call, out, row_max, row_sum, *, rows: int, cols: int, dtype, normalized: bool):
    """Partials out [P, S, R, Cp] (f32 unnormalised, or `normalized` within each split in any float dtype),
    row_max / row_sum [P, S, R] f32 (R >= rows, Cp >= cols) -> [S, rows, cols] in dtype, through
    `call(*operands, kernel=, out_shape=, grid=, num_warps=, num_stages=, **constexprs)` (`triton_call` bound to a
    launcher on the GPU; Triton's interpreter in the tests)."""
    splits, streams, part_rows, part_cols = out.shape
    if row_max.shape != (splits, streams, part_rows) or row_sum.shape != row_max.shape or part_rows < rows \
            or part_cols < cols:
        raise ValueError(f"combine: partials out {out.shape}, max {row_max.shape}, sum {row_sum.shape} must be "
                         f"[P, S, R, Cp], [P, S, R], [P, S, R] with R >= rows={rows} and Cp >= cols={cols}")
    width = block_cols(streams, rows, cols)
    return call(out, row_max, row_sum, kernel=_combine_kernel,
                out_shape=jax.ShapeDtypeStruct((streams, rows, cols), dtype),
                grid=(triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(cols, width), streams), num_warps=4, num_stages=2,
                SPLITS=splits, STREAMS=streams, PART_ROWS=part_rows, ROWS=rows, COLS=cols, PART_COLS=part_cols,
                BR=BLOCK_ROWS, BC=width, NORMALIZED=normalized)


def merge(call, out, row_max, row_sum, *, rows: int, cols: int, dtype, normalized: bool):
    """`combine`'s result, by the Triton kernel up to MAX_KERNEL_SPLITS splits and by XLA's `combine_partials`
    above."""
    if out.shape[0] <= MAX_KERNEL_SPLITS:
        return combine(call, out, row_max, row_sum, rows=rows, cols=cols, dtype=dtype, normalized=normalized)
    return op.combine_partials(out, row_max, row_sum, normalized=normalized)[:, :rows, :cols].astype(dtype)
