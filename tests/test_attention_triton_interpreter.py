"""The Triton tree-verify attention kernel (pallas_kernels/tree_verify_attention_triton.py) on the CPU: run in Triton's
interpreter through the same host code as on the GPU (`run_attention`), f32, against the pure-JAX reference and the
float64 numpy loop (its sm_90 compile: tests/test_tree_verify_attention_triton.py).

Outputs start as NaN in the interpreter, so a finite result proves every element (and, with splits, every partial
row) was written. Shapes: ragged prefixes including 0 and N - T, dims that are not powers of two (padded inside the
kernel), split-K with more splits than blocks, random ancestor masks. Triton must be in interpreter mode from its
first import, so the interpreter cases re-run this file in a child process with TRITON_INTERPRET=1.
"""

import numpy as np
import pytest

from conftest import in_triton_interpreter, interpreter_parent

SCALE = 0.125

test_in_the_interpreter = interpreter_parent(__file__)


@in_triton_interpreter
@pytest.mark.parametrize("nodes,heads,lat,rope,capacity,block_q,num_splits", [
    (1, 4, 32, 8, 80, 16, 1),
    (5, 4, 32, 8, 80, 16, 3),
    (16, 4, 32, 8, 80, 32, 1),
    (3, 3, 24, 6, 70, 16, 2),       # C, R and T * H not powers of two
    (2, 8, 32, 8, 40, 16, 8),       # more splits than prefix blocks
    (20, 1, 32, 8, 60, 16, 2),      # a tree block over two cache blocks
])
def test_kernel_matches_the_reference(nodes, heads, lat, rope, capacity, block_q, num_splits):
    from conftest import rel_err
    from pallas_kernels import tree_verify_attention as A
    from pallas_kernels import tree_verify_attention_triton as AT
    from test_attention_kernel import make_inputs, numpy_attention
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(nodes * 100 + lat + num_splits)
    inputs = make_inputs(rng, streams=3, nodes=nodes, heads=heads, lat=lat, rope=rope, capacity=capacity)
    config = A.AttentionConfig(block_q=block_q, block_k=16, num_splits=num_splits)
    out = AT.run_attention(interpreter_call, *inputs, SCALE, config)
    assert out.shape == inputs[0].shape and np.isfinite(np.asarray(out)).all()
    assert rel_err(out, A.tree_verify_attention_reference(*inputs, scale=SCALE)) < 1e-5
    assert rel_err(out, numpy_attention(*inputs)) < 1e-5


@in_triton_interpreter
@pytest.mark.parametrize("num_splits", [1, 2])
def test_fully_masked_rows(num_splits):
    """Ragged prefill (prefix 0, causal & valid): padding rows see nothing and return 0, not NaN; with a prefix they
    attend to it."""
    from conftest import rel_err
    from pallas_kernels import tree_verify_attention as A
    from pallas_kernels import tree_verify_attention_triton as AT
    from test_attention_kernel import make_inputs, prefill_masks
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(21 + num_splits)
    q_lat, q_rope, c_kv, k_rope, _, _ = make_inputs(rng, streams=2, nodes=8, heads=2, lat=32, rope=16, capacity=40)
    config = A.AttentionConfig(block_q=16, block_k=16, num_splits=num_splits)
    for prefix in ([0, 0], [0, 12]):
        args = (q_lat, q_rope, c_kv, k_rope, np.asarray(prefix, np.int32), prefill_masks())
        out = np.asarray(AT.run_attention(interpreter_call, *args, SCALE, config))
        assert np.isfinite(out).all()
        assert rel_err(out, A.tree_verify_attention_reference(*args, scale=SCALE)) < 1e-5
        padding = np.abs(out[1, 5:]).max()
        assert (padding == 0) if prefix[1] == 0 else (padding > 0)


@in_triton_interpreter
@pytest.mark.parametrize("normalized,empty_max,splits,block", [(False, -1e30, 5, None), (True, float("-inf"), 5, None),
                                                              (False, -1e30, 37, (8, 4, 16)),
                                                              (True, float("-inf"), 300, (64, 16, 8))])
def test_combine_kernel_matches_the_xla_combine(normalized, empty_max, splits, block):
    """The split-K combine kernel on both kernels' partial formats (the Triton kernel's unnormalised f32 with a
    finite max for an empty split, the Mosaic GPU one's normalised with -inf): 5 splits at `tiling`'s block, and 37
    in steps of 8 with a partial last one over tiles of 4 rows and 16 columns that the kept rows and columns end
    within, 300 in two steps of the first pass (256 splits of 16 rows) and five of the second, some splits empty for
    some rows and one row empty in every split (its output 0), fewer rows and columns kept than the partials hold."""
    from conftest import rel_err
    from pallas_kernels import tree_verify_attention as A
    from pallas_kernels import tree_verify_attention_combine as AC
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(3 + normalized)
    streams, part_rows, rows, part_cols, cols = 2, 24, 19, 48, 40
    out = rng.standard_normal((splits, streams, part_rows, part_cols)).astype(np.float32)
    row_max = rng.standard_normal((splits, streams, part_rows)).astype(np.float32) * 3
    row_sum = rng.uniform(0.5, 4.0, (splits, streams, part_rows)).astype(np.float32)
    empty = rng.random((splits, streams, part_rows)) < 0.3
    empty[:, 1, 7] = True
    row_max[empty], row_sum[empty], out[empty] = empty_max, 0.0, 0.0
    got = AC.combine(interpreter_call, out, row_max, row_sum, rows=rows, cols=cols, dtype=np.float32,
                     normalized=normalized, block=block)
    want = A.combine_partials(out, row_max, row_sum, normalized=normalized)[:, :rows, :cols]
    assert got.shape == (streams, rows, cols) and np.isfinite(np.asarray(got)).all()
    assert rel_err(got, want) < 1e-6 and not np.asarray(got)[1, 7].any()
