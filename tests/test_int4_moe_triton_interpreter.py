"""The Triton int4_moe kernels run on the CPU in Triton's interpreter (f32 activations: the bf16 path's inline PTX
does not interpret), through the same host code as on the GPU (`int4_moe_triton.run_kernels`), against the float64
reference; outputs start as NaN, so finite results prove every element was written. Shapes include I not a multiple
of 256 (rows past I in the last block must not read the next expert: an unrouted expert's scales are poisoned with
NaN), D not a multiple of the row block, ids of other devices (out of range) and repeated experts. Triton must be in
interpreter mode from its first import, so the test re-runs this file in a child process with TRITON_INTERPRET=1."""

import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from conftest import in_triton_interpreter, interpreter_parent
from pallas_kernels import int4_moe_triton as MT

test_in_the_interpreter = interpreter_parent(__file__)


@in_triton_interpreter
@pytest.mark.parametrize("experts,hidden,inter,ids,block_m,tiling", [
    (3, 256, 128, [[0, 7], [1, 0], [0, -1], [1, 1]], 16, {}),      # I = 128: the gate_up grid covers 256 rows
    (3, 320, 96, [[0, 2], [2, 0], [1, -1], [2, 2]], 16, {}),       # D, I off the 64-row block
    (4, 256, 256, [[3, 1], [1, 1], [9, 0], [3, 2], [0, 3]], 32, {}),
    (3, 320, 256, [[0, 2], [2, 0], [1, -1]], 16, dict(down_block_n=128, down_words=16)),   # the down kernel's own tiles
    (3, 512, 128, [[0, 2], [2, 0], [1, -1]], 16, dict(gate_up_splits=2)),          # split-K over D, 2 steps
    (4, 1024, 96, [[3, 1], [1, 1], [9, 0]], 16, dict(gate_up_splits=4)),           # 4 steps, I off the block
    (6, 512, 96, [[0, 1], [2, 3], [4, 0], [1, 2]], 16, dict(group_by_block=True)),    # grid [tiles, blocks]: more
    (6, 512, 96, [[0, 1], [2, 3], [4, 0], [1, 2]], 16, dict(group_by_block=True, gate_up_splits=2)),  # blocks than tiles
    (3, 320, 96, [[0, 2], [2, 0], [1, -1], [2, 2]], 1, dict(fma=True, block_n=32)),     # multiply-adds, a pair a block
    (4, 512, 256, [[3, 1], [1, 1], [9, 0]], 1, dict(fma=True, block_n=16, gate_up_splits=2, down_block_n=64)),
    (3, 256, 128, [[0, 2], [2, 0], [1, -1]], 1, dict(fma=True, block_n=64, words=16, group_by_block=True)),
])
def test_f32_kernels_match_the_reference(experts, hidden, inter, ids, block_m, tiling):
    from conftest import rel_err
    from pallas_kernels.int4_moe import Int4Experts, int4_moe_reference
    from test_int4_moe import compressed_tensors_experts, numpy_moe
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(experts * hidden + inter)
    ct = compressed_tensors_experts(rng, experts, hidden, inter)
    weights = Int4Experts.from_compressed_tensors(*ct)
    unrouted = experts - 1 if experts - 1 not in np.asarray(ids) else None
    if unrouted is not None:        # its scales NaN: reading them anywhere would reach the output
        weights = weights._replace(gate_scale=weights.gate_scale.at[unrouted].set(jnp.nan))
    x = jnp.asarray(rng.standard_normal((len(ids), hidden)), jnp.float32)
    ids = jnp.asarray(ids, jnp.int32)
    topk_weights = jnp.asarray(rng.random(ids.shape), jnp.float32)
    config = MT.TritonMoeConfig(**{**dict(block_m=block_m, block_n=64, words=32), **tiling})
    out = MT.run_kernels(interpreter_call, x, weights, ids, topk_weights, config)
    assert np.isfinite(np.asarray(out)).all()
    if unrouted is None:
        assert rel_err(out, int4_moe_reference(x, weights, ids, topk_weights)) < 1e-5
    assert rel_err(out, numpy_moe(x, ct, ids, topk_weights)) < 1e-5


@in_triton_interpreter
@pytest.mark.parametrize("tokens,top_k,experts,block_m,foreign", [
    (1, 8, 384, 16, 0.0),          # K2.6 decode: one pair per block
    (37, 8, 16, 16, 0.2),          # runs longer than a block, a fifth of the ids another device's (out of range)
    (5, 3, 4, 32, 0.5),            # blocks of 32, most experts repeated
    (64, 8, 384, 16, 0.0),         # MAX_ROUTED_PAIRS pairs
])
def test_route_kernel_equals_route_pairs(tokens, top_k, experts, block_m, foreign):
    """The one-program routing kernel gives `route_pairs`' blocks exactly: each block's expert (E past the last),
    token (M on padding rows) and weight (0 there), and each pair's row (-1 where its expert is not on this
    device)."""
    from pallas_kernels import int4_moe_triton as MT
    from pallas_kernels.int4_moe import route_pairs
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(tokens * experts + block_m)
    ids = rng.integers(0, experts, (tokens, top_k))
    away = rng.random(ids.shape) < foreign
    ids = jnp.asarray(np.where(away, rng.choice([-1, experts, experts + 5], ids.shape), ids), jnp.int32)
    weights = jnp.asarray(rng.random(ids.shape), jnp.bfloat16)
    assert ids.size <= MT.MAX_ROUTED_PAIRS
    got = MT.route(interpreter_call, ids, weights, experts, block_m)
    want = route_pairs(ids, weights, experts, block_m)
    np.testing.assert_array_equal(got[0], want.block_expert)
    np.testing.assert_array_equal(got[1], np.asarray(want.block_token).reshape(-1))
    np.testing.assert_array_equal(got[2], np.asarray(want.block_weight).reshape(-1))
    np.testing.assert_array_equal(got[3], np.where(want.pair_ok, want.pair_row, -1))


@in_triton_interpreter
@pytest.mark.parametrize("weighted,xla", [(False, False), (True, False), (True, True)],
                         ids=["combine", "weighted_combine", "weighted_combine_in_xla"])
def test_combine_pairs_sums_each_tokens_rows(weighted, xla):
    """`combine_pairs` (the Triton int4_moe's combine, and weighted, the Mosaic GPU int4_moe's; and its XLA twin,
    `int4_moe_mgpu.combine_pairs_xla`): each token's pair rows of y summed in slot order, scaled by the pair's weight
    where given; pairs of row -1 add nothing (their weights, NaN here, are not read), and rows no pair names (NaN)
    are never read. D = 1500: two column programs, the second masked."""
    from conftest import rel_err
    from pallas_kernels import int4_moe_mgpu
    from triton_interpreter import interpreter_call

    rng = np.random.default_rng(5 + weighted + xla)
    m, top_k, rows, d = 6, 3, 24, 1500
    pair_row = rng.permutation(rows)[:m * top_k]
    pair_row[[2, 7]] = -1
    y = rng.standard_normal((rows, d)).astype(np.float32)
    y[np.setdiff1d(np.arange(rows), pair_row)] = np.nan
    weight = np.where(pair_row >= 0, rng.random(m * top_k), np.nan).astype(np.float32)
    args = (jnp.asarray(pair_row, jnp.int32), jnp.asarray(y), (m, top_k), jnp.float32)
    if xla:
        got = int4_moe_mgpu.combine_pairs_xla(*args, jnp.asarray(weight))
    else:
        got = MT.combine_pairs(interpreter_call, *args, jnp.asarray(weight) if weighted else None)
    scale = weight if weighted else np.ones_like(weight)
    want = np.zeros((m, d))
    for pair, row in enumerate(pair_row):
        if row >= 0:
            want[pair // top_k] += scale[pair] * y[row].astype(np.float64)
    assert rel_err(got, want) < 1e-6


@triton.jit
def _nibble_dots_kernel(tiles_ptr, act_ptr, out_ptr, BN: tl.constexpr, BM: tl.constexpr, W: tl.constexpr,
                        WIDTH: tl.constexpr, FIRST: tl.constexpr):
    """`_nibble_dots` of 8 tiles [BN, W] (tiles_ptr [8, BN, W]) and inputs act_ptr [BM, WIDTH] from column FIRST into
    out_ptr [BN, BM], every third input row (from row 1) masked off as a padding row."""
    at = tiles_ptr + tl.arange(0, BN)[:, None] * W + tl.arange(0, W)[None, :]
    tiles = (tl.load(at), tl.load(at + BN * W), tl.load(at + 2 * BN * W), tl.load(at + 3 * BN * W),
             tl.load(at + 4 * BN * W), tl.load(at + 5 * BN * W), tl.load(at + 6 * BN * W), tl.load(at + 7 * BN * W))
    cols = FIRST + tl.arange(0, W)
    act_at = act_ptr + tl.arange(0, BM)[:, None] * WIDTH + cols[None, :]
    out = tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]
    rows_ok = tl.arange(0, BM) % 3 != 1
    tl.store(out_ptr + out, MT._nibble_dots(tiles, act_at, cols, WIDTH, rows_ok, tl.zeros((BN, BM), tl.float32)))


@in_triton_interpreter
@pytest.mark.parametrize("width,first_col,words", [(512, 256, 32), (512, 16, 16), (320, 272, 16)])
def test_nibble_dots_equal_their_einsum(width, first_col, words):
    """`_nibble_dots` (nibble i's inputs 32 i columns after nibble 0's) equals its einsum on random f32 tiles, for a
    step's first column at a block start, inside a block (16-word steps), and past the end of a row 320 wide (the
    masked loads: nibbles whose inputs pass the width add nothing); masked rows (a block's padding) add nothing."""
    import jax

    from triton_interpreter import interpreter_call

    bn, bm = 64, 16
    rng = np.random.default_rng(width + first_col)
    tiles = jnp.asarray(rng.standard_normal((8, bn, words)), jnp.float32)
    masked = np.arange(bm) % 3 == 1
    act = rng.standard_normal((bm, width)).astype(np.float32)
    act[masked] = np.nan                              # a masked row adds nothing
    out = jax.ShapeDtypeStruct((bn, bm), jnp.float32)
    got = interpreter_call(tiles, jnp.asarray(act), kernel=_nibble_dots_kernel, out_shape=out, grid=(1,), BN=bn,
                           BM=bm, W=words, WIDTH=width, FIRST=first_col)
    cols = first_col + 32 * np.arange(8)[:, None] + np.arange(words)[None, :]             # [8, W]
    padded = np.concatenate([np.where(masked[:, None], 0.0, act), np.zeros((bm, 256), np.float32)], axis=1)
    # the NaN rows must contribute exactly 0 (a masked load's `other`), not NaN
    want = np.einsum("inw,miw->nm", np.asarray(tiles, np.float64), padded[:, cols] * (cols < width))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
