"""int4_moe_triton on the CPU: its configurations, its refusal of interpret mode, and a compile of every kernel
variant to PTX and SASS for the H200 (sm_90) with Triton's own compiler, as jax-triton would on the GPU (pointers
16-byte aligned). The numbers are checked on the GPU: tests/test_kernels_gpu.py and experiments/kernels/kernels_moe.py."""
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import pytest
import triton

from pallas_kernels import int4_moe_triton as MT
from pallas_kernels.int4_moe import Int4Experts
from pallas_kernels.triton_call import triton_call
from triton_h200 import compile_for_h200

K26 = dict(NUM_EXPERTS=384, NUM_TOKENS=8, HIDDEN=7168)


def compile_tiled(kernel, pointers: dict, constants: dict, config: MT.TritonMoeConfig, down: bool = False):
    """`compile_for_h200` with the config's tiles (the down kernel's where `down`) and launch parameters."""
    rows, words, stages = config.down_tiling() if down else (config.block_n, config.words, config.num_stages)
    constants = dict(constants, BM=config.block_m, BN=rows, WORDS=words, GROUP_BY_BLOCK=config.group_by_block,
                     FMA=config.fma, STAGES=stages)
    return compile_for_h200(kernel, pointers, constants, config.num_warps, stages)


def gate_up(dtype: str, config):
    splits = config.gate_up_splits
    pointers = {"block_expert_ptr": "*i32", "block_token_ptr": "*i32", "x_ptr": f"*{dtype}", "gate_q_ptr": "*i32",
                "gate_s_ptr": "*bf16", "up_q_ptr": "*i32", "up_s_ptr": "*bf16",
                "h_ptr": f"*{dtype}" if splits == 1 else "*fp32"}
    constants = dict(K26, INTER=2048, ROW_WORDS=896, H_COLS=2048, SPLITS=splits, ROWS=1024)
    return compile_tiled(MT._gate_up_kernel, pointers, constants, config)


def down(dtype: str, config):
    pointers = {"block_expert_ptr": "*i32", "block_token_ptr": "*i32", "block_weight_ptr": "*fp32",
                "h_ptr": f"*{dtype}", "down_q_ptr": "*i32", "down_s_ptr": "*bf16", "y_ptr": f"*{dtype}"}
    return compile_tiled(MT._down_kernel, pointers, dict(K26, ROW_WORDS=256), config, down=True)


SMALL, SMALL_WIDE, MEDIUM, LARGE = (MT.default_config(8 * m, 384) for m in (1, 8, 1024, 4096))
SPLIT_K = MT.TritonMoeConfig(block_m=16, block_n=64, words=32, num_stages=2, down_block_n=128, gate_up_splits=4)
LARGE_UNGROUPED_3_STAGES = dataclasses.replace(LARGE, group_by_block=False, down_num_stages=None)
CONFIGS = dict(argvalues=[SMALL, SMALL_WIDE, MEDIUM, LARGE, SPLIT_K, LARGE_UNGROUPED_3_STAGES],
               ids=["small_blocks", "small_blocks_wide_rows", "medium_blocks", "large_blocks", "split_k",
                    "large_blocks_ungrouped_3_stages"])


def test_large_tiling_groups_blocks_unless_the_grid_overflows():
    """The 32- and 128-token tilings launch a block's programs together, and fall back to [blocks, tiles] where the
    routed blocks would exceed CUDA's 65535 on the grid's second axis (a clear error otherwise, `run_kernels`)."""
    assert (MEDIUM.block_m, LARGE.block_m) == (32, 128) and MEDIUM.group_by_block and LARGE.group_by_block
    huge = MT.default_config(128 * MT.MAX_GRID_Y, 384)
    assert huge.block_m == 128 and not huge.group_by_block
    many_experts = MT.default_config(20 * 65536, 65536)          # 40960 + 65536 blocks of 32 tokens
    assert many_experts.block_m == 32 and not many_experts.group_by_block


def test_down_kernel_at_two_stages_fits_two_blocks_per_sm():
    """down_num_stages=2 with the dense tiling: the down kernel's shared memory leaves room for a second block on
    an SM (228 KB per SM, 1 KB of it reserved per block), which three stages do not: ncu at M=4096 found one 8-warp
    block per SM, limited by shared memory (its 121 registers allow two; registers are not known off the GPU)."""
    assert LARGE.down_tiling()[2] == 2
    two, three = down("bf16", LARGE), down("bf16", LARGE_UNGROUPED_3_STAGES)
    assert 2 * (two.metadata.shared + 1024) <= 228 * 1024 < 2 * (three.metadata.shared + 1024)


@pytest.mark.parametrize("config", [MT.TritonMoeConfig(block_m=1, block_n=32, fma=True),
                                    MT.TritonMoeConfig(block_m=1, block_n=16, fma=True, gate_up_splits=4)],
                         ids=["fma", "fma_split_k"])
@pytest.mark.parametrize("make", [gate_up, down], ids=["gate_up", "down"])
def test_fma_kernels_multiply_add_without_tensor_cores(make, config):
    """fma: the packed bf16x2 dequantization, then f32 multiply-adds, no wgmma and no wait on one; the weights and
    scales of later steps are copied ahead asynchronously (cp.async: the loop's `tl.range(num_stages=)` has Triton's
    pipeliner stage loads that feed no dot)."""
    ptx = make("bf16", config).asm["ptx"]
    assert "fma.rn.f32" in ptx and "mul.rn.bf16x2" in ptx and "cp.async" in ptx
    assert "wgmma" not in ptx


@pytest.mark.parametrize("config", **CONFIGS)
@pytest.mark.parametrize("make", [gate_up, down], ids=["gate_up", "down"])
def test_bf16_kernels_compile_to_wgmma_with_packed_dequantization(make, config):
    """bf16: the weights are dequantized two at a time (bf16x2 sub and mul) and multiplied on the Hopper tensor cores
    (wgmma), within the H200's 227 KB of shared memory."""
    compiled = make("bf16", config)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "mul.rn.bf16x2" in ptx and "sub.rn.bf16x2" in ptx
    assert compiled.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("config", [SMALL, SPLIT_K, dataclasses.replace(LARGE, down_num_stages=4)],
                         ids=["small_blocks", "split_k", "large_blocks_down_4_stages"])
def test_f32_kernels_compile_with_ieee_dots(config):
    """f32 activations (the tests' and references' precision): exact dequantization and IEEE f32 dots, no tf32, with
    the stages int4_moe launches them with (`launch_config`: at most two, for both kernels) within the H200's shared
    memory. The dots' precision does not depend on the tiling: the smallest blocks, the split-K partials' kernels and
    the largest blocks with the most stages asked for (the most shared memory) cover it (each compile ~10-25 s)."""
    config = MT.launch_config(config, jnp.float32)
    assert config.num_stages <= 2 and config.down_tiling()[2] <= 2
    for make in (gate_up, down):
        compiled = make("fp32", config)
        assert "tf32" not in compiled.asm["ptx"] and "fma.rn.f32" in compiled.asm["ptx"]
        assert compiled.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_combine_kernel_compiles_to_vector_loads(dtype):
    """The sum of each token's pairs: 16-byte loads of y's rows (bf16: 8 columns per load), f32 adds (weighted:
    fused multiply-adds)."""
    compiled = compile_for_h200(MT._combine_kernel, {"pair_row_ptr": "*i32", "y_ptr": f"*{dtype}",
                                                     "out_ptr": f"*{dtype}"},
                                dict(TOP_K=8, HIDDEN=7168, BD=MT.COMBINE_COLUMNS), num_warps=4, num_stages=1)
    ptx = compiled.asm["ptx"]
    assert "ld.global.v4" in ptx and "add.f32" in ptx
    weighted = compile_for_h200(MT._weighted_combine_kernel, {"pair_row_ptr": "*i32", "pair_weight_ptr": "*fp32",
                                                              "y_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"},
                                dict(TOP_K=8, HIDDEN=7168, BD=MT.COMBINE_COLUMNS), num_warps=4, num_stages=1)
    assert "ld.global.v4" in weighted.asm["ptx"] and "fma.rn.f32" in weighted.asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_split_k_reduce_kernel_compiles_to_vector_loads(dtype):
    """The sum of gate_up's f32 partials over 4 splits, then silu(gate) * up: 16-byte loads, one sigmoid per element."""
    compiled = compile_for_h200(MT._gate_up_reduce_kernel, {"block_token_ptr": "*i32", "part_ptr": "*fp32",
                                                            "h_ptr": f"*{dtype}"},
                                dict(NUM_TOKENS=1, ROWS=128, H_COLS=2048, SPLITS=4, RB=16, CB=MT.REDUCE_COLUMNS),
                                num_warps=4, num_stages=1)
    ptx = compiled.asm["ptx"]
    assert "ld.global.v4" in ptx and "ex2.approx" in ptx


@pytest.mark.parametrize("tokens", [1, 64])
def test_route_kernel_compiles_to_one_program(tokens):
    """The routing of M * 8 pairs over 384 experts (decode, and MAX_ROUTED_PAIRS) compiles for sm_90 with the sort
    and the per-expert histogram in one program (its results: test_int4_moe_triton_interpreter.py)."""
    pairs = 8 * tokens
    blocks = MT.ref.num_route_blocks(pairs, 384, 16)
    compiled = compile_for_h200(
        MT._route_kernel, {"ids_ptr": "*i32", "weights_ptr": "*bf16", "block_expert_ptr": "*i32",
                           "block_token_ptr": "*i32", "block_weight_ptr": "*fp32", "pair_row_ptr": "*i32"},
        dict(NUM_PAIRS=pairs, TOP_K=8, NUM_EXPERTS=384, NUM_TOKENS=tokens, NUM_BLOCKS=blocks, BM=16,
             PAIRS_P=triton.next_power_of_2(pairs), BINS=512, BLOCKS_P=triton.next_power_of_2(blocks)),
        num_warps=4, num_stages=1)
    assert "bar.sync" in compiled.asm["ptx"] and compiled.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("bad", [dict(block_m=8), dict(block_m=24), dict(block_n=32), dict(words=8),
                                 dict(down_block_n=96), dict(down_words=64), dict(gate_up_splits=3),
                                 dict(gate_up_splits=16), dict(num_stages=0), dict(down_num_stages=9)])
def test_config_refuses_tiles_the_kernels_cannot_take(bad):
    with pytest.raises(ValueError, match="TritonMoeConfig"):
        MT.TritonMoeConfig(**bad)


SMALL_EXPERTS = Int4Experts(*(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (    # E 4, D 7168, I 256
    ((4, 256, 896), jnp.int32), ((4, 224, 256), jnp.bfloat16), ((4, 256, 896), jnp.int32),
    ((4, 224, 256), jnp.bfloat16), ((4, 7168, 32), jnp.int32), ((4, 8, 7168), jnp.bfloat16))))


def trace_run_kernels(config, tokens: int, top_k: int = 2):
    """run_kernels traced (not run) over SMALL_EXPERTS with `tokens` x `top_k` routed pairs."""
    call = functools.partial(triton_call, launcher="xla")
    jax.eval_shape(lambda x, e, i, w: MT.run_kernels(call, x, e, i, w, config),
                   jax.ShapeDtypeStruct((tokens, 7168), jnp.bfloat16), SMALL_EXPERTS,
                   jax.ShapeDtypeStruct((tokens, top_k), jnp.int32), jax.ShapeDtypeStruct((tokens, top_k), jnp.float32))


def test_split_k_must_divide_the_steps_over_d():
    """D = 7168 in steps of 32 words (256 inputs) is 28 steps: 8 splits do not divide them."""
    with pytest.raises(ValueError, match="gate_up_splits=8 does not divide the 28 steps"):
        trace_run_kernels(MT.TritonMoeConfig(gate_up_splits=8), tokens=1)


def test_group_by_block_refuses_more_blocks_than_the_grid_axis_holds():
    """2^20 pairs in blocks of 16 are more than CUDA's 65535 on the grid's second axis, where group_by_block puts
    the blocks; the error names the fixes."""
    with pytest.raises(ValueError, match="caps at 65535: use group_by_block=False or a larger block_m"):
        trace_run_kernels(MT.TritonMoeConfig(group_by_block=True), tokens=2 ** 17, top_k=8)
    trace_run_kernels(MT.TritonMoeConfig(), tokens=2 ** 17, top_k=8)     # [blocks, tiles]: the blocks on the first axis


def test_interpret_mode_is_refused_with_the_alternatives_named():
    x = jnp.zeros((1, 512), jnp.float32)
    with pytest.raises(ValueError, match="no interpret mode"):
        MT.int4_moe(x, None, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2)), interpret=True)


def test_more_activations_than_32_bit_offsets_reach_are_refused():
    """x with 2^31 elements or more (~300k tokens at D = 7168) would wrap the kernels' int32 offsets into x: refused
    with the largest token count that fits, not silently read from the wrong rows."""
    with pytest.raises(ValueError, match="fewer than 299593 tokens"):
        trace_run_kernels(SMALL, tokens=2 ** 31 // 7168 + 1)


def test_activations_other_than_bf16_or_f32_are_refused():
    experts = Int4Experts(*(jnp.zeros(shape, dtype) for shape, dtype in (
        ((1, 8, 32), jnp.int32), ((1, 8, 8), jnp.bfloat16), ((1, 8, 32), jnp.int32), ((1, 8, 8), jnp.bfloat16),
        ((1, 256, 32), jnp.int32), ((1, 8, 256), jnp.bfloat16))))   # E=1, D=256, I=8 (padded to 256)
    x = jnp.zeros((1, 256), jnp.float16)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        MT.int4_moe(x, experts, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1)))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="jax-triton imports where jaxlib has CUDA")
def test_a_missing_jax_triton_is_named_with_the_fix(monkeypatch):
    """On the CPU jax-triton does not import (it needs a CUDA jaxlib): a call asking for it says what to install or
    choose. (Its
    partial import sets TRITON_CACHE_DIR to '', which would leave the later compiles of this process without a cache
    directory: monkeypatch restores the variable.)"""
    monkeypatch.setenv("TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR", triton.knobs.cache.dir))
    with pytest.raises(ImportError, match="jax-triton==0.3.1.*launcher='xla'"):
        triton_call(jnp.zeros(4), kernel=MT._gate_up_kernel, out_shape=None, grid=(1,), num_warps=4, num_stages=1,
                    launcher="jax_triton")
