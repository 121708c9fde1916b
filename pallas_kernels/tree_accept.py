"""Tree accept, the op: its reference, its inputs' check and the layout its GPU kernel shares
(`tree_triton._accept_kernel`, the walk from the root along the target's tokens, one program per stream).

Same walk and same result as `pallas_kernels.tree.accept_tree`: at the current node, the child (first in sibling
order, i.e. smallest index) whose token equals the target's token at the node becomes the current node; the walk
stops when no child matches or after `max_depth` steps, and the target's token at the last node is the new bonus.

Kernel: program s holds the tree's `parent`, `tokens` and the target tokens as vectors over the node slots (padded
to a power of two) and the path as a vector over depths; each step is three masked reductions; a while loop stops
at the first miss. Outputs: AcceptResult's path, num_accepted and next_token, written by the kernel.
"""
from __future__ import annotations

from jax.experimental import pallas as pl

from pallas_kernels.tree import AcceptResult, TreeArrays, accept_tree

MIN_SLOTS = 32  # node slots are padded to a power of two, at least one warp's lanes
NUM_WARPS = 1  # a chain of small reductions: one warp avoids cross-warp barriers


def tree_accept_reference(tree: TreeArrays, target_tokens, max_depth: int) -> AcceptResult:
    """tree with B + 1 slots, target_tokens [S, B+1] int32 -> AcceptResult: the pure-JAX walk."""
    return accept_tree(tree, target_tokens, max_depth)


def check_accept_inputs(tree: TreeArrays, target_tokens) -> tuple[int, int]:
    """(S, B + 1) of the accept kernels' inputs, or a ValueError when target_tokens and tree.tokens are not [S, B+1]."""
    n_streams, keep = tree.parent.shape
    if target_tokens.shape != (n_streams, keep) or tree.tokens.shape != (n_streams, keep):
        raise ValueError(f"target_tokens {target_tokens.shape} and tree.tokens {tree.tokens.shape} must be "
                         f"[S, B+1] = {(n_streams, keep)}")
    return n_streams, keep


def node_slots(keep: int) -> int:
    """Node slots of the accept kernels for B + 1 = keep nodes: a power of two, at least MIN_SLOTS."""
    return max(MIN_SLOTS, pl.next_power_of_2(keep))


def path_slots(max_depth: int) -> int:
    """Path entries the accept kernels hold for max_depth steps: a power of two >= max_depth + 1."""
    return max(2, pl.next_power_of_2(max_depth + 1))
