"""Draft-tree build, the op: its reference, its inputs' checks and the layout its GPU kernel shares
(`tree_triton._build_kernel`, the whole best-first search in one launch, one program per stream).

Same search and same arrays as `pallas_kernels.tree.build_tree` (the specification is the heapq reference there):
the top-K log-probs / ids per depth come from `draft_topk` (fp32 log_softmax + `lax.top_k`) outside the kernel.

Kernel: program s keeps its tree and its frontier in registers, as vectors over the node slots padded to a power
of two. The frontier has at most one candidate per node (the node's next unpopped child rank), so it is indexed by
the parent node: slot p holds the candidate's score, push counter and a packed word (valid bit, depth, rank,
previous sibling). A step is four reductions, three deep: the best score; the smallest push counter among the slots
holding it (argmin, which yields the slot p); then, side by side, slot p's packed word and the parent's score. It
writes node n = step + 1, links it after its previous sibling, puts the parent's next child rank back into slot p and
the node's first child into slot n. Three scalar loads per step read the top-K table in global memory. `tokens`,
`parent`, `depth`, `score`, `first_child` and `next_sibling` come out of the kernel; `visible` and `num_nodes` are a
short jnp pass over `parent` outside it (`tree_visible`; 1 + count of parented slots).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.tree import TreeArrays, build_tree, tree_visible

MIN_SLOTS = 32  # node slots are padded to a power of two, at least one warp's lanes
EMPTY = np.iinfo(np.int32).max  # push counter of a frontier slot without a candidate
ONE_WARP_MAX_SLOTS = 256  # up to this many slots one warp is fastest (no cross-warp reductions); 4 warps above


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """Launch parameters of the build kernel; num_warps None picks by the number of slots."""
    num_warps: int | None = None

    def __post_init__(self):
        if self.num_warps is not None and (self.num_warps < 1 or self.num_warps & (self.num_warps - 1)):
            raise ValueError(f"BuildConfig.num_warps={self.num_warps} must be a power of two >= 1")

    def warps(self, slots: int) -> int:
        if self.num_warps is not None:
            return self.num_warps
        return 1 if slots <= ONE_WARP_MAX_SLOTS else 4


@dataclasses.dataclass(frozen=True)
class Packing:
    """Bit fields of a frontier slot's int32 word: rank | previous sibling | depth | valid (low to high)."""
    rank_bits: int
    prev_bits: int
    depth_bits: int

    @classmethod
    def for_tree(cls, budget: int, slots: int, max_depth: int) -> "Packing":
        packing = cls(max(1, budget.bit_length()), (slots - 1).bit_length(), (max_depth + 1).bit_length())
        if packing.rank_bits + packing.prev_bits + packing.depth_bits + 1 > 31:
            raise ValueError(f"budget={budget} with depth {max_depth} does not fit the kernel's 31-bit frontier "
                             f"word; use the reference builder (pallas_kernels.tree.build_tree) for such trees")
        return packing


def tree_build_reference(draft_logits, root, budget: int, topk: int | None = None) -> TreeArrays:
    """draft_logits [S, D, V], root [S] int -> TreeArrays: the pure-JAX builder."""
    return build_tree(draft_logits, root, budget, topk)


def node_slots(budget: int) -> int:
    """Node slots of the build kernels for B + 1 nodes: a power of two, at least MIN_SLOTS."""
    return max(MIN_SLOTS, pl.next_power_of_2(budget + 1))


def check_topk_table(top_logprobs, top_ids, root) -> None:
    """The build kernels' inputs: top_logprobs and top_ids [S, D, K] with D >= 1, root [S]; else a ValueError."""
    if top_logprobs.ndim != 3 or top_logprobs.shape[1] < 1 or top_ids.shape != top_logprobs.shape:
        raise ValueError(f"top_logprobs {top_logprobs.shape} and top_ids {top_ids.shape} must both be [S, D, K] "
                         f"with D >= 1")
    if root.shape != (top_logprobs.shape[0],):
        raise ValueError(f"root {root.shape} must be [S={top_logprobs.shape[0]}]")


def tree_arrays(tokens, parent, depth, score, first_child, next_sibling, budget: int, max_depth: int) -> TreeArrays:
    """The build kernels' node vectors [S, slots] -> TreeArrays of B + 1 slots (with `visible` and `num_nodes`)."""
    keep = budget + 1
    parent = parent[:, :keep]
    num_nodes = 1 + jnp.sum(parent >= 0, axis=1, dtype=jnp.int32)
    return TreeArrays(tokens[:, :keep], parent, depth[:, :keep], first_child[:, :keep], next_sibling[:, :keep],
                      tree_visible(parent, max_depth), num_nodes, score[:, :keep])

