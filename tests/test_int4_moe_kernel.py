"""int4_moe: Pallas kernel (interpret mode) == pure-JAX reference == float64 numpy from the compressed-tensors layout.

Interpret mode fills every kernel output with NaN before the kernel runs, so a finite result means every element that
reaches the output was written. Fresh random inputs per test (seeded by the test's parameters, never zeros).
"""
import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels import int4_layout
from pallas_kernels import ops
from pallas_kernels.int4_moe import Int4Experts, MoeConfig, int4_moe, int4_moe_reference
from conftest import rel_err

# One shape family for most tests, so that the interpret-mode kernels compile once per token count.
EXPERTS, HIDDEN, INTER, TOP_K = 8, 64, 96, 4




def compressed_tensors_experts(rng, experts, hidden, inter):
    """Random INT4 experts in the stacked compressed-tensors layout: gate, up [E, I, D]; down [E, D, I]."""
    arrays = []
    for shape in ((experts, inter, hidden), (experts, inter, hidden), (experts, hidden, inter)):
        q, scale = int4_layout.quantize_int4(rng.standard_normal(shape))
        arrays += [jnp.asarray(int4_layout.pack_int4(q)), jnp.asarray(scale, jnp.bfloat16)]
    return arrays


def routing(rng, tokens, top_k, experts):
    """ids with out-of-range entries (other devices' experts) and repeated experts within a token."""
    ids = rng.integers(0, experts, (tokens, top_k))
    ids[rng.random((tokens, top_k)) < 0.15] = -1
    ids[rng.random((tokens, top_k)) < 0.15] = experts + 3
    if top_k > 1:
        ids[:, 1] = np.where(rng.random(tokens) < 0.3, ids[:, 0], ids[:, 1])
    return jnp.asarray(ids, jnp.int32), jnp.asarray(rng.random((tokens, top_k)), jnp.float32)


def numpy_moe(x, ct, ids, weights):
    """Independent float64 loop, dequantizing with pallas_kernels.int4_layout from the compressed-tensors layout."""
    gate, up, down = (np.asarray(int4_layout.dequantize_int4(ct[2 * k], ct[2 * k + 1], dtype=jnp.float32), np.float64)
                      for k in range(3))
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for m in range(x.shape[0]):
        for e, w in zip(np.asarray(ids[m]), np.asarray(weights[m])):
            if 0 <= e < gate.shape[0]:
                g, u = gate[e] @ x[m], up[e] @ x[m]
                out[m] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def test_repack_round_trip():
    """Int4Experts' layout dequantizes to exactly what compressed-tensors holds (padding of D, I to 256 included)."""
    rng = np.random.default_rng(1)
    ct = compressed_tensors_experts(rng, experts=3, hidden=96, inter=288)
    experts = Int4Experts.from_compressed_tensors(*ct)
    assert (experts.num_experts, experts.hidden_size, experts.intermediate_size) == (3, 96, 288)
    for got, k in zip(experts.dequantize(), range(3)):
        want = int4_layout.dequantize_int4(ct[2 * k], ct[2 * k + 1], dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_kernel_matches_reference(tokens):
    rng = np.random.default_rng(tokens)
    ct = compressed_tensors_experts(rng, EXPERTS, HIDDEN, INTER)
    experts = Int4Experts.from_compressed_tensors(*ct)
    x = jnp.asarray(rng.standard_normal((tokens, HIDDEN)), jnp.float32)
    ids, weights = routing(rng, tokens, TOP_K, EXPERTS)
    out = int4_moe(x, experts, ids, weights, interpret=True)
    ref = int4_moe_reference(x, experts, ids, weights)
    assert out.shape == ref.shape == x.shape
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, ref) < 1e-5
    assert rel_err(ref, numpy_moe(x, ct, ids, weights)) < 1e-5


def test_large_blocks_bf16():
    """Blocks of 64 pairs (the dense-GEMM tiling) with 256-wide input blocks, bf16 activations."""
    rng = np.random.default_rng(9)
    ct = compressed_tensors_experts(rng, experts=4, hidden=256, inter=256)
    experts = Int4Experts.from_compressed_tensors(*ct)
    x = jnp.asarray(rng.standard_normal((24, 256)), jnp.bfloat16)
    ids, weights = routing(rng, 24, top_k=2, experts=4)
    config = MoeConfig(block_m=64, block_n=128, num_warps=8)
    out = int4_moe(x, experts, ids, weights, config=config, interpret=True)
    ref = int4_moe_reference(x, experts, ids, weights)
    assert out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("block_m", [1, 4])
def test_cuda_core_variant_matches_reference(block_m):
    """use_mma=False: each group's product as multiplies and a sum, blocks of 1 or 4 pairs."""
    rng = np.random.default_rng(20 + block_m)
    ct = compressed_tensors_experts(rng, EXPERTS, HIDDEN, INTER)
    experts = Int4Experts.from_compressed_tensors(*ct)
    x = jnp.asarray(rng.standard_normal((7, HIDDEN)), jnp.float32)
    ids, weights = routing(rng, 7, TOP_K, EXPERTS)
    config = MoeConfig(block_m=block_m, block_n=32, use_mma=False)
    out = int4_moe(x, experts, ids, weights, config=config, interpret=True)
    assert rel_err(out, numpy_moe(x, ct, ids, weights)) < 1e-5


def test_config_errors():
    for bad in (dict(block_m=8), dict(block_m=32, use_mma=False), dict(block_m=3, use_mma=False),
                dict(block_n=8)):
        with pytest.raises(ValueError, match="MoeConfig"):
            MoeConfig(**bad)


def test_no_valid_expert_gives_zeros():
    rng = np.random.default_rng(4)
    experts = Int4Experts.from_compressed_tensors(*compressed_tensors_experts(rng, EXPERTS, HIDDEN, INTER))
    x = jnp.asarray(rng.standard_normal((7, HIDDEN)), jnp.float32)
    ids = jnp.asarray(rng.choice([-5, -1, EXPERTS, EXPERTS + 9], (7, TOP_K)), jnp.int32)
    weights = jnp.asarray(rng.random((7, TOP_K)), jnp.float32)
    out = np.asarray(int4_moe(x, experts, ids, weights, interpret=True))
    np.testing.assert_array_equal(out, np.zeros_like(out))


def test_ops_dispatch_and_bad_shapes():
    rng = np.random.default_rng(2)
    experts = Int4Experts.from_compressed_tensors(*compressed_tensors_experts(rng, EXPERTS, HIDDEN, INTER))
    x = jnp.asarray(rng.standard_normal((7, HIDDEN)), jnp.float32)
    ids, weights = routing(rng, 7, TOP_K, EXPERTS)
    ref = int4_moe_reference(x, experts, ids, weights)
    with ops.implementation("kernel", interpret=True):
        assert rel_err(ops.int4_moe(x, experts, ids, weights), ref) < 1e-5
    with pytest.raises(ValueError, match="topk_weights"):
        int4_moe(x, experts, ids, weights[:, :1], interpret=True)
    with pytest.raises(ValueError, match="down_scale"):
        ct = compressed_tensors_experts(rng, experts=2, hidden=32, inter=64)
        Int4Experts.from_compressed_tensors(*ct[:5], ct[5][:, :, :1])
