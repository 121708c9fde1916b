"""Draft-tree build: the whole best-first search in one Pallas-Triton launch, one program per stream.

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
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pallas_call
from pallas_kernels.tree import TreeArrays, build_tree, draft_topk, resolve_topk, tree_visible

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

    def pack(self, valid, depth, rank, prev):
        prev_shift = self.rank_bits
        depth_shift = prev_shift + self.prev_bits
        valid_shift = depth_shift + self.depth_bits
        return (valid.astype(jnp.int32) << valid_shift) | (depth << depth_shift) | (prev << prev_shift) | rank

    def unpack(self, word):
        """word -> (valid bool, depth, rank, prev)."""
        def field(shift, bits):
            return (word >> shift) & ((1 << bits) - 1)
        prev_shift = self.rank_bits
        depth_shift = prev_shift + self.prev_bits
        valid_shift = depth_shift + self.depth_bits
        return (field(valid_shift, 1) == 1, field(depth_shift, self.depth_bits), field(0, self.rank_bits),
                field(prev_shift, self.prev_bits))


def tree_build_reference(draft_logits, root, budget: int, topk: int | None = None) -> TreeArrays:
    """draft_logits [S, D, V], root [S] int -> TreeArrays: the pure-JAX builder."""
    return build_tree(draft_logits, root, budget, topk)


def _kernel(root_ref, lp_ref, ids_ref, tokens_ref, parent_ref, depth_ref, score_ref, first_ref, next_ref, *,
            budget: int, packing: Packing):
    """One stream. lp_ref / ids_ref [D, K]; root_ref [S]; outputs [N] (N = padded slots)."""
    max_depth, k = lp_ref.shape
    slots = tokens_ref.shape[0]
    iota = lax.broadcasted_iota(jnp.int32, (slots,), 0)
    neg_inf = jnp.float32(-jnp.inf)
    empty = jnp.int32(EMPTY)
    zero = jnp.int32(0)

    def put(vec, i, value):
        return jnp.where(iota == i, value, vec)

    def take(vec, i):  # vec[i] for a dynamic scalar i, as a masked reduction
        if vec.dtype == jnp.float32:
            return jnp.max(jnp.where(iota == i, vec, neg_inf))
        return jnp.sum(jnp.where(iota == i, vec, 0))

    minus_one = jnp.full((slots,), -1, jnp.int32)
    zeros = jnp.zeros((slots,), jnp.int32)
    tokens = put(zeros, 0, root_ref[pl.program_id(0)])
    score = put(jnp.full((slots,), neg_inf), 0, jnp.float32(0.0))
    f_score = put(jnp.full((slots,), neg_inf), 0, lp_ref[0, 0])
    f_count = put(jnp.full((slots,), empty), 0, zero)
    f_word = put(zeros, 0, packing.pack(jnp.bool_(True), jnp.int32(1), zero, zero))

    def step(i, carry):
        tokens, parent, depth, score, first, nxt, f_score, f_count, f_word, pushes = carry
        n = i + 1
        valid = f_count != empty
        best = jnp.max(jnp.where(valid, f_score, neg_inf))
        p = jnp.argmin(jnp.where(valid & (f_score == best), f_count, empty)).astype(jnp.int32)
        popped, d, r, prev = packing.unpack(take(f_word, p))  # popped is False once the heap is empty
        parent_score = take(score, p)
        row = jnp.clip(d - 1, 0, max_depth - 1)
        token = ids_ref[row, jnp.minimum(r, k - 1)]
        sib_lp = lp_ref[row, jnp.minimum(r + 1, k - 1)]
        child_lp = lp_ref[jnp.minimum(d, max_depth - 1), 0]
        # the popped node, linked after its previous sibling (or as the parent's first child)
        tokens = put(tokens, n, jnp.where(popped, token, 0))
        parent = put(parent, n, jnp.where(popped, p, -1))
        depth = put(depth, n, jnp.where(popped, d, 0))
        score = put(score, n, jnp.where(popped, best, neg_inf))
        first = jnp.where(popped & (r == 0) & (iota == p), n, first)
        nxt = jnp.where(popped & (r > 0) & (iota == prev), n, nxt)
        # (1) the next sibling takes slot p, (2) the first child takes slot n
        has_sib = popped & (r + 1 < k)
        has_child = popped & (d < max_depth)
        f_score = put(put(f_score, p, parent_score + sib_lp), n, best + child_lp)
        f_word = put(put(f_word, p, packing.pack(has_sib, d, r + 1, n)), n, packing.pack(has_child, d + 1, zero, zero))
        f_count = put(f_count, p, jnp.where(has_sib, pushes, empty))
        pushes = pushes + has_sib.astype(jnp.int32)
        f_count = put(f_count, n, jnp.where(has_child, pushes, empty))
        pushes = pushes + has_child.astype(jnp.int32)
        return tokens, parent, depth, score, first, nxt, f_score, f_count, f_word, pushes

    carry = (tokens, minus_one, zeros, score, minus_one, minus_one, f_score, f_count, f_word, jnp.int32(1))
    tokens, parent, depth, score, first, nxt, *_ = lax.fori_loop(0, budget, step, carry)
    tokens_ref[...] = tokens
    parent_ref[...] = parent
    depth_ref[...] = depth
    score_ref[...] = score
    first_ref[...] = first
    next_ref[...] = nxt


@functools.partial(jax.jit, static_argnames=("budget", "config", "interpret"))
def tree_build_from_topk(top_logprobs, top_ids, root, *, budget: int, config: BuildConfig | None = None,
                         interpret: bool = False) -> TreeArrays:
    """top_logprobs [S, D, K] float32, top_ids [S, D, K] int32, root [S] int -> TreeArrays (B + 1 slots)."""
    check_topk_table(top_logprobs, top_ids, root)
    n_streams, max_depth, k = top_logprobs.shape
    cfg = config or BuildConfig()
    slots = node_slots(budget)
    table = pl.BlockSpec((None, max_depth, k), lambda s: (s, 0, 0))
    node = pl.BlockSpec((None, slots), lambda s: (s, 0))
    int_out = jax.ShapeDtypeStruct((n_streams, slots), jnp.int32)
    tokens, parent, depth, score, first_child, next_sibling = pallas_call(
        functools.partial(_kernel, budget=budget, packing=Packing.for_tree(budget, slots, max_depth)),
        out_shape=(int_out, int_out, int_out, jax.ShapeDtypeStruct((n_streams, slots), jnp.float32), int_out,
                   int_out),
        grid=(n_streams,),
        in_specs=[pl.BlockSpec((n_streams,), lambda s: (0,)), table, table],
        out_specs=(node,) * 6,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.warps(slots), num_stages=1),
        interpret=interpret,
        name="tree_build",
    )(root.astype(jnp.int32), top_logprobs.astype(jnp.float32), top_ids.astype(jnp.int32))
    return tree_arrays(tokens, parent, depth, score, first_child, next_sibling, budget, max_depth)


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


def tree_build(draft_logits, root, budget: int, topk: int | None = None, *, config: BuildConfig | None = None,
               interpret: bool = False) -> TreeArrays:
    """draft_logits [S, D, V], root [S] int -> TreeArrays, identical to `tree_build_reference`."""
    k = resolve_topk(budget, draft_logits.shape[-1], topk)
    top_logprobs, top_ids = draft_topk(draft_logits, k)
    return tree_build_from_topk(top_logprobs, top_ids, jnp.asarray(root), budget=budget, config=config,
                                interpret=interpret)
