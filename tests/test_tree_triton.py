"""The Triton tree kernels (pallas_kernels/tree_triton.py) on the CPU: compiled for the H200 (sm_90) by Triton itself
at the decode loop's shapes, their launch limits and their refusal of interpret mode. Bit-identity with the
specifications: in Triton's interpreter (tests/test_tree_triton_interpreter.py) and on the GPU
(tests/test_kernels_gpu.py, experiments/kernels/kernels_tree.py)."""
import jax.numpy as jnp
import pytest

from pallas_kernels import tree_accept as TA
from pallas_kernels import tree_build as TB
from pallas_kernels import tree_triton as TT
from pallas_kernels.tree import TreeArrays
from triton_h200 import compile_for_h200


@pytest.mark.parametrize("budget,max_depth,k", [(8, 15, 8), (64, 15, 64), (512, 16, 512)])
def test_build_kernel_compiles_for_h200(budget, max_depth, k):
    slots = TB.node_slots(budget)
    packing = TB.Packing.for_tree(budget, slots, max_depth)
    pointers = {"root_ptr": "*i32", "lp_ptr": "*fp32", "ids_ptr": "*i32", "tokens_ptr": "*i32", "parent_ptr": "*i32",
                "depth_ptr": "*i32", "score_ptr": "*fp32", "first_ptr": "*i32", "next_ptr": "*i32"}
    constants = dict(BUDGET=budget, MAX_DEPTH=max_depth, K=k, SLOTS=slots, RANK_BITS=packing.rank_bits,
                     PREV_BITS=packing.prev_bits, DEPTH_BITS=packing.depth_bits, EMPTY=TB.EMPTY)
    compiled = compile_for_h200(TT._build_kernel, pointers, constants, TB.BuildConfig().warps(slots), 1)
    assert "st.global" in compiled.asm["ptx"]


@pytest.mark.parametrize("keep,max_depth", [(9, 8), (33, 15), (513, 16)])
def test_accept_kernel_compiles_for_h200(keep, max_depth):
    pointers = {"parent_ptr": "*i32", "tokens_ptr": "*i32", "target_ptr": "*i32", "path_ptr": "*i32",
                "accepted_ptr": "*i32", "next_token_ptr": "*i32"}
    constants = dict(KEEP=keep, SLOTS=TA.node_slots(keep), DEPTHS=TA.path_slots(max_depth), MAX_DEPTH=max_depth)
    compiled = compile_for_h200(TT._accept_kernel, pointers, constants, TA.NUM_WARPS, 1)
    assert "st.global" in compiled.asm["ptx"]


def test_interpret_mode_is_refused():
    zeros = jnp.zeros((1, 3), jnp.int32)
    tree = TreeArrays(zeros, zeros, zeros, zeros, zeros, jnp.zeros((1, 3, 3), bool), jnp.ones((1,), jnp.int32),
                      jnp.zeros((1, 3)))
    with pytest.raises(ValueError, match="no interpret mode"):
        TT.tree_accept(tree, zeros, 2, interpret=True)
    with pytest.raises(ValueError, match="no interpret mode"):
        TT.tree_build_from_topk(jnp.zeros((1, 2, 2)), zeros[:, :2, None].repeat(2, 2), zeros[:, 0], budget=2,
                                interpret=True)


def test_build_config_and_limits():
    with pytest.raises(ValueError, match="num_warps"):
        TB.BuildConfig(num_warps=3)
    assert TB.BuildConfig().warps(32) == 1 and TB.BuildConfig(num_warps=2).warps(32) == 2
    lp = jnp.zeros((1, 15, 1), jnp.float32)
    with pytest.raises(ValueError, match="31-bit"):
        TT.tree_build_from_topk(lp, jnp.zeros((1, 15, 1), jnp.int32), jnp.zeros(1, jnp.int32), budget=40000)


@pytest.mark.parametrize("budget", [0, 1, 31, 32, 33, 512])
def test_slot_counts_are_the_next_power_of_two(budget):
    """node_slots / path_slots: powers of two covering B + 1 nodes (at least a warp's lanes) and D + 1 depths."""
    for slots, need, floor in ((TB.node_slots(budget), budget + 1, TB.MIN_SLOTS),
                               (TA.node_slots(budget + 1), budget + 1, TA.MIN_SLOTS),
                               (TA.path_slots(budget), budget + 1, 2)):
        assert slots & (slots - 1) == 0 and slots >= max(need, floor) and (slots // 2 < max(need, floor))
