"""pallas_kernels/tree_verify_attention_mgpu.py against the attention reference: in Mosaic GPU's interpret mode on the
CPU (which also checks that every barrier phase is observed), compiled on a GPU.

The kernel's partials are checked over a prefix alone (no tree block; query rows are (node, head) pairs flattened,
as the kernel sees them): ragged prefixes including 0, one shorter than a block, more splits than blocks, more blocks
per split than slots (both slots refilled), an odd number of blocks. The whole op (`tree_verify_attention`: the
prefix and the tree block in the kernel under `frame_bias`, then the merge) is checked under random ancestor masks,
with one split and several, tree blocks inside one cache block and across two, and rows that see nothing. Fresh
random bf16 inputs per case.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from conftest import rel_err
from pallas_kernels import SHARED_BYTES
from pallas_kernels import tree_verify_attention_mgpu as AM
from pallas_kernels import tree_verify_attention as A
from pallas_kernels.tree import random_tree_visible

SCALE = 0.06
INTERPRET = jax.default_backend() != "gpu"


def inputs(rng, streams, rows, capacity):
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    return (bf16(streams, rows, 2 * AM.HALF), bf16(streams, rows, AM.ROPE), bf16(streams, capacity, 2 * AM.HALF),
            bf16(streams, capacity, AM.ROPE))


def prefix_only(q_lat, q_rope, c_kv, k_rope, prefix_len, **kwargs):
    """The kernel over the prefixes alone (no tree block): its partials."""
    s, rows = q_lat.shape[:2]
    bias = AM.frame_bias(prefix_len, jnp.zeros((s, 0, 0), bool), 1, rows)
    return AM.attention_partials(q_lat, q_rope, c_kv, k_rope, prefix_len, bias, scale=SCALE, num_nodes=0,
                                 interpret=INTERPRET, **kwargs)


def reference(q_lat, q_rope, c_kv, k_rope, prefix_len):
    s, rows = q_lat.shape[:2]
    out = A.tree_verify_attention_reference(q_lat[:, :, None], q_rope[:, :, None], c_kv, k_rope, prefix_len,
                                            jnp.zeros((s, rows, rows), bool), scale=SCALE)
    return out[:, :, 0].astype(jnp.float32)


@pytest.mark.parametrize("prefixes,rows,num_splits", [
    ([200, 37], 64, 2),
    ([0, 256, 5], 128, 3),
    ([70], 64, 8),
    ([256, 100], 64, 1),
    ([300, 37, 0], 64, 1),    # five blocks (both slots refilled, an odd last one), one (no second block), none
])
def test_partials_merge_to_the_reference(prefixes, rows, num_splits):
    rng = np.random.default_rng(sum(prefixes) + rows + num_splits)
    q_lat, q_rope, c_kv, k_rope = inputs(rng, len(prefixes), rows, 320)
    prefix_len = jnp.asarray(prefixes, jnp.int32)
    out, row_max, row_sum = prefix_only(q_lat, q_rope, c_kv, k_rope, prefix_len, num_splits=num_splits)
    assert out.shape == (num_splits, len(prefixes), rows, 2 * AM.HALF) and row_sum.shape == row_max.shape
    got = A.combine_partials(out, row_max, row_sum, normalized=True)
    want = reference(q_lat, q_rope, c_kv, k_rope, prefix_len)
    assert np.isfinite(np.asarray(got)).all()
    assert rel_err(got, want) < 1e-2
    for s, p in enumerate(prefixes):
        if p == 0:  # nothing to attend: zeros, and every split says so with a zero sum
            assert not np.asarray(got[s]).any() and not np.asarray(row_sum[:, s]).any()


def test_shared_memory_fits_an_h200():
    """The two 72 KB slots beside the 72 KB q tile, the statistics and the barriers fit an H200's 227 KB per block;
    a third slot would not. The in-kernel combine's buffers, up to one wave's 132 splits, fit in the memory of the
    main loop's operands that they share: no more in all."""
    slot = 2 * AM.BLOCK_KV * (2 * AM.HALF + AM.ROPE)   # bytes: one block of bf16 c_kv and k_rope rows
    assert AM.shared_memory_bytes() <= SHARED_BYTES < AM.shared_memory_bytes() + slot
    assert all(AM.shared_memory_bytes(splits) == AM.shared_memory_bytes() for splits in (2, 8, 66, 132))


def test_bad_shapes_name_the_fix():
    rng = np.random.default_rng(1)
    ten = jnp.asarray([10], jnp.int32)
    q_lat, q_rope, c_kv, k_rope = inputs(rng, 1, 40, 256)
    with pytest.raises(ValueError, match="multiple of 64"):
        prefix_only(q_lat, q_rope, c_kv, k_rope, ten)
    q_lat, q_rope, c_kv, k_rope = inputs(rng, 1, 64, 100)
    with pytest.raises(ValueError, match="cache rows N=100 must be a multiple of 64"):
        prefix_only(q_lat, q_rope, c_kv, k_rope, ten)
    q_lat, q_rope, c_kv, k_rope = inputs(rng, 1, 64, 128)
    with pytest.raises(ValueError, match=r"frame_bias .* must be f32 \[S, rows, frame_width\(T=67"):
        AM.attention_partials(q_lat, q_rope, c_kv, k_rope, ten, jnp.zeros((1, 64, 64), jnp.float32), scale=SCALE,
                              num_nodes=3 + 64, interpret=INTERPRET)


@pytest.mark.parametrize("prefixes,nodes,heads,num_splits", [
    ([150, 0], 5, 8, 2), ([64, 190], 9, 16, 3), ([200], 1, 8, 2), ([120, 7], 20, 4, 1),
    pytest.param([60, 128], 70, 1, 2, marks=pytest.mark.slow), ([250, 7], 20, 4, 1)])
def test_tree_verify_attention_matches_the_reference(prefixes, nodes, heads, num_splits):
    """The whole op under random ancestor masks, with T x H rows padded to 64-row tiles (40, 144, 8, 80 and 70 rows),
    an empty prefix (only the tree block is attended), a tree block across two cache blocks (prefix 120 and T = 20;
    with -m slow also prefix 60 and T = 70, a frame of three blocks), one split (the kernel's output is the op's) and
    several, and prefix 250 with T = 20 in one split (five blocks: a pair before the frame, a pair across its start,
    an odd last block). In interpret mode it runs op by op (jax.disable_jit): inside one jit, the interpreted kernel
    and XLA's CPU work beside it can wait on each other for good (experiments/notes/kernels.md)."""
    rng = np.random.default_rng(sum(prefixes) + nodes)
    s = len(prefixes)
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    args = (bf16(s, nodes, heads, 2 * AM.HALF), bf16(s, nodes, heads, AM.ROPE), bf16(s, 320, 2 * AM.HALF),
            bf16(s, 320, AM.ROPE), jnp.asarray(prefixes, jnp.int32),
            jnp.asarray(random_tree_visible(rng, s, nodes)))
    with jax.disable_jit(INTERPRET):
        got = AM.tree_verify_attention(*args, scale=SCALE, num_splits=num_splits, interpret=INTERPRET)
    want = A.tree_verify_attention_reference(*args, scale=SCALE)
    assert got.shape == want.shape and got.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert rel_err(got, want) < 1e-2


def test_a_plan_made_once_gives_each_call_the_same_output():
    """`ops.tree_verify_plan` (the frame bias made once per forward, outside the calls) gives the op the bias it
    would make itself: bit-identical output with and without the plan; a plan for other heads is refused by name,
    and one for fewer than 64 query rows (the Triton kernel's calls) holds no bias."""
    from pallas_kernels import ops
    rng = np.random.default_rng(11)
    s, nodes, heads = 2, 5, 16
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    prefix_len = jnp.asarray([150, 61], jnp.int32)
    visible = jnp.asarray(random_tree_visible(rng, s, nodes))
    args = (bf16(s, nodes, heads, 2 * AM.HALF), bf16(s, nodes, heads, AM.ROPE), bf16(s, 256, 2 * AM.HALF),
            bf16(s, 256, AM.ROPE), prefix_len, visible)
    with ops.implementation("kernel", interpret=INTERPRET), jax.disable_jit(INTERPRET):
        plan = ops.tree_verify_plan(prefix_len, visible, num_heads=heads)
        assert plan.frame_bias.shape == (s, AM.padded_rows(nodes * heads), AM.frame_width(nodes))
        with_plan = ops.tree_verify_attention(*args, plan, scale=SCALE)
        without = ops.tree_verify_attention(*args, scale=SCALE)
        with pytest.raises(ValueError, match="plan was built for num_heads=8 and T=5 tree nodes, the call has H=16"):
            ops.tree_verify_attention(*args, ops.tree_verify_plan(prefix_len, visible, num_heads=8), scale=SCALE)
        assert ops.tree_verify_plan(prefix_len, visible, num_heads=8).frame_bias is None     # 40 rows
    assert np.array_equal(np.asarray(with_plan, np.float32), np.asarray(without, np.float32))
    assert rel_err(with_plan, A.tree_verify_attention_reference(*args, scale=SCALE)) < 1e-2


def test_tree_verify_attention_refuses_a_cache_not_in_whole_blocks():
    rng = np.random.default_rng(3)
    q_lat, q_rope, c_kv, k_rope = inputs(rng, 1, 8, 100)
    with pytest.raises(ValueError, match="multiple of 64"):
        AM.tree_verify_attention(q_lat[:, None], q_rope[:, None], c_kv, k_rope, jnp.asarray([10], jnp.int32),
                                 jnp.ones((1, 1, 1), bool), scale=SCALE, interpret=INTERPRET)


@pytest.mark.parametrize("streams,rows,capacity", [(1, 8, 32832), (1, 8, 4160), (1, 64, 4160), (1, 128, 4160),
                                                   (1, 1024, 32832), (8, 512, 32832), (1, 16384, 33024)])
def test_default_splits_take_one_wave_of_programs(streams, rows, capacity):
    """One 64-row program per multiprocessor: the split count keeps every program in one wave when the call has fewer
    query tiles than multiprocessors, gives each split at least one cache block, and a compute-bound call (H=64
    T=256) one split; one query tile over a short prefix (8 or 64 rows, N=4096: 65 blocks) takes a split per
    block."""
    splits = AM.default_num_splits(streams, rows, capacity)
    tiles = streams * -(-rows // AM.BLOCK_Q)
    assert 1 <= splits <= capacity // AM.BLOCK_KV
    assert tiles >= A.NUM_SMS or tiles * splits <= A.NUM_SMS
    if rows == 16384:
        assert splits == 1
    if rows <= AM.BLOCK_Q and capacity == 4160:
        assert splits == 65


def test_few_rows_over_a_long_prefix_take_one_wave():
    """H=8 T=1 N=32768: one program per multiprocessor in both kernels (the Triton kernel's 16-row decode tile with
    four stages of 32-row blocks, this kernel's 64-row tile), so one wave of 132 splits each."""
    config = A.default_config(1, 8, 32832)
    assert (config.block_q, config.block_k, config.num_stages, config.num_splits) == (16, 32, 4, 132)
    assert AM.default_num_splits(1, 8, 32832) == 132


def test_combine_in_kernel_refuses_interpret_mode_and_a_second_wave():
    """The in-kernel combine waits on semaphores, which Mosaic GPU's interpret mode lacks, and needs every program
    resident at once: both refused with the fix named (its results are checked on the H200, test_kernels_gpu.py)."""
    rng = np.random.default_rng(2)
    q_lat, q_rope, c_kv, k_rope = inputs(rng, 1, 64, 256)
    prefix_len = jnp.asarray([100], jnp.int32)
    bias = AM.frame_bias(prefix_len, jnp.zeros((1, 0, 0), bool), 1, 64)
    with pytest.raises(ValueError, match="interpret mode has no semaphores"):
        AM.attention_partials(q_lat, q_rope, c_kv, k_rope, prefix_len, bias, scale=SCALE, num_nodes=0, num_splits=2,
                              combine_in_kernel=True, interpret=True)
    sms = AM.resident_programs()                # 132 (an H200's) on the CPU
    with pytest.raises(ValueError, match=f"{sms + 1} programs, more than the {sms} multiprocessors"):
        AM.check_resident(sms + 1)
    AM.check_resident(sms)
    with pytest.raises(ValueError, match=r"registers=\(256, 40\) must be multiples of 8"):
        prefix_only(q_lat, q_rope, c_kv, k_rope, prefix_len, registers=(256, 40))


def joined_in_interpret_mode(out, row_max, row_sum, num_splits: int, programs: int):
    """The in-kernel combine's join (`_combine_units`) alone, as a kernel of `programs` programs of two
    warpgroups in interpret mode (the semaphore wait before it needs the GPU): partials of one 64-row tile (out
    [P'', 64, 512] bf16, max / sum [P', 64] f32, P'' = staged_splits(num_splits) and P' = stat_splits(num_splits),
    as the kernel allocates them) -> [64, 512] bf16."""
    def body(out_ref, max_ref, sum_ref, result_ref, stage, barriers):
        wg, program = lax.axis_index("wg"), lax.axis_index("program")
        AM._combine_units(result_ref, out_ref, max_ref, sum_ref, [ref.at[wg] for ref in stage], barriers.at[wg],
                          AM.COMPUTE_WGS * program + wg, AM.COMPUTE_WGS * programs, num_splits)

    scratch = (AM._combine_stage(num_splits), plgpu.Barrier(num_arrivals=3, num_barriers=AM.COMPUTE_WGS))
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((AM.BLOCK_Q, 2 * AM.HALF), jnp.bfloat16),
                        scratch_types=scratch, grid=(programs,), grid_names=("program",),
                        num_threads=AM.COMPUTE_WGS, thread_name="wg",
                        interpret=plgpu.InterpretGPUParams())(out, row_max, row_sum)


@pytest.mark.parametrize("num_splits,programs", [(5, 2), (13, 3), pytest.param(66, 4, marks=pytest.mark.slow),
                                                  pytest.param(90, 8, marks=pytest.mark.slow)])
def test_in_kernel_join_matches_combine_partials(num_splits, programs):
    """The in-kernel combine's join over fresh random partials == `combine_partials`: splits that saw nothing (sum
    0, max -inf), a row no split saw (0), each warpgroup taking many units (few programs) of 16, 8, 2 and 1 rows
    (`unit_rows` at 5, 13, 66 and 90 splits; the last two slow, ~40 s each), from 13 splits a loop step of
    COMBINE_UNROLL splits and a rest; the buffers' splits past num_splits hold NaN, which must not reach the
    result."""
    rng = np.random.default_rng(num_splits)
    splits = AM.stat_splits(num_splits)
    out = rng.standard_normal((AM.staged_splits(num_splits), AM.BLOCK_Q, 2 * AM.HALF)).astype(np.float32)
    row_max = 3 * rng.standard_normal((splits, AM.BLOCK_Q)).astype(np.float32)
    row_sum = rng.uniform(0.5, 20.0, (splits, AM.BLOCK_Q)).astype(np.float32)
    empty = rng.random((splits, AM.BLOCK_Q)) < 0.3
    empty[:, 5] = True
    row_max[empty], row_sum[empty] = -np.inf, 0.0
    out[num_splits:], row_max[num_splits:], row_sum[num_splits:] = np.nan, np.nan, np.nan
    out = jnp.asarray(out, jnp.bfloat16)
    got = joined_in_interpret_mode(out, jnp.asarray(row_max), jnp.asarray(row_sum), num_splits, programs)
    want = A.combine_partials(out[:num_splits, None], jnp.asarray(row_max[:num_splits, None]),
                              jnp.asarray(row_sum[:num_splits, None]), normalized=True)[0]
    assert np.isfinite(np.asarray(got, np.float32)).all() and not np.asarray(got[5], np.float32).any()
    assert rel_err(got.astype(jnp.float32), want) < 1e-2


def lowered_for_h200(s: int, t: int, h: int, n: int, **options) -> str:
    """StableHLO of the op at S, T, H, N (bf16 operands) with `options`, lowered for an H200 on any machine."""
    from triton_h200 import lower_for_h200, spec

    fn = functools.partial(AM.tree_verify_attention, scale=SCALE, **options)
    return lower_for_h200(fn, spec((s, t, h, 2 * AM.HALF), jnp.bfloat16), spec((s, t, h, AM.ROPE), jnp.bfloat16),
                          spec((s, n, 2 * AM.HALF), jnp.bfloat16), spec((s, n, AM.ROPE), jnp.bfloat16),
                          spec((s,), jnp.int32), spec((s, t, t), jnp.bool_))


def test_kernel_lowers_for_the_h200():
    """The kernel (its consumers' own p from registers, the frame's bias under a cond, an odd last block) lowered
    for an H200 (no GPU needed; interpret mode runs another wgmma path): one Mosaic GPU custom call."""
    assert lowered_for_h200(1, 16, 64, 4096).count("custom_call @mosaic_gpu_v2") == 1


def test_combine_in_kernel_lowers_for_the_h200():
    """The op with the in-kernel combine lowered for an H200 (no GPU needed): one Mosaic GPU custom call (its
    semaphore buffer zeroed by XLA), no combine kernel after it."""
    text = lowered_for_h200(1, 1, 64, 32768, combine_in_kernel=True)
    assert text.count("custom_call @mosaic_gpu_v2") == 1 and "triton" not in text


@pytest.mark.parametrize("t,h,tiles", [(16, 8, 2), (64, 8, 2), (64, 8, 4)])
def test_multicast_tiles_lowers_for_the_h200(t, h, tiles):
    """Clusters of 2 or 4 query tiles of a split loading each cache block once by TMA multicast, lowered for an H200
    (no GPU needed; interpret mode has no clusters, so the results are checked on the H200, test_kernels_gpu.py):
    one Mosaic GPU custom call, then the separate combine."""
    assert lowered_for_h200(1, t, h, 32768, multicast_tiles=tiles).count("custom_call @mosaic_gpu_v2") == 1


def test_default_multicast_tiles_takes_two_tile_streams_over_long_splits():
    """Clusters of 2 by default only where a stream has exactly 2 query tiles and each split at least
    MULTICAST_MIN_BLOCKS cache blocks (H=8 T=16 at N=32768 over 66 splits; not at N=4096, not at 1 or 4 tiles)."""
    assert AM.default_multicast_tiles(128, 32832, 66) == 2
    assert AM.default_multicast_tiles(128, 32832, 16) == 2
    assert AM.default_multicast_tiles(128, 4160, 48) == 1
    assert AM.default_multicast_tiles(64, 32832, 132) == 1
    assert AM.default_multicast_tiles(256, 32832, 33) == 1
    assert AM.default_multicast_tiles(72, 32832, 66) == 2     # 72 rows pad to two tiles


def test_multicast_tiles_refuses_what_it_cannot_run():
    """Multicast needs whole clusters of query tiles, the GPU and the separate combine: each refused with the fix
    named."""
    rng = np.random.default_rng(5)
    q_lat, q_rope, c_kv, k_rope = inputs(rng, 1, 128, 512)
    prefix_len = jnp.asarray([300], jnp.int32)
    with pytest.raises(ValueError, match=r"multicast_tiles=4 must be one of \(1, 2, 4\) and divide the 2 query"):
        prefix_only(q_lat, q_rope, c_kv, k_rope, prefix_len, num_splits=2, multicast_tiles=4)
    with pytest.raises(ValueError, match="multicast_tiles=3 must be one of"):
        prefix_only(q_lat, q_rope, c_kv, k_rope, prefix_len, num_splits=2, multicast_tiles=3)
    bias = AM.frame_bias(prefix_len, jnp.zeros((1, 0, 0), bool), 1, 128)
    for options in (dict(interpret=True), dict(combine_in_kernel=True)):
        with pytest.raises(ValueError, match="multicast_tiles > 1 needs the GPU"):
            AM.attention_partials(q_lat, q_rope, c_kv, k_rope, prefix_len, bias, scale=SCALE, num_nodes=0,
                                  num_splits=2, multicast_tiles=2, **options)
