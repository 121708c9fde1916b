"""int4_moe on the CPU: the repacked layout, the pure-JAX reference against a float64 numpy loop over the
compressed-tensors layout, and the routing of pairs into blocks that the GPU kernel consumes (emulated block by block
in numpy). The Triton kernel itself is compiled for sm_90 here (test_int4_moe_triton.py) and run on the H200
(test_kernels_gpu.py). Fresh random inputs per test (seeded by the test's parameters, never zeros).
"""
import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels import int4_layout
from pallas_kernels import ops
from pallas_kernels import int4_moe as moe
from pallas_kernels.int4_moe import Int4Experts, int4_moe_reference, route_pairs
from conftest import rel_err

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


def test_positions_meet_inputs_permuted_the_same_way():
    """The Mosaic GPU kernels' view of the same words: int4_positions (a bitcast) times position_scales, against
    inputs_to_positions(x), is the layer in input order, padding of D, I to 256 included; the nibbles are two's
    complement (q, not q + 8)."""
    rng = np.random.default_rng(2)
    ct = compressed_tensors_experts(rng, experts=2, hidden=96, inter=512)
    experts = Int4Experts.from_compressed_tensors(*ct)
    words = np.asarray(experts.gate_packed).view(np.uint32)
    q = np.asarray(int4_layout.unpack_int4(ct[0]))                                       # [E, I, D]
    assert (words[0, 0, 0] & 0xF) == (q[0, 0, 0] & 0xF)                                 # input 0: word 0, nibble 0
    for packed, scale, in_dim in ((experts.gate_packed, experts.gate_scale, 96),
                                  (experts.down_packed, experts.down_scale, 512)):
        w = moe.int4_positions(packed)
        assert w.dtype == jnp.int4 and w.shape[2] == -(-in_dim // 256) * 256
        x = rng.standard_normal((3, in_dim)).astype(np.float32)
        got = jnp.einsum("eok,mk->emo", w.astype(jnp.float32) * moe.position_scales(scale),
                         moe.inputs_to_positions(jnp.asarray(x)), precision="highest")
        want = jnp.einsum("eok,mk->emo", moe.dequantize_kernel_layout(packed, scale, in_dim), x, precision="highest")
        assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_reference_matches_float64_numpy(tokens):
    rng = np.random.default_rng(tokens)
    ct = compressed_tensors_experts(rng, EXPERTS, HIDDEN, INTER)
    x = jnp.asarray(rng.standard_normal((tokens, HIDDEN)), jnp.float32)
    ids, weights = routing(rng, tokens, TOP_K, EXPERTS)
    ref = int4_moe_reference(x, Int4Experts.from_compressed_tensors(*ct), ids, weights)
    assert ref.shape == x.shape and ref.dtype == x.dtype
    assert rel_err(ref, numpy_moe(x, ct, ids, weights)) < 1e-5


@pytest.mark.parametrize("tokens,block_m", [(1, 16), (7, 16), (64, 16), (64, 32), (200, 128)])
def test_routed_blocks_computed_one_by_one_give_the_op(tokens, block_m):
    """What the kernels do with `route_pairs`, in numpy: each block is one expert's MLP on its rows' tokens, scaled by
    their weights, written at its rows; each token sums its pairs' rows (`pair_row`, where `pair_ok`). Every pair on
    this device lands in exactly one row; padding rows and blocks past the last carry token M and weight 0;
    `expert_pairs` counts each expert's pairs."""
    rng = np.random.default_rng(tokens + block_m)
    ct = compressed_tensors_experts(rng, EXPERTS, HIDDEN, INTER)
    gate, up, down = (np.asarray(int4_layout.dequantize_int4(ct[2 * k], ct[2 * k + 1], dtype=jnp.float32), np.float64)
                      for k in range(3))
    x = np.asarray(rng.standard_normal((tokens, HIDDEN)))
    ids, weights = routing(rng, tokens, TOP_K, EXPERTS)
    r = route_pairs(ids, weights, EXPERTS, block_m)
    block_expert, block_token, block_weight = map(np.asarray, (r.block_expert, r.block_token, r.block_weight))
    pair_row, pair_ok = np.asarray(r.pair_row), np.asarray(r.pair_ok)
    ids_np = np.asarray(ids).reshape(-1)
    np.testing.assert_array_equal(pair_ok, (ids_np >= 0) & (ids_np < EXPERTS))
    rows = block_token.reshape(-1)
    assert sorted(pair_row[pair_ok]) == sorted(np.flatnonzero(rows < tokens))       # one row per local pair
    np.testing.assert_array_equal(rows[pair_row[pair_ok]], np.flatnonzero(pair_ok) // TOP_K)
    np.testing.assert_array_equal(np.repeat(block_expert, block_m)[pair_row[pair_ok]], ids_np[pair_ok])
    assert not block_weight.reshape(-1)[rows == tokens].any()
    np.testing.assert_array_equal(r.expert_pairs, np.bincount(ids_np[pair_ok], minlength=EXPERTS))
    y = np.zeros((rows.size, HIDDEN))
    for b, e in enumerate(block_expert):
        for j in range(block_m):
            t = block_token[b, j]
            if e < EXPERTS and t < tokens:
                g, u = gate[e] @ x[t], up[e] @ x[t]
                y[b * block_m + j] = block_weight[b, j] * (down[e] @ (g / (1 + np.exp(-g)) * u))
    out = np.zeros_like(x)
    for p in np.flatnonzero(pair_ok):
        out[p // TOP_K] += y[pair_row[p]]
    np.testing.assert_allclose(out, numpy_moe(x, ct, ids, weights), rtol=1e-9, atol=1e-9)


def test_no_valid_expert_gives_zeros():
    rng = np.random.default_rng(4)
    experts = Int4Experts.from_compressed_tensors(*compressed_tensors_experts(rng, EXPERTS, HIDDEN, INTER))
    x = jnp.asarray(rng.standard_normal((7, HIDDEN)), jnp.float32)
    ids = jnp.asarray(rng.choice([-5, -1, EXPERTS, EXPERTS + 9], (7, TOP_K)), jnp.int32)
    weights = jnp.asarray(rng.random((7, TOP_K)), jnp.float32)
    out = np.asarray(int4_moe_reference(x, experts, ids, weights))
    np.testing.assert_array_equal(out, np.zeros_like(out))


def test_ops_off_the_gpu_and_bad_shapes():
    rng = np.random.default_rng(2)
    experts = Int4Experts.from_compressed_tensors(*compressed_tensors_experts(rng, EXPERTS, HIDDEN, INTER))
    x = jnp.asarray(rng.standard_normal((7, HIDDEN)), jnp.float32)
    ids, weights = routing(rng, 7, TOP_K, EXPERTS)
    ref = np.asarray(int4_moe_reference(x, experts, ids, weights))
    with ops.implementation("kernel", interpret=True):   # the Triton kernel has no interpret mode: the reference
        np.testing.assert_array_equal(np.asarray(ops.int4_moe(x, experts, ids, weights)), ref)
    with pytest.raises(ValueError, match="topk_weights"):
        ops.int4_moe(x, experts, ids, weights[:, :1])
    with pytest.raises(ValueError, match="down_scale"):
        ct = compressed_tensors_experts(rng, experts=2, hidden=32, inter=64)
        Int4Experts.from_compressed_tensors(*ct[:5], ct[5][:, :, :1])
