"""The Triton tree-verify attention kernel (pallas_kernels/tree_verify_attention_triton.py) on the CPU: compiled for
the H200 (sm_90) by Triton itself at K2.6 shapes, and its refusal of interpret mode. Against the reference: in
Triton's interpreter (tests/test_attention_triton_interpreter.py) and on the GPU (tests/test_kernels_gpu.py)."""
import jax.numpy as jnp
import pytest

from pallas_kernels import tree_verify_attention as A
from pallas_kernels import tree_verify_attention_combine as AC
from pallas_kernels import tree_verify_attention_triton as AT
from triton_h200 import compile_for_h200


@pytest.mark.parametrize("streams,nodes,heads,capacity", [(1, 1, 8, 32769), (1, 16, 8, 32784), (1, 256, 64, 33024)])
def test_bf16_kernel_compiles_for_h200(streams, nodes, heads, capacity):
    """K2.6 shapes at the default tiling: the 64-row tiles use wgmma, the 16-row tile mma.sync."""
    cfg = A.default_config(streams, nodes * heads, capacity)
    out = "*bf16" if cfg.num_splits == 1 else "*fp32"
    pointers = {"prefix_ptr": "*i32", "visible_ptr": "*i1", "q_lat_ptr": "*bf16", "q_rope_ptr": "*bf16",
                "c_kv_ptr": "*bf16", "k_rope_ptr": "*bf16", "out_ptr": out, "max_ptr": "*fp32", "sum_ptr": "*fp32"}
    constants = dict(SCALE=0.06, NUM_NODES=nodes, NUM_HEADS=heads, STREAMS=streams, CAPACITY=capacity, LAT=512,
                     LAT_P=512, ROPE=64, ROPE_P=64, BQ=cfg.block_q, BK=cfg.block_k, NUM_SPLITS=cfg.num_splits,
                     PRECISION="tf32")
    ptx = compile_for_h200(AT._attention_kernel, pointers, constants, cfg.num_warps, cfg.num_stages).asm["ptx"]
    assert ("wgmma.mma_async" in ptx) == (cfg.block_q == 64) and "st.global" in ptx


@pytest.mark.parametrize("part,normalized,rows", [("*fp32", False, 8), ("*bf16", True, 64)])
def test_combine_kernel_compiles_for_h200(part, normalized, rows):
    """The split-K combine of both attention kernels' partials at 132 splits (the Triton one's f32 over 8 rows: two
    steps, one stage; the Mosaic GPU one's bf16 over 64 rows: five steps, their loads pipelined)."""
    pointers = {"out_ptr": part, "max_ptr": "*fp32", "sum_ptr": "*fp32", "result_ptr": "*bf16"}
    block_splits, block_rows, width = AC.tiling(132, 1, rows, 512)
    stages = AC.stages_for(132, block_splits)
    constants = dict(SPLITS=132, STREAMS=1, PART_ROWS=64, ROWS=rows, COLS=512, PART_COLS=512, BS=block_splits,
                     BR=block_rows, BC=width, MAX_BS=AC.max_block_splits(132, block_splits, block_rows),
                     NORMALIZED=normalized, STAGES=stages)
    ptx = compile_for_h200(AC._combine_kernel, pointers, constants, 4, stages).asm["ptx"]
    assert "ex2.approx" in ptx and "st.global" in ptx and ("cp.async" in ptx) == (stages > 1) == normalized


def test_interpret_mode_is_refused():
    q = jnp.zeros((1, 1, 1, 16))
    with pytest.raises(ValueError, match="no interpret mode"):
        AT.tree_verify_attention(q, q, jnp.zeros((1, 4, 16)), jnp.zeros((1, 4, 16)), jnp.zeros(1, jnp.int32),
                                 jnp.ones((1, 1, 1), bool), scale=1.0, interpret=True)
