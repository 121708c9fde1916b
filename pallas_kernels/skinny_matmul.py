"""Products of a few rows by a weight, y = [rmsnorm](x) @ w^T [+ residual] with w [N, K] (a dense weight as the
model stores it: [out, in]), as Triton kernels whose tiling is fixed by the weight's shape alone: the decode step's
dense projections (q_a, kv_a, q_b, o_proj, the shared expert, the router, the lm_head slice) at M = 1-64 rows.

Why: at M = 1 XLA:GPU turns each of these products into a reduction fusion that read its weight at ~25% of the
H100's bandwidth in the tp=8 share's profile (~80 us a layer for ~74 MB, the weights then stored [K, N];
experiments/notes/k26.md, "Kernels per layer of the share"). Here each program streams a [BN, BK] slab of w per
step with tl.dot on 16-row tiles of x;
split-K gives a narrow N enough programs to cover the SMs, and a second kernel adds the splits in split order.
The row tiles of a column block are neighbours on the grid (its first axis), so with M > 16 they run together and
read the block's slabs of w from L2: w once from memory, not once per row tile (with the columns first, the grid
ran every column block of one row tile before the next tile's, and a weight larger than L2, as the lm_head slice,
came from memory once per tile; not yet measured).

Fusions: `norm_weight` applies the RMSNorm that feeds the product: rmsnorm(x) w = rsqrt(mean(x^2) + eps) (x g) w
per row, so a program multiplies its slab of x by g on the way into the product and sums the slab's squares on the
same pass, and the row's scale is applied to the f32 sum at the end (after the splits are added). x g is rounded to
x's dtype where the reference rounds x * scale * g: the results differ by that rounding. `residual` adds the
layer's residual stream in the epilogue, rounding the product to the output dtype first, as `residual + (x @ w^T)`
does.

Row invariance: the tiling is `default_tiling(K, N)`, never a function of M, and every program multiplies a whole
16-row tile of x (rows past M load as zeros, through a mask: no padded copy of x), so a row's sums run in one order
(over BK-wide steps of K in increasing order, split partials added in split order) whatever M and whatever rows
share its tile. M is a compile-time constant of the kernels (it sets the masks and the output's shape); the
instruction sequence along K does not depend on it (tests/test_kernels_gpu.py checks a row alone against the same
row among others, bitwise). This is the property the exact mode (`DecodeSpec.exact`) needs on the GPU. Not so
the `Tiling.fma` tilings (a measured alternative for M <= 8, not the default): their row tile is next_pow2(M) high.

Launches: the product kernel alone without split-K (the norm, the scale and the residual in it), the splits kernel
after it with; nothing around them (a first version padded x, sliced the output and cast the norm's weight: five or
six launches a product, whose glue kernels cost about as much as the products in the step; k26.md).

`skinny_matmul_reference` is the specification (XLA, f32 accumulation). On the CPU the kernels run in Triton's
interpreter (tests/test_skinny_matmul_interpreter.py) and lower for sm_90 (tests/test_triton_call.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.triton_call import bound_to

BLOCK_M = 16          # rows per program: tl.dot's smallest tile; rows past M are masked
TARGET_PROGRAMS = 264  # programs a 16-row tile aims for (two per SM of an H200 / H100, 132 SMs)
STAGES = 3           # the product kernel's pipeline: steps whose x and w loads are in flight
FMA_MAX_ROWS = 8     # the most rows of `Tiling.fma` (its accumulator holds rows x block_k x block_n floats)
FLOATS = (jnp.bfloat16, jnp.float32)  # the dtypes of x, w, norm_weight, residual and the output
MIN_SPLIT_STEPS = 8  # fewer K steps than this: no split (a program's walk is short, a split only adds the splits
# kernel's launch: the code target's products, K = 256 in two steps, spent 54 of the exact AR round's 452 us of busy
# time in it on an H100; experiments/notes/decode.md, "The splits kernel of short products")
LAUNCHER = "ffi"      # typed custom call, command-buffer compatible (triton_call.py); not yet measured against "xla"


class Tiling(NamedTuple):
    block_n: int   # output columns per program
    block_k: int   # K per step
    splits: int    # programs along K (1: no partials, no second kernel)
    fma: bool = False  # products as f32 multiply-adds on the CUDA cores, the rows in tiles of next_pow2(M) <= 8
    # (no tl.dot: a 16-row tensor-core tile does 16x the work of a row; M <= FMA_MAX_ROWS only). Their sums run
    # along K per (row, k lane, column), the lanes added at the end: the order depends on the tile's shape, so the
    # row invariance holds only among M of one tile height


def default_tiling(k: int, n: int, block_n: int | None = None, block_k: int | None = None,
                   fma: bool = False) -> Tiling:
    """The tiling of an [N, K] weight: 64 columns a program (128 once N alone gives TARGET_PROGRAMS), 128-deep steps
    (64 when K is not a multiple of 128; 32 with fma, whose accumulator holds rows x steps x columns floats), and the
    largest split of K into whole steps that keeps programs * splits <= TARGET_PROGRAMS (none below
    MIN_SPLIT_STEPS steps). A function of (K, N) only (the module's row invariance rests on it). block_n / block_k
    replace the first two choices (the benchmark's variants); fma: `Tiling.fma`."""
    block_n = block_n or (128 if triton.cdiv(n, 128) >= TARGET_PROGRAMS else 64)
    block_k = block_k or (32 if fma else 128 if k % 128 == 0 else 64)
    if k % block_k:
        raise ValueError(f"skinny_matmul: K = {k} is not a multiple of {block_k}; pad the weight's rows")
    steps, programs = k // block_k, triton.cdiv(n, block_n)
    splits = 1 if steps < MIN_SPLIT_STEPS else max(
        s for s in range(1, steps + 1) if steps % s == 0 and (s == 1 or programs * s <= TARGET_PROGRAMS))
    return Tiling(block_n, block_k, splits, fma)


def skinny_matmul_reference(x, w, *, norm_weight=None, eps: float = 1e-6, residual=None, out_dtype=None):
    """x [M, K] (bf16 / f32), w [N, K] (x's dtype), norm_weight [K] or None, residual [M, N] or None -> [M, N] in
    out_dtype (default x's): (rmsnorm(x) if norm_weight is given) @ w^T with f32 accumulation, rounded, plus
    residual."""
    out_dtype = out_dtype or x.dtype
    if norm_weight is not None:
        x32 = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        x = (x32 * inv * norm_weight.astype(jnp.float32)).astype(x.dtype)
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(out_dtype)
    if residual is not None:
        y = (residual.astype(jnp.float32) + y.astype(jnp.float32)).astype(out_dtype)
    return y


@triton.jit
def _product_kernel(x_ptr, w_ptr, g_ptr, residual_ptr, out_ptr, squares_ptr, M: tl.constexpr, K: tl.constexpr,
                    N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr,
                    NORM: tl.constexpr, RESIDUAL: tl.constexpr, EPS: tl.constexpr, IEEE: tl.constexpr,
                    FMA: tl.constexpr, STAGES: tl.constexpr):
    """Program (row tile m, columns n, split s), over the split's K: out[s, m's rows, n's BN columns] = the f32 sum of
    x' w with x' = x, or with NORM x' = x * g rounded to x's dtype, and squares[s, rows] = the sum of x^2 (NORM);
    rows past M read as zeros and are not written. SPLITS = 1 finishes in place: out (the caller's dtype) = that sum
    times rsqrt(sum of x^2 / K + EPS) with NORM, rounded, then with RESIDUAL residual + it in f32, rounded again.
    x [M, K], w [N, K], g [K] (any float dtype), residual [M, N], out [SPLITS, M, N] (f32 when SPLITS > 1), squares
    [SPLITS, M] f32; g and residual are not read without NORM / RESIDUAL. FMA: the product as f32 multiply-adds
    into a [BM, BK, BN] accumulator, summed over its BK lanes at the end (`Tiling.fma`)."""
    m, n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = (m * BM + tl.arange(0, BM)).to(tl.int64)
    rows_ok = rows < M
    cols = n * BN + tl.arange(0, BN)
    cols_ok = cols < N
    ks = tl.arange(0, BK)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), tl.float32)
    if FMA:
        lanes = tl.zeros((BM, BK, BN), tl.float32)
    squares = tl.zeros((BM,), tl.float32)
    steps: tl.constexpr = K // BK // SPLITS
    for step in tl.range(s * steps, (s + 1) * steps, num_stages=STAGES):     # staged for FMA too (no dot)
        k = step * BK + ks
        xk = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=rows_ok[:, None], other=0.0)
        if NORM:
            x32 = xk.to(tl.float32)
            squares += tl.sum(x32 * x32, axis=1)
            xk = (x32 * tl.load(g_ptr + k).to(tl.float32)[None, :]).to(dtype)
        wk = tl.load(w_ptr + cols[None, :] * K + k[:, None], mask=cols_ok[None, :], other=0.0)   # [BK, BN]
        if FMA:
            lanes += xk.to(tl.float32)[:, :, None] * wk.to(tl.float32)[None, :, :]
        elif IEEE:
            acc = tl.dot(xk, wk, acc, input_precision="ieee")
        else:
            acc = tl.dot(xk, wk, acc)
    if FMA:
        acc = tl.sum(lanes, axis=1)
    ok = rows_ok[:, None] & cols_ok[None, :]
    if SPLITS == 1:
        if NORM:
            acc = acc / tl.sqrt_rn(squares / K + EPS)[:, None]
        y = acc.to(out_ptr.dtype.element_ty)
        if RESIDUAL:
            r = tl.load(residual_ptr + rows[:, None] * N + cols[None, :], mask=ok, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], y, mask=ok)
    else:
        tl.store(out_ptr + (s * M + rows[:, None]) * N + cols[None, :], acc, mask=ok)
        if NORM and n == 0:
            tl.store(squares_ptr + s * M + rows, squares, mask=rows_ok)


@triton.jit
def _splits_kernel(part_ptr, squares_ptr, residual_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr,
                   N: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr,
                   RESIDUAL: tl.constexpr):
    """Program (row r, columns n): out[r, n's columns] = the partials part [SPLITS, M, N] added in split order
    (with NORM times rsqrt(the squares [SPLITS, M] added in split order / K + EPS)), rounded to out's dtype, then
    (RESIDUAL) residual[r] + that in f32, rounded again."""
    r, n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = n * BN + tl.arange(0, BN)
    ok = cols < N
    acc = tl.zeros((BN,), tl.float32)
    squares = 0.0
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + (s * M + r) * N + cols, mask=ok, other=0.0)
        if NORM:
            squares += tl.load(squares_ptr + s * M + r)
    if NORM:
        acc = acc / tl.sqrt_rn(squares / K + EPS)
    y = acc.to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        y = (tl.load(residual_ptr + r * N + cols, mask=ok, other=0.0).to(tl.float32) + y.to(tl.float32)).to(
            out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * N + cols, y, mask=ok)


def check_inputs(x, w, norm_weight, residual, out_dtype):
    """Raises ValueError naming the mismatch and the fix."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_matmul takes x [M, K] and w [N, K]; got x {x.shape}, w {w.shape}")
    if x.dtype not in FLOATS or w.dtype != x.dtype:
        raise ValueError(f"skinny_matmul takes x and w of one dtype, bfloat16 or float32; got {x.dtype}, {w.dtype}: "
                         "cast them first")
    if x.shape[0] == 0:
        raise ValueError("skinny_matmul: x has no rows; skip the call")
    if norm_weight is not None and (norm_weight.shape != (x.shape[1],) or norm_weight.dtype not in FLOATS):
        raise ValueError(f"skinny_matmul: norm_weight {norm_weight.shape} {norm_weight.dtype} must be [K] = "
                         f"[{x.shape[1]}], bfloat16 or float32")
    if residual is not None and (residual.shape != (x.shape[0], w.shape[0]) or residual.dtype not in FLOATS):
        raise ValueError(f"skinny_matmul: residual {residual.shape} {residual.dtype} must be [M, N] = "
                         f"[{x.shape[0]}, {w.shape[0]}], bfloat16 or float32")
    if jnp.dtype(out_dtype) not in FLOATS:
        raise ValueError(f"skinny_matmul writes bfloat16 or float32, not {out_dtype}")


def row_tile(m: int, tiling: Tiling) -> int:
    """Rows per program of the product kernel for M rows: BLOCK_M, or with fma next_pow2(M) up to BLOCK_M."""
    return min(triton.next_power_of_2(m), BLOCK_M) if tiling.fma else BLOCK_M


def run_kernels(call, x, w, *, norm_weight=None, eps: float = 1e-6, residual=None, out_dtype=None,
                tiling: Tiling | None = None):
    """The host side: check, then launch through `call(*operands, kernel=, out_shape=, grid=, num_warps=,
    num_stages=, **constexprs)` (`triton_call` on the GPU; Triton's interpreter in the tests): the product kernel
    alone without split-K, the splits kernel after it with. No padding, slicing or casting around them: one or two
    launches a product. Shapes as `skinny_matmul_reference`."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    check_inputs(x, w, norm_weight, residual, out_dtype)
    (m, k), n = x.shape, w.shape[0]
    tiling = tiling or default_tiling(k, n)
    norm, add = norm_weight is not None, residual is not None
    g = norm_weight if norm else x                      # unread without NORM / RESIDUAL: any operand will do
    r = residual if add else x
    split = tiling.splits > 1
    if tiling.fma and m > FMA_MAX_ROWS:
        raise ValueError(f"skinny_matmul: the fma tiling takes at most {FMA_MAX_ROWS} rows, got {m}; use a tiling "
                         "with fma=False")
    block_m = row_tile(m, tiling)
    part, squares = call(
        x, w, g, r, kernel=_product_kernel,
        out_shape=(jax.ShapeDtypeStruct((tiling.splits, m, n), jnp.float32 if split else out_dtype),
                   jax.ShapeDtypeStruct((tiling.splits, m), jnp.float32)),
        grid=(triton.cdiv(m, block_m), triton.cdiv(n, tiling.block_n), tiling.splits), num_warps=4, num_stages=STAGES,
        M=m, K=k, N=n, BM=block_m, BN=tiling.block_n, BK=tiling.block_k, SPLITS=tiling.splits, NORM=norm,
        RESIDUAL=add and not split, EPS=float(eps), IEEE=x.dtype == jnp.float32, FMA=tiling.fma, STAGES=STAGES)
    if not split:
        return part.reshape(m, n)
    return call(part, squares, r, kernel=_splits_kernel, out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
                grid=(m, triton.cdiv(n, 256)), num_warps=4, num_stages=1, M=m, K=k, N=n, BN=256,
                SPLITS=tiling.splits, NORM=norm, EPS=float(eps), RESIDUAL=add)


def skinny_matmul(x, w, *, norm_weight=None, eps: float = 1e-6, residual=None, out_dtype=None,
                  tiling: Tiling | None = None, launcher: str = LAUNCHER):
    """`skinny_matmul_reference` as Triton kernels on the GPU (shapes and fusions there). tiling: default
    `default_tiling(K, N)` (another tiling gives other rounding; the row invariance holds for any one tiling
    without fma)."""
    return _skinny_matmul(x, w, norm_weight, residual, eps=float(eps),
                          out_dtype=jnp.dtype(out_dtype or x.dtype), tiling=tiling, launcher=launcher)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "tiling", "launcher"))
def _skinny_matmul(x, w, norm_weight, residual, *, eps, out_dtype, tiling, launcher):
    call = bound_to(launcher, interpret=False, op="skinny_matmul.skinny_matmul",
                    reference="skinny_matmul.skinny_matmul_reference")
    return run_kernels(call, x, w, norm_weight=norm_weight, eps=eps, residual=residual, out_dtype=out_dtype,
                       tiling=tiling)
