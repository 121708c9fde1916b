"""The router_topk kernel runs on the CPU in Triton's interpreter, through the same host code as on the GPU
(`router_topk.run_kernel`), against the reference: Kimi K2.6's router (384 experts, top 8, normalised, scaled by
2.827), the code target's (16 experts, top 2), a k that is not a power of two and one without normalisation; ties
to the lower id; each id once when fewer than k experts can be chosen; a row's result bitwise the same alone; bad
inputs refused. Fresh random logits per case. Triton
must be in interpreter mode from its first import, so the test re-runs this file in a child process with
TRITON_INTERPRET=1."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err, in_triton_interpreter, interpreter_parent
from pallas_kernels import router_topk as RT

test_in_the_interpreter = interpreter_parent(__file__)


def _inputs(seed, m, e, levels=None):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((m, e)) * 2.0
    if levels:                                           # a few values only: many ties in score + bias
        logits = np.round(logits * levels) / levels
    bias = np.zeros(e) if levels else 0.3 * rng.standard_normal(e)
    return jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32)


@in_triton_interpreter
@pytest.mark.parametrize("m,e,k,normalize,scale", [(5, 384, 8, True, 2.827), (3, 16, 2, True, 1.0),
                                                   (7, 64, 6, True, 1.0), (4, 100, 3, False, 1.5)])
def test_the_kernel_matches_the_reference(m, e, k, normalize, scale):
    from triton_interpreter import interpreter_call

    logits, bias = _inputs(m * e + k, m, e)
    ids, weights = RT.run_kernel(interpreter_call, logits, bias, k, normalize=normalize, scale=scale)
    want_ids, want_weights = RT.router_topk_reference(logits, bias, k, normalize=normalize, scale=scale)
    assert ids.dtype == jnp.int32 and ids.shape == (m, k) and weights.shape == (m, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    assert rel_err(weights, want_weights) < 1e-6


@in_triton_interpreter
def test_ties_go_to_the_lower_id_and_a_row_does_not_depend_on_the_others():
    from triton_interpreter import interpreter_call

    logits, bias = _inputs(11, 9, 64, levels=2)
    ids, weights = RT.run_kernel(interpreter_call, logits, bias, 8)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(RT.router_topk_reference(logits, bias, 8)[0]))
    for r in (0, 8):
        alone_ids, alone_weights = RT.run_kernel(interpreter_call, logits[r:r + 1], bias, 8)
        np.testing.assert_array_equal(np.asarray(alone_ids[0]), np.asarray(ids[r]))
        np.testing.assert_array_equal(np.asarray(alone_weights[0]), np.asarray(weights[r]))


@in_triton_interpreter
def test_each_id_once_when_fewer_than_k_experts_can_be_chosen():
    """Only 3 experts with a finite score + bias for k = 8 (the rest -inf: ties) -> the same ids as lax.top_k, each
    once; a row of NaN logits -> k distinct ids in range."""
    from triton_interpreter import interpreter_call

    logits, _ = _inputs(5, 4, 32)
    bias = jnp.full((32,), -jnp.inf, jnp.float32).at[jnp.asarray([3, 17, 30])].set(0.0)
    ids, _ = RT.run_kernel(interpreter_call, logits, bias, 8)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(RT.router_topk_reference(logits, bias, 8)[0]))
    nan_ids, _ = RT.run_kernel(interpreter_call, logits.at[1].set(jnp.nan), jnp.zeros((32,), jnp.float32), 8)
    row = np.asarray(nan_ids[1])
    assert len(set(row.tolist())) == 8 and row.min() >= 0 and row.max() < 32


def test_bad_inputs_are_refused_with_the_fix_named():
    logits, bias = jnp.ones((2, 16), jnp.float32), jnp.zeros((16,), jnp.float32)
    with pytest.raises(ValueError, match=r"logits \[M, E\] and bias \[E\]"):
        RT.check_inputs(logits, bias[:8], 2)
    with pytest.raises(ValueError, match="cast them first"):
        RT.check_inputs(logits.astype(jnp.bfloat16), bias, 2)
    with pytest.raises(ValueError, match=r"\[1, E = 16\]"):
        RT.check_inputs(logits, bias, 17)
    with pytest.raises(ValueError, match="no rows"):
        RT.check_inputs(logits[:0], bias, 2)
