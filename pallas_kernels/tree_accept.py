"""Tree accept: the walk from the root along the target's tokens as a Pallas-Triton kernel, one program per stream.

Same walk and same result as `pallas_kernels.tree.accept_tree`: at the current node, the child (first in sibling
order, i.e. smallest index) whose token equals the target's token at the node becomes the current node; the walk
stops when no child matches or after `max_depth` steps, and the target's token at the last node is the new bonus.

Kernel: program s holds the tree's `parent`, `tokens` and the target tokens as vectors over the node slots (padded
to a power of two) and the path as a vector over depths; each step is three masked reductions; a while loop stops
at the first miss. Outputs: the path and a pair (num_accepted, next_token) per stream.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pallas_call
from pallas_kernels.tree import AcceptResult, TreeArrays, accept_tree

MIN_SLOTS = 32  # node slots are padded to a power of two, at least one warp's lanes
NUM_WARPS = 1  # a chain of small reductions: one warp avoids cross-warp barriers


def tree_accept_reference(tree: TreeArrays, target_tokens, max_depth: int) -> AcceptResult:
    """tree with B + 1 slots, target_tokens [S, B+1] int32 -> AcceptResult: the pure-JAX walk."""
    return accept_tree(tree, target_tokens, max_depth)


def _kernel(parent_ref, tokens_ref, target_ref, path_ref, stats_ref, *, max_depth: int):
    """One stream. parent/tokens/target [N]; path [P] (P >= max_depth + 1); stats [2] = (num_accepted, next)."""
    slots = parent_ref.shape[0]
    iota = lax.broadcasted_iota(jnp.int32, (slots,), 0)
    depth_iota = lax.broadcasted_iota(jnp.int32, path_ref.shape, 0)
    parent, tokens, target = parent_ref[...], tokens_ref[...], target_ref[...]

    def target_at(node):
        return jnp.sum(jnp.where(iota == node, target, 0))

    def keep_going(carry):
        _, accepted, alive, _ = carry
        return alive & (accepted < max_depth)

    def step(carry):
        node, accepted, _, path = carry
        match = (parent == node) & (tokens == target_at(node))
        child = jnp.min(jnp.where(match, iota, slots))
        found = child < slots
        accepted = accepted + found.astype(jnp.int32)
        path = jnp.where(found & (depth_iota == accepted), child, path)
        return jnp.where(found, child, node), accepted, found, path

    path = jnp.where(depth_iota == 0, 0, -1)
    node, accepted, _, path = lax.while_loop(keep_going, step, (jnp.int32(0), jnp.int32(0), True, path))
    path_ref[...] = path
    stats_ref[...] = jnp.where(lax.broadcasted_iota(jnp.int32, (2,), 0) == 0, accepted, target_at(node))


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def tree_accept(tree: TreeArrays, target_tokens, max_depth: int, *, interpret: bool = False) -> AcceptResult:
    """tree with B + 1 slots, target_tokens [S, B+1] int32 -> AcceptResult, identical to `tree_accept_reference`."""
    n_streams, keep = check_accept_inputs(tree, target_tokens)
    slots, depths = node_slots(keep), path_slots(max_depth)

    def pad(x, value):
        return jnp.pad(x.astype(jnp.int32), ((0, 0), (0, slots - keep)), constant_values=value)

    node = pl.BlockSpec((None, slots), lambda s: (s, 0))
    path, stats = pallas_call(
        functools.partial(_kernel, max_depth=max_depth),
        out_shape=(jax.ShapeDtypeStruct((n_streams, depths), jnp.int32),
                   jax.ShapeDtypeStruct((n_streams, 2), jnp.int32)),
        grid=(n_streams,),
        in_specs=[node, node, node],
        out_specs=(pl.BlockSpec((None, depths), lambda s: (s, 0)), pl.BlockSpec((None, 2), lambda s: (s, 0))),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="tree_accept",
    )(pad(tree.parent, -1), pad(tree.tokens, 0), pad(target_tokens, 0))
    return AcceptResult(path[:, :max_depth + 1], stats[:, 0], stats[:, 1])


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
