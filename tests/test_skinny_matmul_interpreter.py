"""The skinny_matmul kernels run on the CPU in Triton's interpreter, through the same host code as on the GPU
(`skinny_matmul.run_kernels`), against the reference; outputs start as NaN, so finite results prove every element was
written. f32 only: the interpreter misreads bf16 operands (bf16 runs in tests/test_kernels_gpu.py). Fresh random
inputs per case (never zeros); shapes off the tiles (N not a multiple of the column block, M
past one 16-row tile); with and without the RMSNorm prologue, the residual epilogue and split-K. Row invariance: a
row's result is bitwise the same among other rows and at another M, at its place in the tile. Triton must be in
interpreter mode from its first import, so the test re-runs this file in a child process with TRITON_INTERPRET=1."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err, in_triton_interpreter, interpreter_parent
from pallas_kernels import skinny_matmul as SM

test_in_the_interpreter = interpreter_parent(__file__)


def _inputs(seed, m, k, n, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k)) * k ** -0.5, dtype)
    g = jnp.asarray(1.0 + 0.1 * rng.standard_normal(k), dtype)
    residual = jnp.asarray(rng.standard_normal((m, n)), dtype)
    return x, w, g, residual


@in_triton_interpreter
@pytest.mark.parametrize("m,k,n,norm,residual,tiling", [
    (1, 256, 96, False, False, None),                    # N off the 64-column block
    (5, 512, 200, True, False, None),
    (20, 256, 130, True, True, None),                    # two row tiles
    (3, 512, 64, False, True, SM.Tiling(64, 128, 4)),     # split-K, residual in the splits kernel
    (17, 384, 100, True, True, SM.Tiling(64, 128, 3)),
    (9, 512, 96, False, False, SM.Tiling(64, 64, 2)),    # 64-deep steps
    (4, 256, 96, True, False, SM.Tiling(64, 128, 1)),    # no split: the product kernel writes the output
    (6, 256, 70, True, True, SM.Tiling(64, 128, 1)),     # no split: the norm and the residual in the one kernel
    (1, 256, 96, True, True, SM.Tiling(64, 32, 1, fma=True)),    # multiply-adds on the CUDA cores, one row
    (3, 512, 100, True, True, SM.Tiling(64, 32, 4, fma=True)),   # ... a 4-row tile, split-K
    (8, 256, 64, False, False, SM.default_tiling(256, 64, fma=True)),
])
def test_kernels_match_the_reference(m, k, n, norm, residual, tiling):
    from triton_interpreter import interpreter_call

    x, w, g, res = _inputs(m * k + n, m, k, n, jnp.float32)
    kw = dict(norm_weight=g if norm else None, residual=res if residual else None, eps=1e-6)
    got = SM.run_kernels(interpreter_call, x, w, tiling=tiling, **kw)
    want = SM.skinny_matmul_reference(x, w, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.isfinite(np.asarray(got)).all()
    assert rel_err(got, want) < 1e-5


@in_triton_interpreter
@pytest.mark.parametrize("tiling", [None, SM.Tiling(64, 128, 2)])
def test_a_rows_result_does_not_depend_on_the_other_rows(tiling):
    """Row r of 37 == the same row at the same place in its 16-row tile (r % 16) of a smaller batch whose other rows
    are fresh random ones: neither M nor the other rows' values reach it. The place is kept because the interpreter's
    tl.dot is numpy's BLAS, whose result for a row can depend on the row's place in the tile (1-ulp differences on
    the CI machine's CPU); bitwise invariance across places is the GPU's, checked in test_kernels_gpu.py."""
    from triton_interpreter import interpreter_call

    x, w, g, res = _inputs(7, 37, 256, 96, jnp.float32)
    batch = SM.run_kernels(interpreter_call, x, w, norm_weight=g, residual=res, tiling=tiling)
    for r in (0, 15, 16, 36):
        place = r % SM.BLOCK_M
        others, _, _, others_res = _inputs(100 + r, place + 1, 256, 96, jnp.float32)
        xs = others.at[place].set(x[r])
        small = SM.run_kernels(interpreter_call, xs, w, norm_weight=g, residual=others_res.at[place].set(res[r]),
                               tiling=tiling)
        np.testing.assert_array_equal(np.asarray(small[place]), np.asarray(batch[r]))


def test_the_tiling_is_a_function_of_the_weight_alone():
    """K2.6's tp=8 share: every split covers whole steps of K, and programs x splits stay within the target; K in
    fewer than MIN_SPLIT_STEPS steps (the code target's products, the share's shared-expert down) is not split."""
    for k, n in [(7168, 1536), (7168, 576), (1536, 8 * 192), (1024, 7168), (7168, 256), (256, 7168), (7168, 384),
                 (7168, 20480), (512, 1024)]:
        t = SM.default_tiling(k, n)
        assert (k // t.block_k) % t.splits == 0
        assert t.splits == 1 or -(-n // t.block_n) * t.splits <= SM.TARGET_PROGRAMS
    assert SM.default_tiling(7168, 576).splits > 1                     # kv_a: 9 column blocks alone
    assert [SM.default_tiling(k, n).splits for k, n in [(256, 7168), (256, 4096), (768, 256)]] == [1, 1, 1]
    assert SM.default_tiling(128 * SM.MIN_SPLIT_STEPS, 256).splits > 1
    with pytest.raises(ValueError, match="multiple of 64"):
        SM.default_tiling(100, 64)


def test_bad_inputs_are_refused_with_the_fix_named():
    x = jnp.ones((2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        SM.check_inputs(x, jnp.ones((8, 64), jnp.bfloat16), None, None, jnp.bfloat16)
    with pytest.raises(ValueError, match="cast them first"):
        SM.check_inputs(x, jnp.ones((8, 128), jnp.float32), None, None, jnp.bfloat16)
    with pytest.raises(ValueError, match="norm_weight"):
        SM.check_inputs(x, jnp.ones((8, 128), jnp.bfloat16), jnp.ones(64), None, jnp.bfloat16)
    with pytest.raises(ValueError, match="residual"):
        SM.check_inputs(x, jnp.ones((8, 128), jnp.bfloat16), None, jnp.ones((2, 9)), jnp.bfloat16)
    with pytest.raises(ValueError, match="at most 8 rows"):
        SM.run_kernels(None, jnp.ones((9, 128), jnp.float32), jnp.ones((8, 128), jnp.float32),
                       tiling=SM.Tiling(64, 32, 1, fma=True))
