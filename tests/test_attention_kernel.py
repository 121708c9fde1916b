"""tree_verify_attention, the op: its pure-JAX reference == a float64 numpy loop, the choice of kernel per call
(`ops.attention_backend`), both kernels lowered inside the model's head-parallel shard_map, bad input. The kernels
against the reference: in Triton's interpreter (tests/test_attention_triton_interpreter.py), Mosaic GPU's interpret
mode (tests/test_tree_verify_attention_mgpu.py) and on the H200 (tests/test_kernels_gpu.py). Fresh random inputs per
test (seeded by the test's parameters, never zeros).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ops
from pallas_kernels.tree_verify_attention import AttentionConfig, tree_verify_attention_reference

from conftest import rel_err
from pallas_kernels.tree import random_tree_visible

SCALE = 0.125


def make_inputs(rng, streams, nodes, heads, lat, rope, capacity, dtype=jnp.float32, prefix=None):
    q_lat = rng.standard_normal((streams, nodes, heads, lat))
    q_rope = rng.standard_normal((streams, nodes, heads, rope))
    c_kv = rng.standard_normal((streams, capacity, lat))
    k_rope = rng.standard_normal((streams, capacity, rope))
    if prefix is None:   # ragged, including both ends of [0, N - T]
        prefix = rng.integers(0, capacity - nodes + 1, streams)
        prefix[0] = 0
        prefix[-1] = capacity - nodes
    arrays = [jnp.asarray(a, dtype) for a in (q_lat, q_rope, c_kv, k_rope)]
    return (*arrays, jnp.asarray(prefix, jnp.int32), jnp.asarray(random_tree_visible(rng, streams, nodes)))


def numpy_attention(q_lat, q_rope, c_kv, k_rope, prefix_len, visible):
    """Independent float64 loop over streams and nodes."""
    q_lat, q_rope, c_kv, k_rope = (np.asarray(a, np.float64) for a in (q_lat, q_rope, c_kv, k_rope))
    s_n, t_n, h_n, c = q_lat.shape
    out = np.zeros((s_n, t_n, h_n, c))
    for s in range(s_n):
        p = int(prefix_len[s])
        for t in range(t_n):
            rows = list(range(p)) + [p + u for u in range(t_n) if visible[s, t, u]]
            if not rows:
                continue
            logits = SCALE * (q_lat[s, t] @ c_kv[s, rows].T + q_rope[s, t] @ k_rope[s, rows].T)   # [H, rows]
            prob = np.exp(logits - logits.max(-1, keepdims=True))
            out[s, t] = (prob / prob.sum(-1, keepdims=True)) @ c_kv[s, rows]
    return out


def test_reference_matches_numpy_loop():
    rng = np.random.default_rng(7)
    inputs = make_inputs(rng, streams=2, nodes=6, heads=3, lat=16, rope=8, capacity=30)
    ref = tree_verify_attention_reference(*inputs, scale=SCALE)
    assert rel_err(ref, numpy_attention(*inputs)) < 1e-5


# bf16 kernel output against the reference's (f32 softmax, rounded to bf16), per stream (tests/test_kernels_gpu.py).
# The two round the attention weights to bf16 at different points (the kernels before normalising), so they differ
# by about the bf16 precision: 1.4e-3 to 3.0e-3 on the H200.
BF16_TOL = 5e-3


def prefill_masks(streams_valid=(8, 5), nodes=8):
    """Ragged prefill's visible [S, T, T]: causal & valid (the padding rows of a short stream see nothing)."""
    valid_rows = np.arange(nodes)[None, :] < np.asarray(streams_valid)[:, None]                     # [S, T]
    return jnp.asarray(np.tril(np.ones((nodes, nodes), bool))[None] & valid_rows[:, None, :] & valid_rows[:, :, None])


def test_fully_masked_rows():
    """Ragged prefill: prefix 0, causal & valid. Padding rows see nothing and must return 0, not NaN; a masked row of
    a stream with a prefix still attends to the prefix."""
    rng = np.random.default_rng(21)
    q_lat, q_rope, c_kv, k_rope, _, _ = make_inputs(rng, streams=2, nodes=8, heads=2, lat=32, rope=16, capacity=40)
    for prefix in ([0, 0], [0, 12]):
        args = (q_lat, q_rope, c_kv, k_rope, jnp.asarray(prefix, jnp.int32), prefill_masks())
        ref = np.asarray(tree_verify_attention_reference(*args, scale=SCALE))
        assert np.isfinite(ref).all()
        assert rel_err(ref, numpy_attention(*args)) < 1e-5
        padding = np.abs(ref[1, 5:]).max()
        assert (padding == 0) if prefix[1] == 0 else (padding > 0)


def test_ops_dispatch():
    rng = np.random.default_rng(5)
    inputs = make_inputs(rng, streams=2, nodes=3, heads=2, lat=32, rope=16, capacity=24)
    ref = tree_verify_attention_reference(*inputs, scale=SCALE)
    with ops.implementation("kernel", interpret=True):
        assert ops.uses_kernel()
        out = ops.tree_verify_attention(*inputs, scale=SCALE)
    with ops.implementation("reference"):
        assert not ops.uses_kernel()
        assert rel_err(ops.tree_verify_attention(*inputs, scale=SCALE), ref) == 0
    assert not ops.uses_kernel()   # auto on the CPU
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="implementation"):
        ops.set_implementation("fast")


def k2_operands(streams, nodes, heads, capacity, dtype=jnp.bfloat16, lat=512, rope=64):
    """Abstract operands of one call (nothing allocated)."""
    spec = jax.ShapeDtypeStruct
    return (spec((streams, nodes, heads, lat), dtype), spec((streams, nodes, heads, rope), dtype),
            spec((streams, capacity, lat), dtype), spec((streams, capacity, rope), dtype))


@pytest.mark.parametrize("nodes,heads,capacity,dtype,lat,backend", [
    (1, 64, 4096, jnp.bfloat16, 512, "mosaic_gpu"),     # 64 rows: one whole tile
    (16, 8, 4160, jnp.bfloat16, 512, "mosaic_gpu"),
    (1, 8, 4096, jnp.bfloat16, 512, "triton"),          # 8 rows: a 64-row tile would be 7/8 padding
    (16, 8, 4097, jnp.bfloat16, 512, "triton"),         # cache not in whole 64-row blocks
    (16, 8, 4096, jnp.float32, 512, "triton"),          # f32: Mosaic GPU's wgmma takes bf16 here
    (16, 8, 4096, jnp.bfloat16, 64, "triton"),          # not the K2.x latent width
])
def test_attention_backend(nodes, heads, capacity, dtype, lat, backend):
    assert ops.attention_backend(*k2_operands(2, nodes, heads, capacity, dtype, lat)) == backend


def test_both_attention_kernels_lower_under_head_parallel():
    """ops.tree_verify_attention inside the model's head-parallel shard_map (tp=2, check_vma on), lowered for an
    abstract H200 mesh: 8 query rows per device go to the Triton kernel (XLA's Triton custom call), 16 x 8 to the
    Mosaic GPU kernel (its custom call); with split-K both add the Triton combine kernel. The same with the forward's
    plan made outside the shard_map (`attention_plan`: each device's 8 heads), also with the streams split over data
    (2 x 2 devices: the plan's bias is split like prefix_len)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from kdtree_jax.model.parallel import attention_plan, head_parallel
    from pallas_kernels import tree_verify_attention as A
    from pallas_kernels import tree_verify_attention_mgpu as AM
    from triton_h200 import h200_mesh, lower_for_h200

    attention = functools.partial(ops.tree_verify_attention, scale=0.07)
    capacity = 4096 + 64
    cases = [((1, 2), 1, False), ((1, 2), 1, True), ((1, 2), 16, False), ((1, 2), 16, True), ((2, 2), 16, True)]
    for shape, nodes, planned in cases:
        mesh = h200_mesh(shape, ("data", "tp"))
        mosaic = int(nodes == 16)
        splits = (AM.default_num_splits(2 // shape[0], 16 * 8, capacity) if mosaic
                  else A.default_config(2, 8, capacity).num_splits)
        arrays = k2_operands(2, nodes, 16, capacity) + (jax.ShapeDtypeStruct((2,), jnp.int32),
                                                       jax.ShapeDtypeStruct((2, nodes, nodes), jnp.bool_))
        streams = "data" if shape[0] > 1 else None
        parts = [P(streams, None, "tp", None)] * 2 + [P(streams)] * 4
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, part))
                for a, part in zip(arrays, parts)]

        def fn(*a):
            plan = attention_plan(a[4], a[5], 16) if planned else None
            assert not planned or plan.num_heads == 8 and (plan.frame_bias is not None) == bool(mosaic)
            return head_parallel(attention, *a, plan)

        with ops.implementation("kernel", interpret=False):
            text = lower_for_h200(fn, *args, mesh=mesh)
        assert text.count("custom_call @mosaic_gpu_v2") == mosaic, (shape, nodes)
        assert text.count("custom_call @__gpu$xla.gpu.triton") == 1 - mosaic + (splits > 1), (shape, nodes, splits)
        if shape[0] == 2:   # one stream per data shard, in the kernel's operands and in the plan's bias
            assert "tensor<1x16x8x512xbf16>" in text and f"tensor<1x128x{AM.frame_width(nodes)}xf32>" in text


def test_bad_shapes_raise():
    rng = np.random.default_rng(3)
    q_lat, q_rope, c_kv, k_rope, prefix, visible = make_inputs(rng, 2, 3, 2, 32, 16, 24)
    with pytest.raises(ValueError, match="visible"):
        tree_verify_attention_reference(q_lat, q_rope, c_kv, k_rope, prefix, visible[:, :2], scale=SCALE)
    with pytest.raises(ValueError, match="c_kv"), ops.implementation("kernel", interpret=True):
        ops.tree_verify_attention(q_lat, q_rope, c_kv[..., :16], k_rope, prefix, visible, scale=SCALE)
    with pytest.raises(ValueError, match="power of two"):
        AttentionConfig(block_q=24)
    plan = ops.tree_verify_plan(prefix, visible[:, :2, :2], num_heads=2)     # another tree: T = 2, the call's 3
    with pytest.raises(ValueError, match=r"built for num_heads=2 and T=2 tree nodes, the call has H=2 heads and T=3"):
        ops.tree_verify_attention(q_lat, q_rope, c_kv, k_rope, prefix, visible, plan, scale=SCALE)
    with pytest.raises(TypeError, match="plan must be a TreeVerifyPlan"):
        ops.tree_verify_attention(q_lat, q_rope, c_kv, k_rope, prefix, visible, True, scale=SCALE)
