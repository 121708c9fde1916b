"""`pallas_kernels.triton_call` on the CPU: every Triton kernel lowers, for an H200, to XLA's own Triton custom call
(Triton IR that jaxlib's Triton dialect parses), alone and inside the expert-parallel shard_map with check_vma; the
int4_moe kernels also to the "ffi" launcher's custom calls (Triton's cubins); bad calls are refused with errors that
name the fix.

The lowering is what the GPU compiles (XLA turns the custom call's Triton IR into its executable); the GPU runs are in
tests/test_kernels_gpu.py and experiments/kernels/kernels_moe.py / kernels_tree.py.
"""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from pallas_kernels import int4_moe as M
from pallas_kernels import int4_moe_triton as MT
from pallas_kernels import router_topk as RT
from pallas_kernels import skinny_matmul as SM
from pallas_kernels import tree_triton as TT
from pallas_kernels import tree_verify_attention as A
from pallas_kernels import tree_verify_attention_triton as AT
from pallas_kernels.tree import TreeArrays
from pallas_kernels import triton_ffi
from pallas_kernels.triton_call import XLA_TRITON_TARGET, kernel_cubin, kernel_ttir, triton_call
from triton_h200 import compile_for_h200, h200_mesh, lower_for_h200, spec

BF16, I32, F32 = jnp.bfloat16, jnp.int32, jnp.float32
E, D, I, TOP_K = 384, 7168, 2048, 8     # Kimi K2.6's routed experts


def k26_experts(sharding=None) -> M.Int4Experts:
    shapes = [((E, I, D // 8), I32), ((E, D // 32, I), BF16)] * 2 + [((E, D, I // 8), I32), ((E, I // 32, D), BF16)]
    return M.Int4Experts(*(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes))


@pytest.mark.parametrize("tokens", [1, 4096])
def test_int4_moe_lowers_to_xla_triton_calls(tokens):
    """int4_moe's kernels through XLA's launcher (a measured peer of its jax-triton default): the routing kernel up
    to MAX_ROUTED_PAIRS pairs (XLA's sort above), then gate_up, down and the combine."""
    text = lower_for_h200(functools.partial(MT.int4_moe, launcher="xla"), spec((tokens, D), BF16), k26_experts(),
                        spec((tokens, TOP_K), I32), spec((tokens, TOP_K), F32))
    routed = tokens * TOP_K <= MT.MAX_ROUTED_PAIRS
    assert text.count(XLA_TRITON_TARGET) == 3 + routed
    assert ('name = "_route_kernel"' in text) == routed and ("sort" in text) != routed
    for name in ("_gate_up_kernel", "_down_kernel", "_combine_kernel"):
        assert f'name = "{name}"' in text


def test_int4_moe_lowers_to_ffi_launches_of_triton_cubins():
    """The "ffi" launcher: each kernel compiled by Triton for sm_90 (an ELF cubin in the custom call), launched by
    this project's FFI handler with the launch parameters Triton's compile chose (shared memory per program)."""
    text = lower_for_h200(functools.partial(MT.int4_moe, launcher="ffi"), spec((8, D), BF16), k26_experts(),
                          spec((8, TOP_K), I32), spec((8, TOP_K), F32))
    assert text.count(f"@{triton_ffi.TARGET}(") == 4 and text.count('cubin = "\\7FELF') == 4
    assert XLA_TRITON_TARGET not in text
    for name in ("_route_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel"):
        assert f'name = "{name}"' in text
    config = MT.default_config(8 * TOP_K, E)
    gate_up = kernel_cubin(MT._gate_up_kernel, ("*i32", "*i32", "*bf16", "*i32", "*bf16", "*i32", "*bf16", "*bf16"),
                           tuple(sorted((k, int, v) for k, v in dict(
                               NUM_EXPERTS=E, NUM_TOKENS=8, HIDDEN=D, INTER=I, ROW_WORDS=D // 8, H_COLS=I,
                               BM=config.block_m, BN=config.block_n, WORDS=config.words, SPLITS=1, GROUP_BY_BLOCK=False,
                               FMA=config.fma, STAGES=config.num_stages,
                               ROWS=M.num_route_blocks(8 * TOP_K, E, config.block_m) * config.block_m).items())),
                           config.num_warps, config.num_stages, 90)
    assert gate_up.shared_mem > 48 * 1024 and f"shared_mem = {gate_up.shared_mem} : i32" in text
    assert f"cubin_hash = {gate_up.cubin_hash} : i64" in text


def test_the_default_int4_moe_launcher_is_settable_and_checked():
    """`set_default_launcher` (bench_k26 --moe_launcher) changes the launcher of calls that name none, from the next
    trace on (a function jitted before keeps its trace, as with `ops.set_implementation`); a launcher that does not
    exist is refused."""
    args = (spec((1, D), BF16), k26_experts(), spec((1, TOP_K), I32), spec((1, TOP_K), F32))
    assert MT.LAUNCHER == "jax_triton"
    try:
        MT.set_default_launcher("ffi")
        assert lower_for_h200(lambda *a: MT.int4_moe(*a), *args).count(f"@{triton_ffi.TARGET}(") == 4
        MT.set_default_launcher("xla")
        assert lower_for_h200(lambda *a: MT.int4_moe(*a), *args).count(XLA_TRITON_TARGET) == 4
        with pytest.raises(ValueError, match="launcher 'pallas' is not one of"):
            MT.set_default_launcher("pallas")
    finally:
        MT.set_default_launcher()


@pytest.mark.parametrize("launcher,target", [("xla", XLA_TRITON_TARGET), ("ffi", triton_ffi.TARGET)])
def test_int4_moe_lowers_inside_the_expert_parallel_shard_map(launcher, target):
    """Two H200s, 192 experts each: the shard_map keeps check_vma on and the psum is over per-device outputs."""
    def ep(x, experts, ids, weights):
        def local(x, experts, ids, weights):
            first = jax.lax.axis_index("tp") * (E // 2)
            return jax.lax.psum(MT.int4_moe(x, experts, ids - first, weights, launcher=launcher), "tp")
        return jax.shard_map(local, in_specs=(P(), P("tp"), P(), P()), out_specs=P(), check_vma=True)(
            x, experts, ids, weights)

    mesh = h200_mesh((2,))
    experts = k26_experts(jax.sharding.NamedSharding(mesh, P("tp")))
    text = lower_for_h200(ep, spec((8, D), BF16), experts, spec((8, TOP_K), I32), spec((8, TOP_K), F32), mesh=mesh)
    assert text.count(target) == 4 and "all_reduce" in text


@pytest.mark.parametrize("rows,k,n,norm,residual", [(1, D, 1536, True, False), (8, D, 576, False, False),
                                                    (33, 1024, D, False, True), (1, D, 384, False, False),
                                                    (2, 512, 16896, True, True)])
def test_skinny_matmul_lowers_to_ffi_launches_of_triton_cubins(rows, k, n, norm, residual):
    """skinny_matmul at the tp=8 share's shapes (q_a with its norm, kv_a split over K, o_proj with the residual add,
    the f32 router) and one wide enough not to split (264 column blocks: the norm and the residual in the one
    kernel), compiled by Triton for sm_90: the product kernel, the splits kernel after it where K is split, and
    nothing else (no padding, slicing or casting around them)."""
    dtype = F32 if n == 384 else BF16
    text = lower_for_h200(lambda x, w, g, r: SM.skinny_matmul(x, w, norm_weight=g, residual=r), spec((rows, k), dtype),
                          spec((n, k), dtype), spec((k,), dtype) if norm else None,
                          spec((rows, n), dtype) if residual else None)
    second = SM.default_tiling(k, n).splits > 1
    assert text.count(f"@{triton_ffi.TARGET}(") == 1 + second and text.count('cubin = "\\7FELF') == 1 + second
    assert 'name = "_product_kernel"' in text and ('name = "_splits_kernel"' in text) == second
    assert not any(op in text for op in ("stablehlo.pad", "stablehlo.slice", "stablehlo.convert"))


@pytest.mark.parametrize("rows", [1, 8])
def test_skinny_matmul_fma_tiling_lowers_for_sm90(rows):
    """The multiply-add tiling (`Tiling.fma`) at q_a's shape with its norm: compiled by Triton for sm_90, its x and w
    loads copied steps ahead (cp.async: the loop's `tl.range(num_stages=)` stages loads that feed no dot)."""
    tiling = SM.default_tiling(D, 1536, fma=True)
    text = lower_for_h200(lambda x, w, g: SM.skinny_matmul(x, w, norm_weight=g, tiling=tiling), spec((rows, D), BF16),
                          spec((1536, D), BF16), spec((D,), BF16))
    assert text.count('cubin = "\\7FELF') == 1 + (tiling.splits > 1) and 'name = "_product_kernel"' in text
    compiled = compile_for_h200(
        SM._product_kernel, {name: "*bf16" for name in ("x_ptr", "w_ptr", "g_ptr", "residual_ptr")}
        | {"out_ptr": "*fp32", "squares_ptr": "*fp32"},
        dict(M=rows, K=D, N=1536, BM=SM.row_tile(rows, tiling), BN=tiling.block_n, BK=tiling.block_k,
             SPLITS=tiling.splits, NORM=True, RESIDUAL=False, EPS=1e-6, IEEE=False, FMA=True, STAGES=SM.STAGES),
        4, SM.STAGES)
    assert "cp.async" in compiled.asm["ptx"] and "wgmma" not in compiled.asm["ptx"]


def test_router_topk_lowers_to_one_triton_call():
    """K2.6's router after its product (384 experts, top 8) at a B=32 verify of 8 streams: one Triton call (XLA's,
    the default launcher), no sort; and compiled by Triton for sm_90 (the "ffi" launcher's cubin)."""
    args = spec((264, 384), F32), spec((384,), F32)
    text = lower_for_h200(lambda lg, b: RT.router_topk(lg, b, 8, scale=2.827), *args)
    assert text.count(XLA_TRITON_TARGET) == 1 and "stablehlo.sort" not in text
    text = lower_for_h200(lambda lg, b: RT.router_topk(lg, b, 8, scale=2.827, launcher="ffi"), *args)
    assert text.count('cubin = "\\7FELF') == 1 and 'name = "_router_kernel"' in text


def test_tree_kernels_lower_to_one_xla_triton_call_each():
    streams, depth, k, budget = 16, 15, 8, 512
    build = lower_for_h200(lambda lp, ids, root: TT.tree_build_from_topk(lp, ids, root, budget=budget),
                         spec((streams, depth, k), F32), spec((streams, depth, k), I32), spec((streams,), I32))
    n = budget + 1
    tree = TreeArrays(*(spec((streams, n), I32) for _ in range(5)), spec((streams, n, n), jnp.bool_),
                      spec((streams,), I32), spec((streams, n), F32))
    accept = lower_for_h200(lambda t, g: TT.tree_accept(t, g, depth), tree, spec((streams, n), I32))
    assert build.count(XLA_TRITON_TARGET) == 1 and accept.count(XLA_TRITON_TARGET) == 1


@pytest.mark.parametrize("streams,nodes,heads,prefix", [(1, 1, 8, 32768), (2, 16, 8, 4096), (1, 256, 64, 4096)])
def test_tree_verify_attention_lowers_to_xla_triton_calls(streams, nodes, heads, prefix):
    """The Triton tree-verify attention at K2.6 shapes: the 16-row decode tile with 132 splits, 64-row tiles with splits
    (the attention kernel, then the combine kernel), one split (the attention kernel alone)."""
    lat, rope, n = 512, 64, prefix + nodes
    args = (spec((streams, nodes, heads, lat), BF16), spec((streams, nodes, heads, rope), BF16),
            spec((streams, n, lat), BF16), spec((streams, n, rope), BF16), spec((streams,), I32),
            spec((streams, nodes, nodes), jnp.bool_))
    text = lower_for_h200(lambda *a: AT.tree_verify_attention(*a, scale=0.07), *args)
    splits = A.default_config(streams, nodes * heads, n).num_splits
    combined = splits > 1                                # the combine kernel (or none)
    assert text.count(XLA_TRITON_TARGET) == 1 + combined and 'name = "_attention_kernel"' in text
    assert ('name = "_combine_kernel"' in text) == combined


def test_the_triton_ir_has_the_kernel_as_its_only_entry():
    """Triton's own TTIR passes inline the helpers: one public function, named as the custom call says."""
    text = kernel_ttir(MT._combine_kernel, ("*i32", "*bf16", "*bf16"),
                       (("BD", int, 1024), ("HIDDEN", int, D), ("TOP_K", int, 8)), 4, 90)
    assert text.count("tt.func") == 1 and "tt.func public @_combine_kernel" in text


def test_bad_calls_name_the_fix():
    x = jnp.zeros((8,), F32)
    out = jax.ShapeDtypeStruct((8,), F32)
    kw = dict(kernel=MT._combine_kernel, grid=(1,), num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="launcher 'pallas' is not one of"):
        triton_call(x, x, out_shape=out, launcher="pallas", TOP_K=8, HIDDEN=8, BD=8, **kw)
    kw["launcher"] = "xla"
    with pytest.raises(TypeError, match="dtype uint16.*cast it first"):
        lower_for_h200(lambda a: triton_call(a, a, out_shape=out, TOP_K=8, HIDDEN=8, BD=8, **kw), spec((8,), jnp.uint16))
    with pytest.raises(TypeError, match=r"_combine_kernel takes 6 arguments.*given 3 arrays"):
        lower_for_h200(lambda a: triton_call(a, a, out_shape=out, TOP_K=8, HIDDEN=8, **kw), spec((8,), F32))
    with pytest.raises(TypeError, match=r"the arrays must be its first arguments"):
        lower_for_h200(lambda a: triton_call(a, a, out_shape=out, TOP_K=8, HIDDEN=8, WIDTH=8, **kw), spec((8,), F32))
    with pytest.raises(ValueError, match="one to three dimensions"):
        triton_call(x, x, out_shape=out, TOP_K=8, HIDDEN=8, BD=8, **dict(kw, grid=(1, 1, 1, 1)))


def test_constexprs_of_equal_value_and_different_type_are_different_kernels():
    """1 and 1.0 compare equal in Python, but Triton types a constexpr by its Python type (a float where a kernel
    needs an int fails to compile, for one), so the IR cache keeps them apart."""
    pointers = ("*i32", "*i8") + ("*bf16",) * 4 + ("*fp32",) * 3
    rest = dict(NUM_NODES=4, NUM_HEADS=4, STREAMS=1, CAPACITY=64, LAT=32, LAT_P=32, ROPE=16, ROPE_P=16, BQ=16, BK=16,
                NUM_SPLITS=2, PRECISION="tf32")
    kernel_ttir.cache_clear()
    for scale in (1, 1.0, 1):
        kernel_ttir(AT._attention_kernel, pointers,
                    tuple(sorted((k, type(v), v) for k, v in dict(rest, SCALE=scale).items())), 4, 90)
    assert kernel_ttir.cache_info().misses == 2 and kernel_ttir.cache_info().hits == 1


def test_attention_port_lowers_inside_the_head_parallel_shard_map():
    """Two H200s on tp: each runs the port on its own 8 of 16 heads over the replicated latent cache (the model's
    head_parallel), with check_vma on."""
    from kdtree_jax.model.parallel import head_parallel

    mesh = h200_mesh((1, 2), ("data", "tp"))
    per_head, replicated = P(None, None, "tp", None), P()        # data = 1: streams are not split

    def sharded(shape, dtype, partition):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, partition))

    s, t, h, n = 2, 16, 16, 4096 + 16
    args = (sharded((s, t, h, 512), BF16, per_head), sharded((s, t, h, 64), BF16, per_head),
            sharded((s, n, 512), BF16, replicated), sharded((s, n, 64), BF16, replicated),
            sharded((s,), I32, replicated), sharded((s, t, t), jnp.bool_, replicated))
    def attention(*operands_and_plan):     # head_parallel's callable also takes the forward's plan (None here)
        return AT.tree_verify_attention(*operands_and_plan[:6], scale=0.07)

    text = lower_for_h200(lambda *a: head_parallel(attention, *a), *args, mesh=mesh)
    splits = A.default_config(s, t * h // 2, n).num_splits
    combined = splits > 1
    assert text.count(XLA_TRITON_TARGET) == 1 + combined and "tensor<2x16x8x512xbf16>" in text


@pytest.mark.parametrize("heads,lat,rope,dtype,capacity", [
    (8, 512, 64, BF16, 4096), (64, 512, 64, BF16, 4096), (8, 64, 16, BF16, 4096), (8, 512, 64, F32, 4096),
    (8, 64, 16, BF16, 512),        # the code target's cache: one chunk, no merge
])
def test_exact_attention_lowers_to_triton_cubins(heads, lat, rope, dtype, capacity):
    """The exact mode's attention at K2.6's latents (the tp=8 share's 8 heads and all 64) and the code target's,
    bf16 and f32, compiled by Triton for sm_90 (shared memory within the H200's): the chunks' kernel and, with more
    than one chunk, their merge, after XLA's ancestor sort."""
    from pallas_kernels import batch_invariant_triton as BT
    text = lower_for_h200(functools.partial(BT.attention, scale=0.1), spec((8, 33, heads, lat), dtype),
                          spec((8, 33, heads, rope), dtype), spec((8, capacity, lat), dtype),
                          spec((8, capacity, rope), dtype), spec((8,), I32), spec((8, 33, 33), jnp.bool_))
    merged = capacity > BT.attention_chunk(lat, dtype)
    assert text.count(f"@{triton_ffi.TARGET}(") == 1 + merged and 'name = "_attention_kernel"' in text
    assert ('name = "_combine_chunks_kernel"' in text) == merged


@pytest.mark.parametrize("d,i,experts,dtype", [(D, I, 48, BF16), (256, 128, 16, BF16), (256, 128, 16, F32)])
def test_exact_expert_tiles_lower_to_two_triton_cubins(d, i, experts, dtype):
    """The exact mode's routed experts (K2.6's dims with the share's 48 experts, the code target's), compiled by
    Triton for sm_90: the gate_up kernel and the down kernel."""
    from pallas_kernels import batch_invariant_triton as BT
    tiles = 264 * 8 // 16 + experts
    text = lower_for_h200(BT.expert_tiles, spec((264, d), dtype), spec((experts, d, i), dtype),
                          spec((experts, d, i), dtype), spec((experts, i, d), dtype), spec((tiles, 16), I32),
                          spec((tiles,), I32))
    assert text.count(f"@{triton_ffi.TARGET}(") == 2
    assert 'name = "_gate_up_kernel"' in text and 'name = "_down_kernel"' in text


@pytest.mark.parametrize("heads,lat,nope,v,key", [(8, 512, 128, 128, True), (8, 512, 128, 128, False),
                                                  (8, 64, 32, 32, True)])
def test_exact_head_matmul_lowers_to_one_triton_cubin(heads, lat, nope, v, key):
    """The exact mode's head products (K2.6's W_UK and W_UV at the share's 8 heads, the code target's W_UK) read in
    place from kv_b at a B=32 verify of 8 streams, compiled by Triton for sm_90: one kernel, no transposed copy."""
    from pallas_kernels import batch_invariant_triton as BT
    kv_b = spec((lat, heads, nope + v), BF16)
    text = lower_for_h200(functools.partial(BT.head_matmul, where=BT.HeadWeights.absorbed(kv_b, nope, key)),
                          spec((8, 33, heads, nope if key else lat), BF16), kv_b)
    assert text.count(f"@{triton_ffi.TARGET}(") == 1 and 'name = "_head_product_kernel"' in text
    assert "transpose" not in text


@pytest.mark.parametrize("k,dtype", [(D, BF16), (1536, BF16), (512, F32)])
def test_exact_rms_norm_lowers_to_one_triton_cubin(k, dtype):
    """The exact mode's RMSNorm at K2.6's hidden, q_lora and kv_lora widths, compiled by Triton for sm_90."""
    from pallas_kernels import batch_invariant_triton as BT
    text = lower_for_h200(functools.partial(BT.rms_norm, eps=1e-6), spec((8, 33, k), dtype), spec((k,), dtype))
    assert text.count(f"@{triton_ffi.TARGET}(") == 1 and 'name = "_rms_norm_kernel"' in text


@pytest.mark.parametrize("m,d,i,experts", [(8, D, I, 48), (256, 256, 128, 16)])
def test_exact_routed_experts_lower_to_four_triton_cubins(m, d, i, experts):
    """The exact mode's routed experts as the model runs them up to int4_moe's MAX_ROUTED_PAIRS (512) pairs: its
    routing kernel, the gate_up and down kernels, its weighted combine; nothing else from XLA for the layout (no
    sort). (Above, int4_moe routes through XLA.)"""
    from pallas_kernels import batch_invariant_triton as BT
    k = 8 if d == D else 2
    text = lower_for_h200(BT.routed_experts, spec((m, d), BF16), spec((experts, d, i), BF16),
                          spec((experts, d, i), BF16), spec((experts, i, d), BF16), spec((m, k), I32),
                          spec((m, k), F32))
    assert text.count(f"@{triton_ffi.TARGET}(") == 4 and "stablehlo.sort" not in text
    for name in ("_route_kernel", "_gate_up_kernel", "_down_kernel", "_weighted_combine_kernel"):
        assert f'name = "{name}"' in text


def test_exact_int4_experts_lower_to_int4_moes_triton_kernels_at_one_tiling():
    """The exact mode's INT4 experts (K2.6's, 8 tokens and 264): int4_moe's routing, gate_up, down and combine
    kernels at EXACT_INT4_CONFIG whatever M (no split-K reduce)."""
    from pallas_kernels import batch_invariant_triton as BT
    for m in (8, 264):
        text = lower_for_h200(functools.partial(BT.int4_routed_experts, launcher="ffi"), spec((m, D), BF16),
                              k26_experts(), spec((m, TOP_K), I32), spec((m, TOP_K), F32))
        assert 'name = "_gate_up_kernel"' in text and 'name = "_down_kernel"' in text
        assert 'name = "_gate_up_reduce_kernel"' not in text
