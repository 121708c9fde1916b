"""The GPU kernels compiled on the GPU at Kimi K2.6 shapes == their references (skipped elsewhere): tree-verify
attention (Triton, Mosaic GPU, and the op that picks), tree build and accept (Triton, through every launcher),
int4_moe (Triton, through every launcher, also chained in one jit).

Run on the H200 through the device tool: `PYTHONPATH=. python3 -m pytest -q tests/test_kernels_gpu.py` (int4_moe
needs the jax-triton wheel, BUILD_NOTES). The CPU suite covers the Mosaic GPU kernel in interpret mode and the Triton
ones in Triton's interpreter (outputs poisoned before the call), and compiles the Triton ones for sm_90; here a
compiled kernel cannot be poisoned, so the attention and MoE cases check finiteness and the relative error against the pure-JAX reference on
fresh random inputs, and the tree kernels are compared bit for bit with the python specifications.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdtree_jax import config as config_lib
from pallas_kernels import tree as T
from kdtree_jax.model.moe import random_int4_experts
from pallas_kernels import ops
from pallas_kernels import int4_matmul_mgpu as MM
from pallas_kernels import int4_moe as M
from pallas_kernels import int4_moe_mgpu as MMOE
from pallas_kernels import int4_moe_triton as MT
from pallas_kernels import router_topk as RT
from pallas_kernels import skinny_matmul as SM
from pallas_kernels import tree_triton as TT
from pallas_kernels.triton_call import LAUNCHERS
from pallas_kernels import tree_verify_attention_mgpu as AM
from pallas_kernels import tree_verify_attention as A
from pallas_kernels import tree_verify_attention_triton as AT
from conftest import assert_topk_matches_reference, random_targets, rel_err
from test_attention_kernel import BF16_TOL, make_inputs
from test_int4_matmul_mgpu import operands as mgpu_operands
from test_tree_triton_interpreter import assert_same, random_draft

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Pallas kernels need the GPU")

K26 = config_lib.kimi_k2_6()


@pytest.mark.parametrize("kernel", [AT.tree_verify_attention, AM.tree_verify_attention, ops.tree_verify_attention],
                         ids=["triton", "mosaic_gpu", "ops"])
@pytest.mark.parametrize("heads,nodes", [(8, 1), (8, 16), (8, 64), (64, 1), (64, 16)])
def test_attention_bf16_k26(kernel, heads, nodes):
    """Default tiling, bf16 inputs, 3 streams with ragged prefixes over a 4096-row cache; per stream against the
    reference rounded to bf16, to test_attention_kernel.BF16_TOL. The Triton kernel (XLA's launcher), the Mosaic GPU
    one (T x H rows padded to 64-row tiles) and the op (Mosaic GPU from 64 rows, Triton below)."""
    rng = np.random.default_rng(heads * 1000 + nodes)
    inputs = make_inputs(rng, 3, nodes, heads, K26.kv_lora_rank, K26.qk_rope_head_dim, 4096, dtype=jnp.bfloat16)
    out = kernel(*inputs, scale=K26.softmax_scale)
    ref = A.tree_verify_attention_reference(*inputs, scale=K26.softmax_scale)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    errors = [rel_err(out[s], ref[s]) for s in range(3)]
    assert max(errors) < BF16_TOL, errors


@pytest.mark.skipif(jax.device_count() < 2, reason="the head-parallel mesh needs 2 or more GPUs (nvidia-h200-x2)")
@pytest.mark.parametrize("local_heads,nodes,backend", [(8, 1, "triton"), (8, 16, "mosaic_gpu"), (8, 64, "mosaic_gpu"),
                                                       (64, 1, "mosaic_gpu")])
def test_attention_under_head_parallel_mesh(local_heads, nodes, backend):
    """The op as the model calls it under tp = every local GPU (`parallel.head_parallel`, the plan from
    `parallel.attention_plan`): each device runs the kernel `backend` for its local_heads heads (K2.6 at tp=8: 8)
    over the replicated 4096-row cache, its output stays split on heads, and each stream == the one-device reference
    to BF16_TOL (2 streams, ragged prefixes, fresh inputs)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from kdtree_jax import sharding
    from kdtree_jax.model import parallel

    tp = jax.device_count()
    heads = local_heads * tp
    rng = np.random.default_rng(heads * 10 + nodes)
    inputs = make_inputs(rng, 2, nodes, heads, K26.kv_lora_rank, K26.qk_rope_head_dim, 4096, dtype=jnp.bfloat16)
    local_q = [x[:, :, :local_heads] for x in inputs[:2]]
    assert ops.attention_backend(*local_q, *inputs[2:4]) == backend
    mesh = sharding.make_mesh(tp=tp)
    per_head = NamedSharding(mesh, P(None, None, sharding.TP, None))
    attention = functools.partial(ops.tree_verify_attention, scale=K26.softmax_scale)

    def sharded(q_lat, q_rope, c_kv, k_rope, prefix_len, visible):
        plan = parallel.attention_plan(prefix_len, visible, heads)
        return parallel.head_parallel(attention, q_lat, q_rope, c_kv, k_rope, prefix_len, visible, plan)

    with jax.set_mesh(mesh):
        args = [jax.device_put(x, per_head) for x in inputs[:2]] + [jax.device_put(x, NamedSharding(mesh, P()))
                                                                     for x in inputs[2:]]
        step = jax.jit(sharded)
        kernel_names = step.lower(*args).as_text()
        out = step(*args)
    assert ("tree_verify_attention_mgpu" in kernel_names) == (backend == "mosaic_gpu")
    assert out.sharding.spec == per_head.spec and len(out.addressable_shards) == tp
    ref = A.tree_verify_attention_reference(*inputs, scale=K26.softmax_scale)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    errors = [rel_err(out[s], ref[s]) for s in range(2)]
    assert max(errors) < BF16_TOL, errors


@pytest.mark.parametrize("heads,nodes,streams,splits", [(64, 1, 1, None), (8, 16, 1, None), (8, 1, 2, None),
                                                          (64, 4, 2, 16), (8, 16, 1, 3)])
def test_attention_mgpu_combine_in_kernel(heads, nodes, streams, splits):
    """The Mosaic GPU kernel joining its own split-K partials (semaphores; one wave of programs) == the reference and
    == the same kernel with the separate combine, over a 32768-row cache (decode shapes: 3 to 132 splits; with two
    streams one prefix is 0, so most of its splits attend nothing), fresh inputs each call; a second call on other
    inputs also matches (its semaphores start from zero again)."""
    rng = np.random.default_rng(heads * 100 + nodes * 10 + streams)
    inputs = make_inputs(rng, streams, nodes, heads, K26.kv_lora_rank, K26.qk_rope_head_dim, 32768,
                         dtype=jnp.bfloat16)
    run = functools.partial(AM.tree_verify_attention, *inputs, scale=K26.softmax_scale, num_splits=splits)
    fused, separate = run(combine_in_kernel=True), run(combine_in_kernel=False)
    ref = A.tree_verify_attention_reference(*inputs, scale=K26.softmax_scale)
    assert np.isfinite(np.asarray(fused, np.float32)).all()
    assert max(rel_err(fused[s], ref[s]) for s in range(streams)) < BF16_TOL
    assert rel_err(fused, separate) < 1e-2      # both round the same bf16 partials; they differ in the last bits
    again = make_inputs(rng, streams, nodes, heads, K26.kv_lora_rank, K26.qk_rope_head_dim, 32768,
                        dtype=jnp.bfloat16)
    second = AM.tree_verify_attention(*again, scale=K26.softmax_scale, num_splits=splits, combine_in_kernel=True)
    assert rel_err(second, A.tree_verify_attention_reference(*again, scale=K26.softmax_scale)) < BF16_TOL


@pytest.mark.parametrize("heads,nodes,streams,prefix,tiles", [(8, 16, 1, 32768, 2), (8, 64, 2, 4096, 2),
                                                                (8, 64, 1, 4096, 4), (64, 16, 1, 4096, 2)])
def test_attention_mgpu_multicast_tiles(heads, nodes, streams, prefix, tiles):
    """Clusters of `tiles` query tiles of a split, each cache block loaded once for all by TMA multicast: == the
    reference, and bit for bit the kernel without clusters (the same arithmetic on the same bytes), at the default
    split count (66 splits at H=8 N=32768 T=16), fresh inputs."""
    rng = np.random.default_rng(heads * 100 + nodes * 10 + tiles)
    inputs = make_inputs(rng, streams, nodes, heads, K26.kv_lora_rank, K26.qk_rope_head_dim, prefix,
                         dtype=jnp.bfloat16)
    multicast = AM.tree_verify_attention(*inputs, scale=K26.softmax_scale, multicast_tiles=tiles)
    plain = AM.tree_verify_attention(*inputs, scale=K26.softmax_scale, multicast_tiles=1)
    ref = A.tree_verify_attention_reference(*inputs, scale=K26.softmax_scale)
    assert max(rel_err(multicast[s], ref[s]) for s in range(streams)) < BF16_TOL
    np.testing.assert_array_equal(np.asarray(multicast, np.float32), np.asarray(plain, np.float32))


@pytest.mark.parametrize("config", [A.AttentionConfig(block_q=16, block_k=16, num_splits=1),
                                    A.AttentionConfig(block_q=16, block_k=16, num_splits=4), None],
                         ids=["small_tiles", "small_tiles_4_splits", "default"])
def test_attention_f32_k26(config):
    """f32 inputs (IEEE dots) through the Triton kernel (the op's kernel for f32), split-K off and on; small tiles,
    and the default tiling (run with cache blocks of 32 rows and one stage for shared memory)."""
    rng = np.random.default_rng(config.num_splits if config else 0)
    inputs = make_inputs(rng, 4, 16, 8, K26.kv_lora_rank, K26.qk_rope_head_dim, 1024)
    out = AT.tree_verify_attention(*inputs, scale=K26.softmax_scale, config=config)
    assert rel_err(out, A.tree_verify_attention_reference(*inputs, scale=K26.softmax_scale)) < 1e-5


@pytest.mark.parametrize("splits", [2, 16, 66, 256])
@pytest.mark.parametrize("normalized,dtype", [(False, jnp.float32), (True, jnp.bfloat16)], ids=["triton", "mosaic"])
def test_attention_combine_kernel(splits, normalized, dtype):
    """The split-K combine kernel at 2 to 256 splits, on both kernels' partial formats (decode shapes: 8 and 128 rows
    of 512 columns), against XLA's combine_partials."""
    from pallas_kernels import tree_verify_attention_combine as AC
    from pallas_kernels.triton_call import bound_to

    call = bound_to(AC.LAUNCHER, interpret=False, op="test", reference="-")
    rows, rng = (128 if normalized else 8), np.random.default_rng(splits)
    empty = rng.random((splits, 1, rows)) < 0.25                   # splits a short prefix leaves empty for a row
    empty_max = -np.inf if normalized else A.NEG_INF                # as the Mosaic GPU / the Triton kernel write it
    args = (jnp.asarray(np.where(empty[..., None], 0.0, rng.standard_normal((splits, 1, rows, 512))), dtype),
            jnp.asarray(np.where(empty, empty_max, 3 * rng.standard_normal((splits, 1, rows))), jnp.float32),
            jnp.asarray(np.where(empty, 0.0, rng.uniform(0.5, 4.0, (splits, 1, rows))), jnp.float32))
    got = jax.jit(lambda *a: AC.combine(call, *a, rows=rows, cols=512, dtype=jnp.float32,
                                        normalized=normalized))(*args)
    want = A.combine_partials(*args, normalized=normalized)[:, :rows]
    assert np.isfinite(np.asarray(got)).all() and rel_err(got, want) < 1e-5


@pytest.fixture(scope="module")
def k26_experts():
    return random_experts(K26)


def random_experts(cfg):
    """cfg's random INT4 routed experts (K2.6: 384 of D 7168, I 2048) with random per-group scales."""
    experts = random_int4_experts(nnx.Rngs(0), cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                  cfg.quant_group_size)
    keys = jax.random.split(jax.random.key(1), 3)
    factors = {name: jax.random.uniform(k, getattr(experts, name).shape, minval=0.5, maxval=1.5)
               for name, k in zip(("gate_scale", "up_scale", "down_scale"), keys)}
    return experts._replace(**{name: (getattr(experts, name) * f).astype(getattr(experts, name).dtype)
                               for name, f in factors.items()})


REFERENCE_MOE = jax.jit(M.int4_moe_reference)     # compiled once per shape, reused by every kernel's case
MEDIUM_BLOCKS, LARGE_BLOCKS = (MT.default_config(8 * m, K26.num_experts) for m in (1024, 4096))
SPLIT_K = MT.TritonMoeConfig(block_m=16, block_n=64, words=32, num_stages=3, down_block_n=128, gate_up_splits=4)
UNGROUPED = dataclasses.replace(LARGE_BLOCKS, group_by_block=False, down_num_stages=None)
FMA = MT.TritonMoeConfig(block_m=1, block_n=32, fma=True, gate_up_splits=2, down_block_n=64)


def test_int4_moe_code_target_shapes():
    """I = 128 (the code target's experts): the gate_up grid covers 256 rows of h, past I; those rows must not read
    the next expert's weights (an unrouted expert's scales are NaN)."""
    cfg = config_lib.code_target()
    experts = random_experts(cfg)
    experts = experts._replace(gate_scale=experts.gate_scale.at[-1].set(jnp.nan))
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(0, cfg.num_experts - 1, (16, cfg.num_experts_per_tok)), jnp.int32)
    weights = jnp.asarray(rng.random(ids.shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((16, cfg.hidden_size)), jnp.bfloat16)
    out = MT.int4_moe(x, experts, ids, weights)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, REFERENCE_MOE(x, experts, ids, weights)) < 1e-2


@pytest.mark.parametrize("kernel", [MT.int4_moe, functools.partial(MT.int4_moe, config=MEDIUM_BLOCKS),
                                    functools.partial(MT.int4_moe, config=LARGE_BLOCKS),
                                    functools.partial(MT.int4_moe, config=SPLIT_K),
                                    functools.partial(MT.int4_moe, config=UNGROUPED),
                                    functools.partial(MT.int4_moe, config=FMA),
                                    functools.partial(MT.int4_moe, launcher="xla"),
                                    functools.partial(MT.int4_moe, launcher="ffi")],
                         ids=["triton", "triton_medium_blocks", "triton_large_blocks", "triton_split_k",
                              "triton_large_blocks_ungrouped_3_stages", "triton_fma", "triton_xla_launch",
                              "triton_ffi_launch"])
@pytest.mark.parametrize("tokens,dtype,tol", [(1, jnp.bfloat16, 1e-2), (16, jnp.bfloat16, 1e-2),
                                              (16, jnp.float32, 1e-5)])
def test_int4_moe_k26(k26_experts, kernel, tokens, dtype, tol):
    """top-8 routing with repeated experts and ids of other devices (out of range), as under expert parallelism."""
    rng = np.random.default_rng(tokens)
    ids = rng.integers(0, K26.num_experts, (tokens, K26.num_experts_per_tok))
    ids[:, 1] = ids[:, 0]
    ids[rng.random(ids.shape) < 0.2] = K26.num_experts + 5
    ids, weights = jnp.asarray(ids, jnp.int32), jnp.asarray(rng.random(ids.shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((tokens, K26.hidden_size)), dtype)
    out = kernel(x, k26_experts, ids, weights)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, REFERENCE_MOE(x, k26_experts, ids, weights)) < tol


@pytest.mark.parametrize("launcher", ["jax_triton", "ffi"])
def test_int4_moe_chained_in_one_jit(k26_experts, launcher):
    """Four int4_moe calls, each fed the previous output through a fusion, in one jitted function (where XLA may put
    the "ffi" launches into a command buffer with the fusions), called three times (the first execution of a command
    buffer runs its thunks one by one; later ones replay the recorded graph): equal to the reference chain each time."""
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(0, K26.num_experts, (8, 4, K26.num_experts_per_tok)), jnp.int32)
    weights = jnp.asarray(rng.random(ids.shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, K26.hidden_size)), jnp.bfloat16)

    def chain(moe, x, experts, ids, weights):     # every array an argument: closed-over ones would be constants
        for i in range(4):
            x = moe(x * 0.5 + 1.0, experts, ids[:, i], weights[:, i]).astype(x.dtype)
        return x

    kernel_chain = jax.jit(functools.partial(chain, functools.partial(MT.int4_moe, launcher=launcher)))
    reference_chain = jax.jit(functools.partial(chain, M.int4_moe_reference))
    for call in range(3):
        x = x + call
        out, want = kernel_chain(x, k26_experts, ids, weights), reference_chain(x, k26_experts, ids, weights)
        assert np.isfinite(np.asarray(out, np.float32)).all()
        assert rel_err(out, want) < 2e-2, call


@pytest.mark.parametrize("acts_k_major,n,k,tokens,cluster", [
    (False, 4096, 7168, 128, 1), (True, 7168, 2048, 128, 1), (False, 4096, 7168, 96, 1), (True, 7168, 2048, 64, 1),
    (False, 4096, 7168, 128, 2), (True, 7168, 2048, 128, 2)],
    ids=["gate_up", "down", "gate_up_96_tokens", "down_64_tokens", "gate_up_cluster_of_2", "down_cluster_of_2"])
def test_int4_block_matmul_mgpu(acts_k_major, n, k, tokens, cluster):
    """The Mosaic GPU block matmul with A from registers (the path interpret mode cannot run) at K2.6's gate_up and
    down shapes (down as int4_moe_mgpu runs it: y tokens-major, 128 rows per warpgroup; clusters of two CTAs with
    the activation tile multicast), 8 experts, 6 blocks (one empty): the written columns against the f32
    reference."""
    args = mgpu_operands(np.random.default_rng(n + tokens), 8, n, k, [3, 0, 8, 7, 3, 1], acts_k_major, tokens)
    config = MM.MgpuMatmulConfig(block_tokens=tokens, rows_per_wg=128 if acts_k_major else 64, cluster=cluster)
    out = MM.int4_block_matmul(*args, acts_k_major=acts_k_major, tokens_major_out=acts_k_major, config=config)
    want = MM.int4_block_matmul_reference(*args, acts_k_major=acts_k_major, block_tokens=tokens)
    out = np.asarray(out, np.float32).T if acts_k_major else np.asarray(out, np.float32)
    written = np.r_[0:2 * tokens, 3 * tokens:6 * tokens]
    assert rel_err(out[:, written], np.asarray(want)[:, written]) < 1e-2


@pytest.mark.parametrize("tokens", [64, 1024])
def test_int4_moe_mgpu_k26(k26_experts, tokens):
    """int4_moe through the Mosaic GPU block matmul on the Triton kernels' weights (K2.6's experts) against the
    reference (ids of other devices included)."""
    rng = np.random.default_rng(tokens)
    ids = jnp.asarray(rng.integers(-1, K26.num_experts + 1, (tokens, K26.num_experts_per_tok)), jnp.int32)
    weights = jnp.asarray(rng.random(ids.shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((tokens, K26.hidden_size)), jnp.bfloat16)
    out = MMOE.int4_moe(x, k26_experts, ids, weights)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out[:32], REFERENCE_MOE(x[:32], k26_experts, ids[:32], weights[:32])) < 2e-2


def test_ops_int4_moe_runs_mosaic_gpu_for_dense_gemms(k26_experts):
    """ops.int4_moe at M = 2304 (48 pairs per expert: the Mosaic GPU op, `int4_moe_backend`) against the reference
    on the first 32 tokens."""
    rng = np.random.default_rng(2304)
    ids = jnp.asarray(rng.integers(0, K26.num_experts, (2304, K26.num_experts_per_tok)), jnp.int32)
    weights = jnp.asarray(rng.random(ids.shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2304, K26.hidden_size)), jnp.bfloat16)
    assert ops.int4_moe_backend(x, k26_experts, ids) == "mosaic_gpu"
    out = jax.jit(ops.int4_moe)(x, k26_experts, ids, weights)
    assert rel_err(out[:32], REFERENCE_MOE(x[:32], k26_experts, ids[:32], weights[:32])) < 2e-2


@pytest.mark.parametrize("budget", [16, 512])
def test_tree_build_and_accept_k26(budget):
    """16 streams, L = 16, V = 163840 (half of them with tied log-probs): draft_topk gives the float64 reference
    top-K, the Triton build kernel (through every launcher) from that top-K the heapq specification's arrays and
    the accept kernels the python walk's, bit for bit."""
    rng = np.random.default_rng(budget)
    logits, root = random_draft(rng, 16, 16, K26.vocab_size)
    k = T.resolve_topk(budget, K26.vocab_size)
    assert_topk_matches_reference(logits[:8], k, T.draft_topk(jnp.asarray(logits[:8]), k), exact_ids=False)
    assert_topk_matches_reference(logits[8:], k, T.draft_topk(jnp.asarray(logits[8:]), k), exact_ids=True)
    want = T.build_tree_heapq(logits, root, budget)
    top = T.reference_topk(logits, k)
    for launcher in LAUNCHERS:
        got = TT.tree_build_from_topk(*map(jnp.asarray, top), jnp.asarray(root), budget=budget, launcher=launcher)
        assert_same(got, want, T.TreeArrays._fields)
    target = random_targets(rng, want, K26.vocab_size, hit_rate=0.7)
    tree = T.TreeArrays(*map(jnp.asarray, want))
    for launcher in LAUNCHERS:
        assert_same(TT.tree_accept(tree, jnp.asarray(target), 15, launcher=launcher),
                    T.accept_tree_python(want, target, 15), T.AcceptResult._fields)


@pytest.mark.parametrize("rows,k,n,norm,residual,dtype", [
    (1, 7168, 1536, True, False, jnp.bfloat16), (9, 7168, 576, False, False, jnp.bfloat16),
    (33, 1024, 7168, False, True, jnp.bfloat16), (64, 7168, 256, True, False, jnp.bfloat16),
    (1, 7168, 384, False, False, jnp.float32), (9, 512, 16896, True, True, jnp.bfloat16)])
def test_skinny_matmul_k26_share(rows, k, n, norm, residual, dtype):
    """skinny_matmul at the tp=8 share's shapes (q_a with its norm, kv_a, o_proj with the residual, the shared
    expert, the f32 router; and one product without split-K, the norm and the residual in its one kernel) == the
    reference, and the last row's result bitwise the same computed alone and as row 8 of 9 (another M, another
    place in the tile)."""
    rng = np.random.default_rng(rows * n)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n, k)) * k ** -0.5, dtype)
    kw = dict(norm_weight=jnp.asarray(1 + 0.1 * rng.standard_normal(k), dtype) if norm else None,
              residual=jnp.asarray(rng.standard_normal((rows, n)), dtype) if residual else None)
    got = SM.skinny_matmul(x, w, **kw)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert rel_err(got, SM.skinny_matmul_reference(x, w, **kw)) < (1e-5 if dtype == jnp.float32 else 1e-2)
    last = lambda a: None if a is None else a[-1:]
    others = lambda a, cols: None if a is None else jnp.concatenate(
        [jnp.asarray(rng.standard_normal((8, cols)), dtype), a[-1:]])
    alone = SM.skinny_matmul(x[-1:], w, **dict(kw, residual=last(kw["residual"])))
    ninth = SM.skinny_matmul(others(x, k), w, **dict(kw, residual=others(kw["residual"], n)))
    for row in (alone[0], ninth[8]):
        np.testing.assert_array_equal(np.asarray(row, np.float32), np.asarray(got[-1], np.float32))


def forward_off_and_on(cfg, switch, seed: int) -> dict:
    """{False: logits, True: logits} of a random model of cfg on random tokens [2, 7], at highest matmul precision,
    with `switch` (an `ops.set_*_kernel`) off and on; left off after."""
    from kdtree_jax.model.transformer import Transformer

    model = Transformer(cfg, nnx.Rngs(seed))
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
    logits = {}
    for on in (False, True):
        switch(on)
        try:
            with jax.default_matmul_precision("highest"):
                logits[on] = nnx.jit(lambda m, t: m.causal(t).logits)(model, tokens)
        finally:
            switch(False)
    assert np.isfinite(np.asarray(logits[True])).all()
    return logits


@pytest.mark.parametrize("dtype, first_k_dense, tol", [("float32", 1, 1e-4), ("bfloat16", 8, 2e-2)])
def test_dense_kernel_forward_matches_xla(dtype, first_k_dense, tol):
    """The code target widened to hidden 512 (so that q_a, kv_a, the shared expert's gate and up, the router and the
    lm_head with the final norm reach `ops.dense_takes`' K >= 512) with its dense products through skinny_matmul
    (`ops.set_dense_kernel(True)`) == with XLA's: in f32 at highest precision with its MoE layers, and in bf16 with
    every layer dense (in bf16 a rounding flips the random router's top-k, and the logits with it: 0.18 apart on
    the H100 with MoE layers)."""
    cfg = dataclasses.replace(config_lib.preset("code_target"), hidden_size=512, dtype=dtype,
                              first_k_dense=first_k_dense)
    logits = forward_off_and_on(cfg, ops.set_dense_kernel, 3)
    assert rel_err(logits[True], logits[False]) < tol


@pytest.mark.parametrize("rows", [1, 264])
def test_router_topk_k26(rows):
    """K2.6's router after its product (384 experts, top 8, scaled by 2.827) at AR and a B=32 verify of 8 streams ==
    the reference (the same ids but where the 8th and 9th choices lie within the sigmoids' rounding; weights to that
    rounding), the last row bitwise the same alone."""
    rng = np.random.default_rng(rows)
    logits = jnp.asarray(2.0 * rng.standard_normal((rows, 384)), jnp.float32)
    bias = jnp.asarray(0.3 * rng.standard_normal(384), jnp.float32)
    ids, weights = RT.router_topk(logits, bias, 8, scale=2.827)
    want_ids, want_weights = RT.router_topk_reference(logits, bias, 8, scale=2.827)
    choice = np.sort(np.asarray(jax.nn.sigmoid(logits) + bias), axis=1)[:, ::-1]
    near_tie = np.abs(choice[:, 7] - choice[:, 8]) < 1e-5      # the sigmoids' rounding may order these two apart
    differ = (np.asarray(ids) != np.asarray(want_ids)).any(axis=1)
    assert not (differ & ~near_tie).any(), np.flatnonzero(differ & ~near_tie)
    assert rel_err(weights[~differ], want_weights[~differ]) < 1e-6
    alone_ids, alone_weights = RT.router_topk(logits[-1:], bias, 8, scale=2.827)
    np.testing.assert_array_equal(np.asarray(alone_ids[0]), np.asarray(ids[-1]))
    np.testing.assert_array_equal(np.asarray(alone_weights[0]), np.asarray(weights[-1]))


def test_router_kernel_forward_matches_xla():
    """The code target (f32, highest precision) with its routers through router_topk (`ops.set_router_kernel(True)`)
    == with XLA's ops."""
    cfg = dataclasses.replace(config_lib.preset("code_target"), dtype="float32")
    logits = forward_off_and_on(cfg, ops.set_router_kernel, 4)
    assert rel_err(logits[True], logits[False]) < 1e-5


def test_exact_mode_forward_through_the_kernels():
    """The exact mode's forward on the GPU, its products as single skinny_matmul calls and its head products,
    attention and routed experts as batch_invariant_triton's kernels: chain and tree nodes of three streams bitwise
    == the AR steps along their paths, and a stream alone == the batch (test_exact's check, on the code target)."""
    from test_exact import test_a_rows_results_do_not_depend_on_its_block_or_batch as rows_check

    x = jnp.zeros((3, 256), jnp.bfloat16)
    assert ops.exact_dense_takes(x, x.T) and ops.exact_kernels_take(x)
    rows_check("code_target", (21, 6, 14))


@pytest.mark.parametrize("streams,nodes,heads,lat,rope,capacity,dtype", [
    (8, 33, 8, 512, 64, 4096, jnp.bfloat16),     # the tp=8 share's heads, a B=32 verify of 8 streams
    (2, 9, 64, 512, 64, 2048, jnp.bfloat16),     # all of K2.6's heads
    (4, 33, 8, 64, 16, 640, jnp.bfloat16),       # the code target
    (2, 17, 8, 512, 64, 1024, jnp.float32),
])
def test_exact_attention_kernel(streams, nodes, heads, lat, rope, capacity, dtype):
    """The exact mode's attention kernel == its reference, and every node of the first and the last stream bitwise
    == the AR step at its position (its path committed to the cache: another prefix, T = 1, one stream): the last
    stream's prefix is N - T, its nodes' keys in several chunks merged; the first's prefix is 0, its nodes' keys in
    the first chunk, and its AR steps also run with a cache of that one chunk (normalised without a merge). Every
    case has two streams or more: make_inputs gives a lone stream the prefix N - T."""
    assert streams >= 2
    from pallas_kernels import batch_invariant as BI
    from pallas_kernels import batch_invariant_triton as BT
    from test_exact_kernels_interpreter import ar_step_of

    rng = np.random.default_rng(nodes * heads + lat)
    inputs = make_inputs(rng, streams=streams, nodes=nodes, heads=heads, lat=lat, rope=rope, capacity=capacity,
                         dtype=dtype)
    scale = lat ** -0.5
    out = BT.attention(*inputs, scale=scale)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    with jax.default_matmul_precision("highest"):     # XLA's f32 dots are TF32 by default on the GPU
        want = BI.attention_reference(*(a.astype(jnp.float32) if a.dtype == dtype else a for a in inputs),
                                      scale=scale)
    assert rel_err(out, want) < (1e-5 if dtype == jnp.float32 else BF16_TOL)
    tree = np.asarray(out.astype(jnp.float32))
    chunk = BT.attention_chunk(lat, dtype)
    for s in sorted({0, streams - 1}):
        for t in range(nodes):
            q_lat, q_rope, c_kv, k_rope, prefix, visible = ar_step_of(inputs, s, t)
            in_first_chunk = int(inputs[4][s]) + nodes <= chunk     # make_inputs: prefix 0 for stream 0 of >= 2
            caches = [(c_kv, k_rope)] + ([(c_kv[:, :chunk], k_rope[:, :chunk])] if in_first_chunk else [])
            for c, r in caches:
                ar = BT.attention(q_lat, q_rope, c, r, prefix, visible, scale=scale)
                np.testing.assert_array_equal(np.asarray(ar.astype(jnp.float32))[0, 0], tree[s, t],
                                              err_msg=f"stream {s} node {t}, AR cache of {c.shape[1]} rows")


@pytest.mark.parametrize("m,k,d,i,experts,dtype", [
    (264, 8, 7168, 2048, 4, jnp.bfloat16),       # K2.6's dims, a B=32 verify of 8 streams on 4 experts
    (264, 2, 256, 128, 16, jnp.bfloat16),        # the code target
    (33, 2, 256, 128, 16, jnp.float32),
])
def test_exact_expert_tiles_kernel(m, k, d, i, experts, dtype):
    """The exact mode's routed-expert kernels == their reference, and the last token's result bitwise the same
    computed alone (its pairs first in their tiles) and among m tokens (its pairs after others of their experts);
    the same for `routed_experts` (int4_moe's routing kernel and combine: what the model runs), which equals the XLA
    layout's result (up to the combine's rounding: an FMA where XLA may multiply and add)."""
    from pallas_kernels import batch_invariant as BI
    from pallas_kernels import batch_invariant_triton as BT
    from pallas_kernels import exact_layout as L
    from test_exact_kernels_interpreter import expert_inputs

    rng = np.random.default_rng(m + d + experts)
    x, stacked, ids, weights = expert_inputs(rng, m, k, d, i, experts, dtype)

    def run(x, ids, weights):
        routing = M.route_pairs(ids, weights, experts, L.PAIR_TILE)
        y = BT.expert_tiles(x, *stacked, routing.block_token, routing.block_expert)
        return L.add_slots(y.reshape(-1, d), routing.pair_row_or_none(), weights)

    out = run(x, ids, weights)
    routed = BT.routed_experts(x, *stacked, ids, weights)
    assert rel_err(routed, out) < 1e-6
    np.testing.assert_array_equal(np.asarray(BT.routed_experts(x[-1:], *stacked, ids[-1:], weights[-1:]))[0],
                                  np.asarray(routed[-1]))
    assert np.isfinite(np.asarray(out)).all()
    f32 = tuple(w.astype(jnp.float32) for w in stacked)
    with jax.default_matmul_precision("highest"):     # XLA's f32 dots are TF32 by default on the GPU
        want = BI.routed_experts(x.astype(jnp.float32), lambda e: tuple(w[e] for w in f32), experts, ids, weights)
    assert rel_err(out, want) < (1e-5 if dtype == jnp.float32 else BF16_TOL)
    alone = run(x[-1:], ids[-1:], weights[-1:])
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(out[-1]))


@pytest.mark.parametrize("rows,heads,k,n,dtype", [(264, 8, 128, 512, jnp.bfloat16), (264, 8, 512, 128, jnp.bfloat16),
                                                  (33, 8, 32, 64, jnp.bfloat16), (9, 8, 128, 512, jnp.float32)])
def test_exact_head_matmul_kernel(rows, heads, k, n, dtype):
    """The exact mode's head products (K2.6's W_UK / W_UV at the share's heads, the code target's W_UK) == the
    reference, and the last row bitwise the same alone (M = 1) as among `rows`."""
    from pallas_kernels import batch_invariant as BI
    from pallas_kernels import batch_invariant_triton as BT

    rng = np.random.default_rng(rows + k)
    x = jnp.asarray(rng.standard_normal((rows, heads, k)), dtype)
    w = jnp.asarray(rng.standard_normal((heads, k, n)) * k ** -0.5, dtype)
    out = BT.head_matmul(x, w)
    with jax.default_matmul_precision("highest"):     # XLA's f32 dots are TF32 by default on the GPU
        want = BI.head_matmul_reference(x.astype(jnp.float32), w.astype(jnp.float32))
    assert rel_err(out, want) < (1e-5 if dtype == jnp.float32 else BF16_TOL)
    np.testing.assert_array_equal(np.asarray(BT.head_matmul(x[-1:], w).astype(jnp.float32)),
                                  np.asarray(out[-1:].astype(jnp.float32)))


@pytest.mark.parametrize("rows,k,dtype", [(264, 7168, jnp.bfloat16), (33, 1536, jnp.bfloat16), (9, 256, jnp.float32)])
def test_exact_rms_norm_kernel(rows, k, dtype):
    """The exact mode's RMSNorm == the reference, and the last row bitwise the same alone as among `rows`."""
    from pallas_kernels import batch_invariant as BI
    from pallas_kernels import batch_invariant_triton as BT

    rng = np.random.default_rng(rows + k)
    x = jnp.asarray(rng.standard_normal((rows, k)) * 3, dtype)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal(k), dtype)
    out = BT.rms_norm(x, g, eps=1e-6)
    with jax.default_matmul_precision("highest"):     # the reference's row sums are products
        want = BI.rms_norm_reference(x.astype(jnp.float32), g, 1e-6)
    assert rel_err(out, want) < (1e-6 if dtype == jnp.float32 else BF16_TOL)
    np.testing.assert_array_equal(np.asarray(BT.rms_norm(x[-1:], g, eps=1e-6).astype(jnp.float32)),
                                  np.asarray(out[-1:].astype(jnp.float32)))


def test_exact_int4_experts():
    """The exact mode's INT4 experts (K2.6's dims, 8 of its experts): int4_moe's kernels at EXACT_INT4_CONFIG ==
    the reference, and the last token's result bitwise the same alone as among 264 tokens (int4_moe's own tiling
    would change with M)."""
    from pallas_kernels import batch_invariant_triton as BT

    cfg = dataclasses.replace(K26, num_experts=8)
    experts = random_experts(cfg)
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((264, cfg.hidden_size)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, 8, (264, 8)), jnp.int32)
    weights = jnp.asarray(rng.random((264, 8)), jnp.float32)
    out = BT.int4_routed_experts(x, experts, ids, weights)
    # the reference gathers each token's experts dequantized in f32 ([rows, 2048, 7168] a slot): 33 rows at a time
    # (264 at once needed 46 GB and ran out of memory on an H100)
    want = jnp.concatenate([M.int4_moe_reference(x[r:r + 33], experts, ids[r:r + 33], weights[r:r + 33])
                            for r in range(0, 264, 33)])
    assert rel_err(out, want) < BF16_TOL
    np.testing.assert_array_equal(np.asarray(BT.int4_routed_experts(x[-1:], experts, ids[-1:], weights[-1:]))[0],
                                  np.asarray(out[-1]))
