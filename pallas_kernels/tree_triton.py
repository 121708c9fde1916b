"""Tree build and tree accept as Triton kernels (launched by `triton_call`): the GPU's tree_build and tree_accept.

The ops of `tree_build.py` and `tree_accept.py` (their references, input checks and layouts; those files describe
the steps), written in Triton: one program per stream holds its tree and frontier as vectors over the node slots (a
power of two), each step is a few masked reductions, and a dynamic index into a vector is a masked reduction.

On the CPU they compile for sm_90 (tests/test_tree_triton.py), lower through XLA's Triton custom call
(tests/test_triton_call.py) and run in Triton's interpreter against the specifications
(tests/test_tree_triton_interpreter.py); on the H200: tests/test_kernels_gpu.py and experiments/kernels/kernels_tree.py.
Measurements: experiments/notes/kernels.md, "Launching Triton kernels".
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels import tree_accept as accept_ref
from pallas_kernels import tree_build as build_ref
from pallas_kernels.tree import AcceptResult, TreeArrays, draft_topk, resolve_topk
from pallas_kernels.triton_call import bound_to


# jax-triton's per-call host work left the GPU idle 20-45 us around each call; XLA's Triton custom call matches the
# Pallas kernels (kernels.md, "Launching Triton kernels").
LAUNCHER = "xla"


@triton.jit
def _take_int(vec, iota, i):
    """vec[i] of an int32 vector for a dynamic scalar i."""
    return tl.sum(tl.where(iota == i, vec, 0), axis=0)


@triton.jit
def _accept_kernel(parent_ptr, tokens_ptr, target_ptr, path_ptr, accepted_ptr, next_token_ptr, KEEP: tl.constexpr,
                   SLOTS: tl.constexpr, DEPTHS: tl.constexpr, MAX_DEPTH: tl.constexpr):
    """Stream s: parent / tokens / target [KEEP] -> path [MAX_DEPTH + 1], num_accepted, next_token (AcceptResult's
    arrays, written in place: the call is this one kernel)."""
    s = tl.program_id(0)
    iota = tl.arange(0, SLOTS)
    in_tree = iota < KEEP
    parent = tl.load(parent_ptr + s * KEEP + iota, mask=in_tree, other=-1)
    tokens = tl.load(tokens_ptr + s * KEEP + iota, mask=in_tree, other=0)
    target = tl.load(target_ptr + s * KEEP + iota, mask=in_tree, other=0)
    depth_iota = tl.arange(0, DEPTHS)
    path = tl.where(depth_iota == 0, 0, -1)
    node = tl.full((), 0, tl.int32)
    accepted = tl.full((), 0, tl.int32)
    alive = tl.full((), 1, tl.int32)
    while (alive != 0) & (accepted < MAX_DEPTH):
        match = (parent == node) & (tokens == _take_int(target, iota, node))
        child = tl.min(tl.where(match, iota, SLOTS), axis=0)
        found = child < SLOTS
        accepted += found.to(tl.int32)
        path = tl.where(found & (depth_iota == accepted), child, path)
        node = tl.where(found, child, node)
        alive = found.to(tl.int32)
    tl.store(path_ptr + s * (MAX_DEPTH + 1) + depth_iota, path, mask=depth_iota <= MAX_DEPTH)
    tl.store(accepted_ptr + s, accepted)
    tl.store(next_token_ptr + s, _take_int(target, iota, node))


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret", "launcher"))
def tree_accept(tree: TreeArrays, target_tokens, max_depth: int, *, interpret: bool = False,
                launcher: str = LAUNCHER) -> AcceptResult:
    """tree with B + 1 slots, target_tokens [S, B+1] int32 -> AcceptResult, identical to
    `tree_accept.tree_accept_reference`. interpret: not available (a ValueError); launcher: `triton_call.LAUNCHERS`."""
    call = bound_to(launcher, interpret=interpret, op="tree_triton.tree_accept",
                    reference="tree_accept.tree_accept_reference (or ops.tree_accept)")
    return run_accept(call, tree, target_tokens, max_depth)


def run_accept(call, tree: TreeArrays, target_tokens, max_depth: int) -> AcceptResult:
    """tree_accept's host side through `call(*operands, kernel=, out_shape=, grid=, num_warps=, num_stages=,
    **constexprs)` (`triton_call` on the GPU; the tests pass Triton's interpreter on the CPU)."""
    n_streams, keep = accept_ref.check_accept_inputs(tree, target_tokens)
    per_stream = jax.ShapeDtypeStruct((n_streams,), jnp.int32)
    path, num_accepted, next_token = call(
        tree.parent.astype(jnp.int32), tree.tokens.astype(jnp.int32), jnp.asarray(target_tokens, jnp.int32),
        kernel=_accept_kernel, out_shape=(jax.ShapeDtypeStruct((n_streams, max_depth + 1), jnp.int32), per_stream,
                                          per_stream),
        grid=(n_streams,), num_warps=accept_ref.NUM_WARPS, num_stages=1, KEEP=keep,
        SLOTS=accept_ref.node_slots(keep), DEPTHS=accept_ref.path_slots(max_depth), MAX_DEPTH=max_depth)
    return AcceptResult(path, num_accepted, next_token)


@triton.jit
def _pack(valid, depth, rank, prev, RANK_BITS: tl.constexpr, PREV_BITS: tl.constexpr, DEPTH_BITS: tl.constexpr):
    """The frontier word of `tree_build.Packing`: rank | previous sibling | depth | valid (low to high)."""
    return ((valid.to(tl.int32) << (RANK_BITS + PREV_BITS + DEPTH_BITS)) | (depth << (RANK_BITS + PREV_BITS))
            | (prev << RANK_BITS) | rank)


@triton.jit
def _build_kernel(root_ptr, lp_ptr, ids_ptr, tokens_ptr, parent_ptr, depth_ptr, score_ptr, first_ptr, next_ptr,
                  BUDGET: tl.constexpr, MAX_DEPTH: tl.constexpr, K: tl.constexpr, SLOTS: tl.constexpr,
                  RANK_BITS: tl.constexpr, PREV_BITS: tl.constexpr, DEPTH_BITS: tl.constexpr, EMPTY: tl.constexpr):
    """Stream s: the top-K table lp / ids [MAX_DEPTH, K] and root -> the six node vectors [SLOTS]."""
    s = tl.program_id(0)
    iota = tl.arange(0, SLOTS)
    table = s * MAX_DEPTH * K
    neg_inf = float("-inf")
    zeros = tl.zeros((SLOTS,), tl.int32)
    tokens = tl.where(iota == 0, tl.load(root_ptr + s), zeros)
    parent = zeros - 1
    depth = zeros
    score = tl.where(iota == 0, 0.0, tl.full((SLOTS,), neg_inf, tl.float32))
    first = zeros - 1
    nxt = zeros - 1
    f_score = tl.where(iota == 0, tl.load(lp_ptr + table), tl.full((SLOTS,), neg_inf, tl.float32))
    f_count = tl.where(iota == 0, 0, zeros + EMPTY)
    f_word = tl.where(iota == 0, _pack(tl.full((), 1, tl.int32), 1, 0, 0, RANK_BITS, PREV_BITS, DEPTH_BITS), zeros)
    pushes = tl.full((), 1, tl.int32)
    for i in range(BUDGET):
        n = i + 1
        valid = f_count != EMPTY
        best = tl.max(tl.where(valid, f_score, neg_inf), axis=0)
        p = tl.argmin(tl.where(valid & (f_score == best), f_count, EMPTY), axis=0).to(tl.int32)
        word = _take_int(f_word, iota, p)
        popped = ((word >> (RANK_BITS + PREV_BITS + DEPTH_BITS)) & 1) == 1    # False once the heap is empty
        d = (word >> (RANK_BITS + PREV_BITS)) & ((1 << DEPTH_BITS) - 1)
        r = word & ((1 << RANK_BITS) - 1)
        prev = (word >> RANK_BITS) & ((1 << PREV_BITS) - 1)
        parent_score = tl.max(tl.where(iota == p, score, neg_inf), axis=0)
        row = tl.minimum(tl.maximum(d - 1, 0), MAX_DEPTH - 1)
        token = tl.load(ids_ptr + table + row * K + tl.minimum(r, K - 1))
        sib_lp = tl.load(lp_ptr + table + row * K + tl.minimum(r + 1, K - 1))
        child_lp = tl.load(lp_ptr + table + tl.minimum(d, MAX_DEPTH - 1) * K)
        # the popped node, linked after its previous sibling (or as the parent's first child)
        at_n = iota == n
        tokens = tl.where(at_n, tl.where(popped, token, 0), tokens)
        parent = tl.where(at_n, tl.where(popped, p, -1), parent)
        depth = tl.where(at_n, tl.where(popped, d, 0), depth)
        score = tl.where(at_n, tl.where(popped, best, neg_inf), score)
        first = tl.where(popped & (r == 0) & (iota == p), n, first)
        nxt = tl.where(popped & (r > 0) & (iota == prev), n, nxt)
        # (1) the next sibling takes slot p, (2) the first child takes slot n
        has_sib = popped & (r + 1 < K)
        has_child = popped & (d < MAX_DEPTH)
        at_p = iota == p
        f_score = tl.where(at_n, best + child_lp, tl.where(at_p, parent_score + sib_lp, f_score))
        f_word = tl.where(at_n, _pack(has_child, d + 1, 0, 0, RANK_BITS, PREV_BITS, DEPTH_BITS),
                          tl.where(at_p, _pack(has_sib, d, r + 1, n, RANK_BITS, PREV_BITS, DEPTH_BITS), f_word))
        f_count = tl.where(at_p, tl.where(has_sib, pushes, EMPTY), f_count)
        pushes += has_sib.to(tl.int32)
        f_count = tl.where(at_n, tl.where(has_child, pushes, EMPTY), f_count)
        pushes += has_child.to(tl.int32)
    out = s * SLOTS + iota
    tl.store(tokens_ptr + out, tokens)
    tl.store(parent_ptr + out, parent)
    tl.store(depth_ptr + out, depth)
    tl.store(score_ptr + out, score)
    tl.store(first_ptr + out, first)
    tl.store(next_ptr + out, nxt)


def tree_build(draft_logits, root, budget: int, topk: int | None = None, *,
               config: build_ref.BuildConfig | None = None, interpret: bool = False,
               launcher: str = LAUNCHER) -> TreeArrays:
    """draft_logits [S, D, V], root [S] int -> TreeArrays, identical to `tree_build.tree_build_reference`: the
    top-K per depth (`draft_topk`, XLA), then the build kernel."""
    k = resolve_topk(budget, draft_logits.shape[-1], topk)
    top_logprobs, top_ids = draft_topk(draft_logits, k)
    return tree_build_from_topk(top_logprobs, top_ids, jnp.asarray(root), budget=budget, config=config,
                                interpret=interpret, launcher=launcher)


@functools.partial(jax.jit, static_argnames=("budget", "config", "interpret", "launcher"))
def tree_build_from_topk(top_logprobs, top_ids, root, *, budget: int, config: build_ref.BuildConfig | None = None,
                         interpret: bool = False, launcher: str = LAUNCHER) -> TreeArrays:
    """top_logprobs [S, D, K] float32, top_ids [S, D, K] int32, root [S] int -> TreeArrays (B + 1 slots), the
    specification's arrays for that top-K. interpret: not available (a ValueError); launcher:
    `triton_call.LAUNCHERS`."""
    call = bound_to(launcher, interpret=interpret, op="tree_triton.tree_build_from_topk",
                    reference="tree_build.tree_build_reference (or ops.tree_build)")
    return run_build(call, top_logprobs, top_ids, root, budget, config)


def run_build(call, top_logprobs, top_ids, root, budget: int, config: build_ref.BuildConfig | None) -> TreeArrays:
    """tree_build_from_topk's host side through `call` (as `run_accept`'s)."""
    build_ref.check_topk_table(top_logprobs, top_ids, root)
    n_streams, max_depth, k = top_logprobs.shape
    slots = build_ref.node_slots(budget)
    packing = build_ref.Packing.for_tree(budget, slots, max_depth)
    int_out = jax.ShapeDtypeStruct((n_streams, slots), jnp.int32)
    tokens, parent, depth, score, first_child, next_sibling = call(
        jnp.asarray(root, jnp.int32), jnp.asarray(top_logprobs, jnp.float32), jnp.asarray(top_ids, jnp.int32),
        kernel=_build_kernel,
        out_shape=(int_out, int_out, int_out, jax.ShapeDtypeStruct((n_streams, slots), jnp.float32), int_out, int_out),
        grid=(n_streams,), num_warps=(config or build_ref.BuildConfig()).warps(slots), num_stages=1, BUDGET=budget,
        MAX_DEPTH=max_depth, K=k, SLOTS=slots, RANK_BITS=packing.rank_bits, PREV_BITS=packing.prev_bits,
        DEPTH_BITS=packing.depth_bits, EMPTY=build_ref.EMPTY)
    return build_ref.tree_arrays(tokens, parent, depth, score, first_child, next_sibling, budget, max_depth)
