"""The Mosaic GPU INT4 block matmul and the int4_moe built on it: in Mosaic GPU's interpret mode on the CPU against
the f32 references (fresh random inputs, relative error), and lowered for an H200 (the register-A path the GPU runs,
which interpret mode cannot take)."""
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int4_layout
from pallas_kernels import int4_matmul_mgpu as MM
from pallas_kernels import int4_moe_mgpu as MOE
from pallas_kernels import int4_moe_triton as MT
from pallas_kernels import ops
from pallas_kernels.int4_moe import Int4Experts, int4_moe_reference
from conftest import rel_err
from triton_h200 import lower_for_h200, spec


def operands(rng, experts: int, n: int, k: int, block_expert, acts_k_major: bool, block_tokens: int = MM.TOKENS):
    w = jnp.asarray(rng.integers(-8, 8, (experts, n, k)), jnp.int8).astype(jnp.int4)
    scales = jnp.asarray(rng.uniform(0.5, 1.5, (experts, k // MM.GROUP, n)) / np.sqrt(k), jnp.bfloat16)
    rows = len(block_expert) * block_tokens
    acts = jnp.asarray(rng.standard_normal((k, rows) if acts_k_major else (rows, k)), jnp.bfloat16)
    return acts, jnp.asarray(block_expert, jnp.int32), w, scales


def interpret(fn, *args, **kwargs):
    """fn in Mosaic GPU's interpret mode, memory it never writes left NaN."""
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(uninitialized_memory="nan")):
        return jax.block_until_ready(fn(*args, **kwargs))


@pytest.mark.parametrize("acts_k_major", [False, True], ids=["acts_rows", "acts_k_major"])
@pytest.mark.parametrize("tile_k,ctas,tokens,tokens_major_out,rows_per_wg,cluster", [
    (64, 132, 128, False, 64, 1), (128, 1, 128, False, 64, 1), (32, 132, 96, True, 64, 1),
    (256, 2, 32, False, 64, 1), (128, 1, 64, True, 128, 1), (128, 2, 64, False, 64, 2)],
    ids=["tile_k_64", "tile_k_128_one_cta", "tile_k_32_96_tokens_major_out", "tile_k_256_32_tokens_two_ctas",
         "128_rows_per_wg", "cluster_of_2"])
def test_block_matmul_matches_reference(acts_k_major, tile_k, ctas, tokens, tokens_major_out, rows_per_wg, cluster):
    """Three blocks, one of them empty (expert id E): every written column (row, tokens-major) equals the f32
    reference and the empty block's are never written; two row tiles (N = 256; one with 128 rows per warpgroup), K
    over several pipeline steps; with one CTA, its persistent loop walks all (block, row tile) pairs, reusing its
    pipeline and epilogue buffers; a cluster of two CTAs takes both row tiles of a block, its activation tile
    multicast."""
    rng = np.random.default_rng(tile_k + acts_k_major + tokens + rows_per_wg + cluster)
    args = operands(rng, 3, 256, 512, [1, 3, 0], acts_k_major, tokens)
    config = MM.MgpuMatmulConfig(tile_k=tile_k, stages=3, ctas=ctas, block_tokens=tokens, rows_per_wg=rows_per_wg,
                                 cluster=cluster)
    out = interpret(MM.int4_block_matmul, *args, acts_k_major=acts_k_major, a_in_shared=True,
                    tokens_major_out=tokens_major_out, out_dtype=jnp.float32, config=config)
    want = MM.int4_block_matmul_reference(*args, acts_k_major=acts_k_major, tokens_major_out=tokens_major_out,
                                          block_tokens=tokens)
    out, want = (np.asarray(out), np.asarray(want)) if tokens_major_out else (np.asarray(out).T, np.asarray(want).T)
    written = np.r_[0:tokens, 2 * tokens:3 * tokens]
    assert out.shape == (3 * tokens, 256)
    assert rel_err(out[written], want[written]) < 1e-5
    assert np.isnan(out[tokens:2 * tokens]).all()


def test_int4_moe_matches_reference():
    """The whole op at small shapes (E 4, D 256, I 128, top-2, ids of another device included, their weights NaN)
    against int4_moe_reference."""
    rng = np.random.default_rng(11)
    e, d, i, m = 4, 256, 128, 8
    q = lambda *s: rng.integers(-8, 8, s)
    scale = lambda *s: np.asarray(jnp.asarray(rng.uniform(0.5, 1.5, s) / 16, jnp.bfloat16), np.float32)
    experts = Int4Experts.from_compressed_tensors(*(jnp.asarray(a) for a in (
        int4_layout.pack_int4(q(e, i, d)), scale(e, i, d // 32), int4_layout.pack_int4(q(e, i, d)),
        scale(e, i, d // 32), int4_layout.pack_int4(q(e, d, i)), scale(e, d, i // 32))))
    ids = jnp.asarray([[0, 1], [2, 3], [1, 1], [3, 0], [2, -1], [0, 9], [1, 2], [3, 3]], jnp.int32)
    foreign = jnp.full(ids.shape, -1, jnp.int32)                      # every id on another device: all blocks empty
    weights = jnp.asarray(rng.uniform(0.1, 1.0, ids.shape), jnp.float32)
    weights = jnp.where((ids >= 0) & (ids < e), weights, jnp.nan)      # a foreign pair's weight is never read
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.bfloat16)
    config = MM.MgpuMatmulConfig(tile_k=128, stages=2, block_tokens=32)
    out = interpret(MOE.int4_moe, x, experts, ids, weights, config=config, combine=MOE.XLA_GATHER,
                    a_in_shared=True)
    assert rel_err(out, int4_moe_reference(x, experts, ids, weights)) < 2e-2
    none = interpret(MOE.int4_moe, x, experts, foreign, weights, config=config, combine=MOE.XLA_GATHER,
                     a_in_shared=True)
    assert np.array_equal(np.asarray(none, np.float32), np.zeros((m, d), np.float32))


@pytest.mark.parametrize("acts_k_major,tokens,cluster", [(False, 128, 1), (True, 128, 1), (False, 96, 1),
                                                         (True, 32, 1), (False, 128, 2), (True, 128, 2)],
                         ids=["gate_up", "down", "gate_up_96_tokens", "down_32_tokens", "gate_up_cluster_of_2",
                              "down_cluster_of_2"])
def test_block_matmul_lowers_for_h200_at_k26_shapes(acts_k_major, tokens, cluster):
    """K2.6's gate_up (N = 2 I = 4096, K = D = 7168) and down (N = D, K = I = 2048, acts [K, R], y tokens-major as
    int4_moe_mgpu stores it) with 640 blocks, A from registers: Mosaic GPU's layout inference and lowering for sm_90
    accept the kernel (down with int4_moe_mgpu's 128 rows per warpgroup)."""
    n, k = (7168, 2048) if acts_k_major else (4096, 7168)
    rows = 640 * tokens
    args = (spec((k, rows) if acts_k_major else (rows, k), jnp.bfloat16), spec((640,), jnp.int32),
            spec((384, n, k), jnp.int4), spec((384, k // MM.GROUP, n), jnp.bfloat16))
    config = MM.MgpuMatmulConfig(block_tokens=tokens, rows_per_wg=128 if acts_k_major else 64, cluster=cluster)
    text = lower_for_h200(lambda *a: MM.int4_block_matmul(*a, acts_k_major=acts_k_major, config=config,
                                                          tokens_major_out=acts_k_major), *args)
    assert "mosaic_gpu" in text


def test_stages_that_fit_the_shared_memory():
    """The automatic stage count: 4 with one product and bf16 out, 3 with f32 out or two products; the lowering
    refuses f32 out at 4 stages and takes what stages_that_fit picks (K2.6's gate_up shapes)."""
    assert MM.stages_that_fit(128, 1, jnp.bfloat16, False) == 4
    assert MM.stages_that_fit(128, 1, jnp.float32, False) == 3 and MM.stages_that_fit(128, 2, jnp.bfloat16, False) == 3
    w, s = spec((384, 2048, 7168), jnp.int4), spec((384, 224, 2048), jnp.bfloat16)
    args = (spec((640 * MM.TOKENS, 7168), jnp.bfloat16), spec((640,), jnp.int32), w, s)
    with pytest.raises(Exception, match="exceeds available shared memory"):
        lower_for_h200(lambda *a: MM.int4_block_matmul(*a, out_dtype=jnp.float32,
                                                       config=MM.MgpuMatmulConfig(stages=4)), *args)
    lower_for_h200(lambda *a: MM.int4_block_matmul(*a, out_dtype=jnp.float32), *args)
    lower_for_h200(lambda x, be, w, s, wu, su: MM.int4_block_matmul(x, be, w, s, (wu, su)), *args, w, s)


@pytest.mark.parametrize("acts_k_major,rows_per_wg,tokens_major_out", [
    (False, 64, False), (True, 64, False), (False, 128, False), (True, 128, True)],
    ids=["acts_rows", "acts_k_major", "128_rows_per_wg", "128_rows_per_wg_tokens_major_out"])
def test_gated_block_matmul_matches_reference(acts_k_major, rows_per_wg, tokens_major_out):
    """With `up`: silu(gate) * up per written column against the f32 reference (two products per consumer; with
    128 rows per warpgroup four accumulators, gate and up of each 64-row sub-tile paired in the epilogue)."""
    rng = np.random.default_rng(21 + acts_k_major + rows_per_wg)
    acts, block_expert, w, scales = operands(rng, 3, 256, 256, [2, 0, 3], acts_k_major)
    _, _, w_up, scales_up = operands(rng, 3, 256, 256, [2, 0, 3], acts_k_major)
    out = interpret(MM.int4_block_matmul, acts, block_expert, w, scales, (w_up, scales_up),
                    acts_k_major=acts_k_major, a_in_shared=True, out_dtype=jnp.float32,
                    tokens_major_out=tokens_major_out, config=MM.MgpuMatmulConfig(ctas=2, rows_per_wg=rows_per_wg))
    want = MM.int4_block_matmul_reference(acts, block_expert, w, scales, (w_up, scales_up),
                                          acts_k_major=acts_k_major, tokens_major_out=tokens_major_out)
    out, want = (np.asarray(out).T, np.asarray(want).T) if tokens_major_out else (np.asarray(out), np.asarray(want))
    assert rel_err(out[:, :256], want[:, :256]) < 1e-5


def test_block_start_reads_each_block_from_its_row():
    """block_start: blocks read block_tokens rows of acts [P, K] from their own start (a multiple of 8, not of the
    block); the output keeps the block layout, the empty block's columns unwritten."""
    rng = np.random.default_rng(41)
    _, block_expert, w, scales = operands(rng, 3, 256, 256, [2, 3, 0], False, 32)
    acts = jnp.asarray(rng.standard_normal((70, 256)), jnp.bfloat16)
    block_start = jnp.asarray([8, 0, 32], jnp.int32)            # multiples of START_MULTIPLE, not of 32 tokens
    out = interpret(MM.int4_block_matmul, acts, block_expert, w, scales, None, block_start, a_in_shared=True,
                    out_dtype=jnp.float32, config=MM.MgpuMatmulConfig(ctas=2, block_tokens=32, stages=2))
    want = MM.int4_block_matmul_reference(acts, block_expert, w, scales, None, block_start, block_tokens=32)
    written = np.r_[0:32, 64:96]
    assert rel_err(np.asarray(out)[:, written], np.asarray(want)[:, written]) < 1e-5
    assert np.isnan(np.asarray(out)[:, 32:64]).all()
    rows_of_block_2 = np.asarray(acts[32:64], np.float32)           # the reference itself reads rows 32..63
    group = np.arange(w.shape[2]) // 256 * 8 + np.arange(w.shape[2]) % 8              # position p's scale group
    dequant = np.asarray(w[0].astype(jnp.float32)) * np.asarray(scales[0], np.float32).T[:, group]
    dequant = np.asarray(jnp.asarray(dequant, jnp.bfloat16), np.float32)
    assert rel_err(np.asarray(want)[:, 64:96], dequant @ rows_of_block_2.T) < 1e-5


@pytest.mark.parametrize("tokens,experts,block_tokens", [(37, 6, 32), (200, 16, 64), (5, 40, 128)])
def test_runs_by_expert_give_each_block_its_tokens(tokens, experts, block_tokens):
    """The rows int4_moe_mgpu's gate_up reads: from each non-empty block's start (a multiple of START_MULTIPLE, in
    bounds) its real rows are the block's tokens, as `route_pairs` puts them in block order; ids of other devices
    included."""
    from pallas_kernels.int4_moe import route_pairs
    rng = np.random.default_rng(tokens + experts)
    ids = jnp.asarray(rng.integers(-1, experts + 1, (tokens, 4)), jnp.int32)
    routing = route_pairs(ids, jnp.ones(ids.shape, jnp.float32), experts, block_tokens)
    rows, start = map(np.asarray, MOE.runs_by_expert(routing, ids.shape[1], block_tokens))
    block_expert, block_token = np.asarray(routing.block_expert), np.asarray(routing.block_token)
    for b in np.flatnonzero(block_expert < experts):
        assert start[b] % MM.START_MULTIPLE == 0 and start[b] + block_tokens <= rows.size
        real = block_token[b] < tokens
        np.testing.assert_array_equal(rows[start[b]:start[b] + block_tokens][real], block_token[b][real])


def test_cluster_takes_adjacent_row_tiles():
    """A cluster of two CTAs over N = 512 (four row tiles: each cluster step takes two adjacent ones), both output
    layouts: every written column equals the reference, the empty block's stay unwritten."""
    rng = np.random.default_rng(31)
    args = operands(rng, 3, 512, 256, [2, 3, 0], False, 64)
    config = MM.MgpuMatmulConfig(ctas=2, cluster=2, block_tokens=64, stages=2)
    for tokens_major_out in (False, True):
        out = interpret(MM.int4_block_matmul, *args, a_in_shared=True, out_dtype=jnp.float32, config=config,
                        tokens_major_out=tokens_major_out)
        out = np.asarray(out) if tokens_major_out else np.asarray(out).T
        want = np.asarray(MM.int4_block_matmul_reference(*args, block_tokens=64)).T
        written = np.r_[0:64, 128:192]
        assert rel_err(out[written], want[written]) < 1e-5
        assert np.isnan(out[64:128]).all()


def test_int4_moe_lowers_for_h200_at_k26_shapes():
    """The whole op at M = 4096 with K2.6's 384 experts (D 7168, I 2048, top-8), as the benchmark times it (its
    combine through XLA's Triton custom call, which lowers on the CPU; jax-triton's needs the GPU)."""
    gate = (spec((384, 2048, 7168 // 8), jnp.int32), spec((384, 224, 2048), jnp.bfloat16))
    experts = Int4Experts(*gate, *gate, spec((384, 7168, 2048 // 8), jnp.int32), spec((384, 64, 7168), jnp.bfloat16))
    text = lower_for_h200(functools.partial(MOE.int4_moe, combine="xla"), spec((4096, 7168), jnp.bfloat16), experts,
                          spec((4096, 8), jnp.int32), spec((4096, 8), jnp.float32))
    assert text.count("mosaic_gpu") >= 2 and "_weighted_combine_kernel" in text


def test_ops_runs_the_mosaic_gpu_op_for_dense_gemms():
    """ops.int4_moe_backend at K2.6 (E 384, top-8): Mosaic GPU from 40 pairs per expert (M >= 1920) with bf16 x,
    Triton below and for f32 x (the GPU test runs both through ops.int4_moe); under expert parallelism the routing's
    expert count, not the device's, gives the pairs per expert."""
    gate = (spec((384, 2048, 7168 // 8), jnp.int32), spec((384, 224, 2048), jnp.bfloat16))
    experts = Int4Experts(*gate, *gate, spec((384, 7168, 2048 // 8), jnp.int32), spec((384, 64, 7168), jnp.bfloat16))
    backend = lambda m, dtype=jnp.bfloat16: ops.int4_moe_backend(spec((m, 7168), dtype), experts,
                                                                 spec((m, 8), jnp.int32))
    assert [backend(m) for m in (1, 1024, 1919, 1920, 4096)] == ["triton"] * 3 + ["mosaic_gpu"] * 2
    assert backend(4096, jnp.float32) == "triton"
    local = experts._replace(**{f: spec((48, *getattr(experts, f).shape[1:]), getattr(experts, f).dtype)
                                for f in Int4Experts._fields})          # one device's 48 of 384 (expert parallel)
    ids = spec((1024, 8), jnp.int32)
    assert ops.int4_moe_backend(spec((1024, 7168), jnp.bfloat16), local, ids) == "mosaic_gpu"      # pairs overcounted
    assert ops.int4_moe_backend(spec((1024, 7168), jnp.bfloat16), local, ids, routed_experts=384) == "triton"


def test_ops_picks_each_kernels_tiling_from_the_routed_experts(monkeypatch):
    """ops' int4_moe kernel gives both kernels the tiling for the routing's expert count (one device's 48 of 384
    under expert parallelism: 1024 tokens are 21 pairs per routed expert, not 171), never below the device's own
    count; the Mosaic GPU op needs bf16 x and I, D in whole 128-row tiles (`fits`)."""
    calls = []
    monkeypatch.setattr(ops._int4_moe_triton, "int4_moe", lambda *a, config, interpret: calls.append(config))
    monkeypatch.setattr(ops._int4_moe_mgpu, "int4_moe", lambda *a, config: calls.append(config))
    local = Int4Experts(spec((48, 2048, 7168 // 8), jnp.int32), spec((48, 224, 2048), jnp.bfloat16),
                        spec((48, 2048, 7168 // 8), jnp.int32), spec((48, 224, 2048), jnp.bfloat16),
                        spec((48, 7168, 2048 // 8), jnp.int32), spec((48, 64, 7168), jnp.bfloat16))
    x, ids, w = spec((1024, 7168), jnp.bfloat16), spec((1024, 8), jnp.int32), spec((1024, 8), jnp.float32)
    ops._int4_moe_kernel(x, local, ids, w, interpret=False, routed_experts=384)
    ops._int4_moe_kernel(x, local, ids, w, interpret=False, routed_experts=None)
    ops._int4_moe_kernel(x, local, ids, w, interpret=False, routed_experts=8)          # fewer than held: 48
    assert calls[0] == MT.default_config(8192, 384)
    assert calls[1] == MM.MgpuMatmulConfig(block_tokens=96) and calls[2] == calls[1]    # 171 pairs per expert
    assert MOE.fits(x, local)
    odd = local._replace(gate_packed=spec((48, 2112, 7168 // 8), jnp.int32))            # I = 2112: 16.5 tiles
    assert not MOE.fits(x, odd) and ops.int4_moe_backend(spec((8192, 7168), jnp.bfloat16), odd,
                                                         spec((8192, 8), jnp.int32)) == "triton"


def test_int4_moe_lowers_inside_expert_parallel():
    """The op as each device runs it under expert parallelism (tp=2: 192 of K2.6's 384 experts, every token, ids
    shifted, the outputs psummed; the tiling for the routing's 384): inside the model's shard_map with its varying
    axes checked, both Mosaic GPU kernels and the Triton combine lower for an abstract 2 x H200 mesh."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from kdtree_jax.model.parallel import expert_parallel
    from triton_h200 import h200_mesh

    mesh = h200_mesh((1, 2), ("data", "tp"))
    arg = lambda shape, dtype, part=P(): jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, part))
    gate = (arg((384, 2048, 7168 // 8), jnp.int32, P("tp")), arg((384, 224, 2048), jnp.bfloat16, P("tp")))
    experts = Int4Experts(*gate, *gate, arg((384, 7168, 2048 // 8), jnp.int32, P("tp")),
                          arg((384, 64, 7168), jnp.bfloat16, P("tp")))
    local = lambda x, e, i, w: MOE.int4_moe(x, e, i, w, combine="xla", config=MOE.default_config(i.size, 384))
    text = lower_for_h200(lambda *a: expert_parallel(local, *a), arg((4096, 7168), jnp.bfloat16), experts,
                          arg((4096, 8), jnp.int32), arg((4096, 8), jnp.float32), mesh=mesh)
    assert text.count("custom_call @mosaic_gpu") == 2 and "_weighted_combine_kernel" in text and "all_reduce" in text


@pytest.mark.parametrize("bad,match", [
    (dict(w=spec((2, 128, 256), jnp.int8)), "w must be int4"),
    (dict(scales=spec((2, 8, 128), jnp.float32)), "scales must be bfloat16"),
    (dict(acts=spec((128, 512), jnp.bfloat16)), "acts must be bfloat16"),
])
def test_bad_operands_are_refused(bad, match):
    args = dict(acts=spec((2 * MM.TOKENS, 256), jnp.bfloat16), block_expert=spec((2,), jnp.int32),
                w=spec((2, 128, 256), jnp.int4), scales=spec((2, 8, 128), jnp.bfloat16))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(MM.int4_block_matmul, *args.values())
    with pytest.raises(ValueError, match="tile_k"):
        MM.MgpuMatmulConfig(tile_k=48)
    with pytest.raises(ValueError, match="block_tokens"):
        MM.MgpuMatmulConfig(block_tokens=48)
    with pytest.raises(ValueError, match="rows_per_wg"):
        MM.MgpuMatmulConfig(rows_per_wg=96)
    with pytest.raises(ValueError, match="cluster"):
        MM.MgpuMatmulConfig(cluster=4)
    with pytest.raises(ValueError, match="rows per tile"):      # N = 128 rows, tiles of 256
        jax.eval_shape(functools.partial(MM.int4_block_matmul, config=MM.MgpuMatmulConfig(rows_per_wg=128)),
                       spec((2 * MM.TOKENS, 256), jnp.bfloat16), spec((2,), jnp.int32),
                       spec((2, 128, 256), jnp.int4), spec((2, 8, 128), jnp.bfloat16))
