"""The exact mode's Triton kernels (pallas_kernels/batch_invariant_triton.py) on the CPU, in Triton's interpreter through
the same host code as on the GPU (`run_attention`, `run_expert_tiles`), f32, against the references of
`batch_invariant` and float64 numpy loops. Outputs start as NaN, so finite results prove every element that is read
was written. A tree node's attention is bitwise its AR step's at the same position (the keys of its path committed
to the cache, one node, another prefix). Fresh random inputs per case; shapes off the tiles (heads, widths, experts'
dims not powers of two; trees deeper than a key step; ids outside the local experts). Triton must be in interpreter
mode from its first import, so the cases re-run this file in a child process with TRITON_INTERPRET=1."""

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err, in_triton_interpreter, interpreter_parent
from pallas_kernels import batch_invariant as BI
from pallas_kernels import batch_invariant_triton as BT
from pallas_kernels import exact_layout as L
from pallas_kernels.int4_moe import route_pairs

SCALE = 0.125

test_in_the_interpreter = interpreter_parent(__file__)


def ar_step_of(inputs, stream: int, node: int):
    """The AR step that computes tree node `node` of `stream` of a verify: the keys of its ancestors committed to the
    cache at their positions (prefix + depth), its own key written after them, one stream, one node. Returns the
    call's inputs (shapes as the verify's with S = T = 1)."""
    q_lat, q_rope, c_kv, k_rope, prefix_len, visible = (np.asarray(a) for a in inputs)
    p = int(prefix_len[stream])
    path = np.flatnonzero(visible[stream, node])                  # ancestors and itself, in depth order
    c, r = c_kv[stream].copy(), k_rope[stream].copy()
    c[p:p + len(path)], r[p:p + len(path)] = c_kv[stream, p + path], k_rope[stream, p + path]
    dtype = inputs[0].dtype
    return (jnp.asarray(q_lat[stream, node][None, None], dtype), jnp.asarray(q_rope[stream, node][None, None], dtype),
            jnp.asarray(c[None], dtype), jnp.asarray(r[None], dtype), jnp.asarray([p + len(path) - 1], jnp.int32),
            jnp.ones((1, 1, 1), bool))


def expert_inputs(rng, m, k, d, i, experts, dtype=jnp.float32):
    """x [M, D], gate / up [E, D, I], down [E, I, D], ids [M, k] (one in ten outside [0, E): another device's),
    weights [M, k]."""
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    gate, up = (jnp.asarray(rng.standard_normal((experts, d, i)) * d ** -0.5, dtype) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((experts, i, d)) * i ** -0.5, dtype)
    ids = rng.integers(0, experts, (m, k))
    ids[rng.random((m, k)) < 0.1] = experts + 3
    weights = jnp.asarray(rng.random((m, k)), jnp.float32)
    return x, (gate, up, down), jnp.asarray(ids, jnp.int32), weights


def numpy_experts(x, stacked, ids, weights):
    """Independent float64 loop over tokens and slots."""
    x, (gate, up, down) = np.asarray(x, np.float64), (np.asarray(w, np.float64) for w in stacked)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(np.asarray(ids[t]), np.asarray(weights[t])):
            if 0 <= e < gate.shape[0]:
                g, u = x[t] @ gate[e], x[t] @ up[e]
                out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


@in_triton_interpreter
@pytest.mark.parametrize("streams,nodes,heads,lat,rope,capacity,chunk", [
    (2, 1, 4, 32, 8, 80, 32),      # AR steps, three chunks of one key step
    (3, 9, 8, 64, 16, 120, None),  # one chunk (attention_chunk)
    (2, 40, 19, 24, 6, 140, 64),   # a tree deeper than a key step and across chunks; H, C and R not powers of two,
    # two head groups
    (1, 5, 16, 32, 8, 37, 32),     # a prefix up to N - T, off the step
])
def test_attention_matches_the_reference(streams, nodes, heads, lat, rope, capacity, chunk):
    from test_attention_kernel import make_inputs, numpy_attention
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(streams * 1000 + nodes * 10 + heads)
    inputs = make_inputs(rng, streams=streams, nodes=nodes, heads=heads, lat=lat, rope=rope, capacity=capacity)
    out = BT.run_attention(interpreter_call, *inputs, SCALE, chunk=chunk)
    assert out.shape == inputs[0].shape and np.isfinite(np.asarray(out)).all()
    assert rel_err(out, BI.attention_reference(*inputs, scale=SCALE)) < 1e-5
    assert rel_err(out, numpy_attention(*inputs)) < 1e-5


@in_triton_interpreter
def test_a_nodes_attention_is_its_ar_steps_bitwise():
    """Every node of two random trees (one deeper than a key step, its path crossing step boundaries) == the AR step
    at its position, bit for bit."""
    from test_attention_kernel import make_inputs
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(5)
    inputs = make_inputs(rng, streams=2, nodes=37, heads=4, lat=32, rope=8, capacity=100)
    tree = np.asarray(BT.run_attention(interpreter_call, *inputs, SCALE, chunk=32))  # 32-position chunks
    for s in range(2):
        for t in range(37):
            ar = np.asarray(BT.run_attention(interpreter_call, *ar_step_of(inputs, s, t), SCALE, chunk=32))
            np.testing.assert_array_equal(ar[0, 0], tree[s, t], err_msg=f"stream {s} node {t}")


@in_triton_interpreter
def test_a_prefix_past_the_cache_merges_only_the_caches_chunks():
    """Nodes whose positions run past the cache (prefix > N - T: those keys read nothing) merge the chunks the cache
    has, not the next node's partials or memory past the buffer: the same as one chunk over the whole cache."""
    from test_attention_kernel import make_inputs
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(12)
    inputs = make_inputs(rng, streams=2, nodes=5, heads=8, lat=32, rope=8, capacity=64, prefix=[62, 40])
    merged = np.asarray(BT.run_attention(interpreter_call, *inputs, SCALE, chunk=32))
    whole = np.asarray(BT.run_attention(interpreter_call, *inputs, SCALE, chunk=64))
    assert np.isfinite(merged).all() and rel_err(merged, whole) < 1e-6


@in_triton_interpreter
def test_one_chunk_written_directly_is_the_merge_of_one_chunk_bitwise():
    """A cache of one chunk normalises in the chunks' kernel (one launch); a larger cache merges the chunks in a
    second. Nodes whose keys all lie in the first chunk get the same bits either way (an AR loop and a ddtree loop
    may hold caches of different capacities)."""
    from test_attention_kernel import make_inputs
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(11)
    inputs = make_inputs(rng, streams=2, nodes=9, heads=4, lat=32, rope=8, capacity=128, prefix=[5, 23])
    two_chunks = np.asarray(BT.run_attention(interpreter_call, *inputs, SCALE, chunk=64))
    q_lat, q_rope, c_kv, k_rope, prefix, visible = inputs
    one_chunk = np.asarray(BT.run_attention(interpreter_call, q_lat, q_rope, c_kv[:, :64], k_rope[:, :64], prefix,
                                            visible, SCALE, chunk=64))
    np.testing.assert_array_equal(one_chunk, two_chunks)


@in_triton_interpreter
@pytest.mark.parametrize("m,k,d,i,experts", [
    (1, 2, 64, 64, 4),             # an AR step: two pairs
    (33, 2, 96, 80, 16),           # D and I off the 64-wide block; experts with several tiles
    (20, 8, 128, 64, 5),           # more pairs than experts x tile: full and partial tiles
])
def test_expert_tiles_match_the_reference(m, k, d, i, experts):
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(m * 100 + d + experts)
    x, stacked, ids, weights = expert_inputs(rng, m, k, d, i, experts)
    routing = route_pairs(ids, weights, experts, L.PAIR_TILE)
    y = BT.run_expert_tiles(interpreter_call, x, *stacked, routing.block_token, routing.block_expert)
    out = L.add_slots(y.reshape(-1, d), routing.pair_row_or_none(), weights)
    assert np.isfinite(np.asarray(out)).all()
    reference = BI.routed_experts(x, lambda e: tuple(w[e] for w in stacked), experts, ids, weights)
    assert rel_err(out, reference) < 1e-5
    assert rel_err(out, numpy_experts(x, stacked, ids, weights)) < 1e-5
    routed = BT.run_routed_experts(interpreter_call, x, *stacked, ids, weights)   # int4_moe's routing and combine
    assert routed.dtype == jnp.float32 and np.isfinite(np.asarray(routed)).all()
    assert rel_err(routed, reference) < 1e-5


@in_triton_interpreter
@pytest.mark.parametrize("lead,heads,k,n", [((1, 1), 8, 32, 64), ((3, 7), 4, 128, 24), ((2, 20), 3, 40, 100)])
def test_head_matmul_matches_the_reference(lead, heads, k, n):
    """The head products (W_UK's K = 32, W_UV's N off the column block, K off the step, rows past a 16-row tile)."""
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(heads * k + n)
    x = jnp.asarray(rng.standard_normal((*lead, heads, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((heads, k, n)) * k ** -0.5, jnp.float32)
    out = BT.run_head_matmul(interpreter_call, x, w, jnp.dtype(jnp.float32))
    assert out.shape == (*lead, heads, n) and np.isfinite(np.asarray(out)).all()
    assert rel_err(out, BI.head_matmul_reference(x, w)) < 1e-5
    assert rel_err(out, np.einsum("...hk,hkn->...hn", np.asarray(x, np.float64), np.asarray(w, np.float64))) < 1e-5


@in_triton_interpreter
@pytest.mark.parametrize("key", [True, False])
def test_absorbed_head_products_read_kv_b_in_place_bitwise(key):
    """W_UK and W_UV read from kv_b [C, H, P + V] with its strides (no transposed copy) give the bits of the same
    product on the transposed slice, and match the reference."""
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(21 + key)
    c, h, nope, v = 48, 3, 32, 24
    kv_b = jnp.asarray(rng.standard_normal((c, h, nope + v)) * c ** -0.5, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 9, h, nope if key else c)), jnp.float32)
    w = jnp.transpose(kv_b[..., :nope], (1, 2, 0)) if key else jnp.transpose(kv_b[..., nope:], (1, 0, 2))
    where = BT.HeadWeights.absorbed(kv_b, nope, key)
    assert where.shape == w.shape
    in_place = np.asarray(BT.run_head_matmul(interpreter_call, x, kv_b, jnp.dtype(jnp.float32), where))
    copied = np.asarray(BT.run_head_matmul(interpreter_call, x, w, jnp.dtype(jnp.float32)))
    np.testing.assert_array_equal(in_place, copied)
    assert rel_err(in_place, BI.head_matmul_reference(x, w)) < 1e-5


@in_triton_interpreter
@pytest.mark.parametrize("lead,k", [((1,), 256), ((3, 5), 1536), ((2, 7), 100)])
def test_rms_norm_matches_the_reference(lead, k):
    """The RMSNorm (one row, several steps along a row, K off the step)."""
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(k)
    x = jnp.asarray(rng.standard_normal((*lead, k)) * 3, jnp.float32)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal(k), jnp.float32)
    out = BT.run_rms_norm(interpreter_call, x, g, 1e-6)
    assert out.shape == x.shape and np.isfinite(np.asarray(out)).all()
    assert rel_err(out, BI.rms_norm_reference(x, g, 1e-6)) < 1e-6
    x64 = np.asarray(x, np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * np.asarray(g, np.float64)
    assert rel_err(out, want) < 1e-6


def test_the_kernels_refuse_mismatched_operands():
    rng = np.random.default_rng(0)
    x, (gate, up, down), ids, _ = expert_inputs(rng, 4, 2, 64, 32, 3)
    expert, rows = route_pairs(ids, jnp.ones(ids.shape), 3, L.PAIR_TILE)[:2]
    with pytest.raises(ValueError, match="one dtype"):
        BT.check_experts(x.astype(jnp.bfloat16), gate, up, down, rows, expert)
    with pytest.raises(ValueError, match="down"):
        BT.check_experts(x, gate, up, down[:, :16], rows, expert)
    with pytest.raises(ValueError, match="route_pairs"):
        BT.check_experts(x, gate, up, down, rows[:, :8], expert)
    with pytest.raises(ValueError, match="float weight"):
        BT.run_rms_norm(None, jnp.zeros((3, 32), jnp.float32), jnp.zeros((16,), jnp.float32), 1e-6)
    with pytest.raises(ValueError, match="w \\[H, K, N\\]"):
        BT.run_head_matmul(None, jnp.zeros((3, 4, 32), jnp.float32), jnp.zeros((4, 16, 8), jnp.float32), jnp.float32)
    q = jnp.zeros((1, 2, 4, 32), jnp.float32)
    with pytest.raises(ValueError, match="one dtype"):
        BT.check_attention(q, q[..., :8], jnp.zeros((1, 16, 32), jnp.bfloat16), jnp.zeros((1, 16, 8), jnp.bfloat16),
                           jnp.zeros((1,), jnp.int32), jnp.ones((1, 2, 2), bool))


def test_the_tiles_are_functions_of_the_model_alone():
    """The key step and the chunk depend on the latent width and the dtype only (never on T, the prefix, the
    capacity or the streams; the head tile is 16 rows): what makes a node's row and its AR step's run one instruction
    sequence."""
    assert BT.attention_block_keys(512, jnp.bfloat16) == 32 and BT.attention_block_keys(64, jnp.bfloat16) == 64
    assert BT.attention_block_keys(512, jnp.float32) == 16
    assert [BT.attention_chunk(lat, dtype) for lat, dtype in ((512, jnp.bfloat16), (64, jnp.bfloat16),
                                                              (512, jnp.float32))] == [256, 512, 128]
    assert [BT.head_block_k(k) for k in (8, 32, 128, 512)] == [16, 32, 64, 64]
    assert [BT.norm_block(k) for k in (64, 100, 1536, 7168)] == [64, 128, 1024, 1024]
