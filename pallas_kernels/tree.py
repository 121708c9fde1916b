"""Draft trees: the exact heapq reference (the specification), the jit-able builder, and tree accept.

A DDTree round drafts per-position distributions for depths 1..D (D = L - 1, L = block size) after a root token
(the bonus, depth 0). The tree holds the B most probable prefixes of the draft, found best-first:

  * fp32 `log_softmax` of the draft logits, then the top K tokens per depth (K = min(B, V) unless given; ties in
    log-prob go to the smaller token id, as `lax.top_k` does);
  * a heap keyed by (-score, push counter) starts with the candidate (depth 1, rank 0) under the root; the score of a
    candidate is the float32 sum of log-probs along its path (`score(parent) + lp[depth][rank]`);
  * popping candidate (d, r) with parent p makes it node n (nodes numbered in pop order, so parent < child); then it
    pushes (1) its next sibling (d, r + 1) under p if r + 1 < K, and (2) its first child (d + 1, 0) under n if d < D;
  * ties in score break toward the candidate pushed first; the search stops after B pops or when the heap is empty.

Node 0 is the root and does not count toward the budget B: every stream has B + 1 slots; unused slots are padding
(token 0, parent -1, depth 0, no links, score -inf, visible only to itself).

`build_tree_heapq` is the specification: its log-probs come from a float64 numpy log-softmax and a stable argsort
(`reference_topk`), its search is python heapq. `build_tree` is the same search in pure JAX (jit-able, fixed shapes)
on the float32 `draft_topk`: given the same top-K it returns identical arrays, ties included; from logits its
log-probs agree with the specification's to float32 rounding. `accept_tree` walks a tree against the target's tokens.
"""
from __future__ import annotations

import heapq
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_NODES_CAP = 2**31 - 1  # node counts are int32 on device; larger counts are reported as this cap


class TreeArrays(NamedTuple):
    """One draft tree per stream; S streams, B + 1 slots (slot 0 = root)."""

    tokens: jax.Array  # [S, B+1] int32; tokens[:, 0] = root, 0 for padding
    parent: jax.Array  # [S, B+1] int32; -1 for the root and padding
    depth: jax.Array  # [S, B+1] int32; 0 for the root and padding
    first_child: jax.Array  # [S, B+1] int32; -1 for none
    next_sibling: jax.Array  # [S, B+1] int32; siblings in increasing index = decreasing score; -1 for none
    visible: jax.Array  # [S, B+1, B+1] bool; row i = row parent(i) | {i}; padding rows see only themselves
    num_nodes: jax.Array  # [S] int32; 1 + number of popped nodes
    score: jax.Array  # [S, B+1] float32; path log-prob, 0 for the root, -inf for padding


class AcceptResult(NamedTuple):
    """The outcome of one accept walk per stream; D = max depth."""

    path: jax.Array  # [S, D+1] int32; node indices from the root (0), padded with -1
    num_accepted: jax.Array  # [S] int32; accepted non-root nodes, 0..D
    next_token: jax.Array  # [S] int32; the target's token at the last accepted node (the new bonus)


# ----------------------------------------------------------------------------------------------------- budgets


def resolve_topk(budget: int, vocab_size: int, topk: int | None = None) -> int:
    """Tokens kept per depth: `topk` (default: the budget) capped at the vocabulary; at least 1 so shapes stay valid."""
    if topk is not None and topk < 1:
        raise ValueError(f"topk={topk} must be >= 1 (or None for min(budget, vocab))")
    k = budget if topk is None else topk
    return max(1, min(k, vocab_size))


def max_tree_nodes(depths: int, k: int) -> int:
    """Number of prefixes of lengths 1..depths with k choices per position: sum_{d=1..depths} k^d, capped at
    MAX_NODES_CAP."""
    total, level = 0, 1
    for _ in range(max(depths, 0)):
        level *= k
        total += level
        if total >= MAX_NODES_CAP:
            return MAX_NODES_CAP
    return total


def check_budget(budget: int, block_size: int, vocab_size: int) -> None:
    """Raise ValueError when a tree of `budget` non-root nodes cannot be drafted from blocks of `block_size`."""
    if block_size < 2:
        raise ValueError(f"block_size={block_size} must be >= 2 (the root plus at least one drafted depth)")
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    if budget < 0:
        raise ValueError(f"tree budget={budget} must be >= 0 (0 means plain autoregressive decoding)")
    k = min(budget, vocab_size)
    capacity = max_tree_nodes(block_size - 1, k)
    if budget > capacity:
        raise ValueError(f"tree budget={budget} exceeds the {capacity} prefixes that block_size={block_size} "
                         f"(depth {block_size - 1}) and top-{k} per depth can hold; lower the budget or raise the "
                         f"block size")


# ----------------------------------------------------------------------------------------------------- top-K


def draft_topk(draft_logits, k: int, chunk: int | None = None):
    """draft_logits [S, D, V] -> (top_logprobs [S, D, k] float32, top_ids [S, D, k] int32), by decreasing log-prob,
    ties to the smaller token id. jit-able; `k` static. `chunk`: as in `chunked_top_k` (0: one top_k over each
    whole row)."""
    lp = jax.nn.log_softmax(jnp.asarray(draft_logits, jnp.float32), axis=-1)
    values, ids = chunked_top_k(lp, k, chunk)
    return values, ids.astype(jnp.int32)


TOPK_CHUNK_MIN_VOCAB = 16384  # below this a full-row top_k is launch-bound (32 us at V = 4096 on the H200) and two
#                              smaller top_ks would cost more launches, not fewer bytes


def topk_chunk_size(vocab_size: int, k: int) -> int:
    """Chunk width for `chunked_top_k`: the power of two nearest sqrt(V / k), which balances the two top-Ks it runs
    (over V / c chunk maxima and over k * c candidates); 0 (one top_k over the row) when V < TOPK_CHUNK_MIN_VOCAB
    or chunking would not shrink the sorted entries."""
    c = 1 << max(0, round(np.log2(max(vocab_size / k, 1)) / 2))
    n_chunks = -(-vocab_size // c)
    useful = c > 1 and n_chunks >= k and n_chunks + k * c < vocab_size
    return c if useful and vocab_size >= TOPK_CHUNK_MIN_VOCAB else 0


def chunked_top_k(x, k: int, chunk: int | None = None):
    """Exactly `lax.top_k(x, k)` over the last axis (values by decreasing value, ties to the smaller index) without
    sorting whole rows: XLA:GPU runs `top_k` with k > 16 as a segmented sort of the full row (2.6 ms for 240 rows of
    163840 on the H200, experiments/results/kernels/kernels_tree.json).

    x [..., V] -> (values [..., k], indices [..., k] int32). The row is cut into chunks of `chunk` (default
    `topk_chunk_size`; the row is padded with -inf at the end); the top k chunks by their maximum are taken (ties to
    the smaller chunk), put back in index order, and one top_k over their k * chunk entries gives the answer. Exact:
    an entry among the row's top k (order: larger value, then smaller index) lies in a chunk among the top k chunks
    (order: larger maximum, then smaller chunk), else k other chunks would each hold an entry ahead of it.
    """
    v = x.shape[-1]
    chunk = topk_chunk_size(v, k) if chunk is None else chunk
    n_chunks = -(-v // chunk) if chunk else 0
    if not chunk or n_chunks < k:
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    lead = x.shape[:-1]
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, n_chunks * chunk - v)], constant_values=-jnp.inf)
    blocks = padded.reshape(*lead, n_chunks, chunk)
    _, top_chunks = jax.lax.top_k(blocks.max(axis=-1), k)
    top_chunks = jnp.sort(top_chunks, axis=-1)  # index order, so ties among candidates go to the smaller index
    cand = jnp.take_along_axis(blocks, top_chunks[..., None], axis=-2).reshape(*lead, k * chunk)
    values, pos = jax.lax.top_k(cand, k)
    ids = top_chunks[..., None] * chunk + jnp.arange(chunk, dtype=top_chunks.dtype)
    ids = jnp.take_along_axis(ids.reshape(*lead, k * chunk), pos, axis=-1)
    return values, ids.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------- heapq spec


def _check_topk_shapes(top_logprobs, top_ids, root):
    if top_logprobs.ndim != 3 or top_logprobs.shape[1] < 1:
        raise ValueError(f"top_logprobs {tuple(top_logprobs.shape)} must be [S, D, K] with D >= 1 drafted depths "
                         f"(block_size >= 2)")
    if top_ids.shape != top_logprobs.shape or np.shape(root) != top_logprobs.shape[:1]:
        raise ValueError(f"top_ids {tuple(top_ids.shape)} and root {tuple(np.shape(root))} must be "
                         f"{tuple(top_logprobs.shape)} and {tuple(top_logprobs.shape[:1])}")


def build_tree_heapq_from_topk(top_logprobs, top_ids, root, budget: int) -> TreeArrays:
    """The host part of the specification: best-first search with python heapq, one stream at a time.

    top_logprobs [S, D, K] float32, top_ids [S, D, K] int, root [S] int -> TreeArrays of numpy arrays.
    """
    top_logprobs = np.asarray(top_logprobs, np.float32)
    top_ids = np.asarray(top_ids)
    root = np.asarray(root)
    _check_topk_shapes(top_logprobs, top_ids, root)
    n_streams, max_depth, k = top_logprobs.shape
    slots = budget + 1
    tokens = np.zeros((n_streams, slots), np.int32)
    parent = np.full((n_streams, slots), -1, np.int32)
    depth = np.zeros((n_streams, slots), np.int32)
    first_child = np.full((n_streams, slots), -1, np.int32)
    next_sibling = np.full((n_streams, slots), -1, np.int32)
    visible = np.zeros((n_streams, slots, slots), bool)
    num_nodes = np.ones(n_streams, np.int32)
    score = np.full((n_streams, slots), -np.inf, np.float32)

    for s in range(n_streams):
        lp, ids = top_logprobs[s], top_ids[s]
        tokens[s, 0] = root[s]
        score[s, 0] = 0.0
        last_child = {}
        heap = []  # entries (-score, push counter, depth, rank, parent)
        pushes = 0

        def push(sc, d, r, p):
            nonlocal pushes
            heapq.heappush(heap, (-float(sc), pushes, d, r, p))
            pushes += 1

        if budget >= 1:
            push(lp[0, 0], 1, 0, 0)
        n = 0
        while heap and n < budget:
            _, _, d, r, p = heapq.heappop(heap)
            n += 1
            tokens[s, n] = ids[d - 1, r]
            parent[s, n] = p
            depth[s, n] = d
            score[s, n] = np.float32(score[s, p] + lp[d - 1, r])
            if p in last_child:
                next_sibling[s, last_child[p]] = n
            else:
                first_child[s, p] = n
            last_child[p] = n
            if r + 1 < k:
                push(np.float32(score[s, p] + lp[d - 1, r + 1]), d, r + 1, p)
            if d + 1 <= max_depth:
                push(np.float32(score[s, n] + lp[d, 0]), d + 1, 0, n)
        num_nodes[s] = n + 1
        for i in range(slots):
            if parent[s, i] >= 0:
                visible[s, i] = visible[s, parent[s, i]]
            visible[s, i, i] = True
    return TreeArrays(tokens, parent, depth, first_child, next_sibling, visible, num_nodes, score)


def reference_topk(draft_logits, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The specification's top-K, independent of `draft_topk`: draft_logits [S, D, V] -> (top_logprobs [S, D, k]
    float32, top_ids [S, D, k] int32).

    A float64 numpy log-softmax (shifted by the row maximum), then a stable argsort by decreasing log-prob, so ties go
    to the smaller token id; the log-probs are rounded to float32 last.
    """
    x = np.asarray(draft_logits, np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    ids = np.argsort(-logprobs, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(logprobs, ids, axis=-1).astype(np.float32), ids.astype(np.int32)


def build_tree_heapq(draft_logits, root, budget: int, topk: int | None = None) -> TreeArrays:
    """The specification: draft_logits [S, D, V], root [S] -> TreeArrays (numpy): `reference_topk`, then the host
    search (`build_tree_heapq_from_topk`)."""
    k = resolve_topk(budget, np.shape(draft_logits)[-1], topk)
    top_logprobs, top_ids = reference_topk(draft_logits, k)
    return build_tree_heapq_from_topk(top_logprobs, top_ids, root, budget)


# ----------------------------------------------------------------------------------------------------- jit builder


def tree_visible(parent, max_depth: int):
    """parent [..., N] int32 (-1 for root/padding) -> visible [..., N, N] bool: row i = i and its ancestors.
    `max_depth` bounds the ancestor chain. The climb is unrolled: on the GPU, XLA fuses it into one kernel, where a
    while loop would cost a host round trip per level."""
    n = parent.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    visible = jnp.broadcast_to(idx[:, None] == idx[None, :], parent.shape + (n,))
    ancestor = parent
    for _ in range(max_depth):
        visible = visible | (ancestor[..., :, None] == idx)
        up = jnp.take_along_axis(parent, jnp.maximum(ancestor, 0), axis=-1)
        ancestor = jnp.where(ancestor >= 0, up, -1)
    return visible


def tree_links(parent):
    """parent [..., N] int32 (-1 for root/padding) -> (first_child [..., N], next_sibling [..., N]): children
    linked in increasing index, -1 for none."""
    n = parent.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    is_child = parent[..., None, :] == idx[:, None]  # [..., i, j]: j is a child of i
    first_child = jnp.where(is_child.any(-1), jnp.argmax(is_child, axis=-1).astype(jnp.int32), -1)
    later_sibling = ((parent[..., None, :] == parent[..., :, None]) & (idx[None, :] > idx[:, None])
                     & (parent[..., :, None] >= 0))  # [..., i, j]: j is a later sibling of i
    next_sibling = jnp.where(later_sibling.any(-1), jnp.argmax(later_sibling, axis=-1).astype(jnp.int32), -1)
    return first_child, next_sibling


def _search_one(lp, ids, root, budget: int):
    """Best-first search for one stream. lp/ids [D, K] -> (tokens, parent, depth, score) [B+1], num_nodes [].

    The frontier holds at most one candidate per node (the node's next unpopped child rank), so it is indexed by the
    parent: slot p = (rank, score, push counter); the candidate's depth is depth[p] + 1; counter EMPTY = no candidate.
    """
    max_depth, k = lp.shape
    slots = budget + 1
    neg_inf = jnp.float32(-jnp.inf)
    empty = jnp.int32(np.iinfo(np.int32).max)
    tokens = jnp.zeros(slots, jnp.int32).at[0].set(root.astype(jnp.int32))
    parent = jnp.full(slots, -1, jnp.int32)
    depth = jnp.zeros(slots, jnp.int32)
    score = jnp.full(slots, neg_inf).at[0].set(0.0)
    f_rank = jnp.zeros(slots, jnp.int32)
    f_score = jnp.full(slots, neg_inf).at[0].set(lp[0, 0])
    f_count = jnp.full(slots, empty).at[0].set(0)

    def step(i, carry):
        tokens, parent, depth, score, f_rank, f_score, f_count, pushes = carry
        n = i + 1
        valid = f_count != empty
        best = jnp.max(jnp.where(valid, f_score, neg_inf))
        p = jnp.argmin(jnp.where(valid & (f_score == best), f_count, empty)).astype(jnp.int32)
        popped = valid[p]  # False once the heap is empty: slot n stays padding
        d, r, sc = depth[p] + 1, f_rank[p], f_score[p]
        tokens = tokens.at[n].set(jnp.where(popped, ids[d - 1, r], 0))
        parent = parent.at[n].set(jnp.where(popped, p, -1))
        depth = depth.at[n].set(jnp.where(popped, d, 0))
        score = score.at[n].set(jnp.where(popped, sc, neg_inf))
        # (1) the next sibling takes the popped candidate's slot p
        has_sib = popped & (r + 1 < k)
        f_rank = f_rank.at[p].set(r + 1)
        f_score = f_score.at[p].set(score[p] + lp[d - 1, jnp.minimum(r + 1, k - 1)])
        f_count = f_count.at[p].set(jnp.where(has_sib, pushes, empty))
        pushes = pushes + has_sib.astype(jnp.int32)
        # (2) the first child goes to slot n
        has_child = popped & (d + 1 <= max_depth)
        f_score = f_score.at[n].set(sc + lp[jnp.minimum(d, max_depth - 1), 0])
        f_count = f_count.at[n].set(jnp.where(has_child, pushes, empty))
        pushes = pushes + has_child.astype(jnp.int32)
        return tokens, parent, depth, score, f_rank, f_score, f_count, pushes

    carry = (tokens, parent, depth, score, f_rank, f_score, f_count, jnp.int32(1))
    tokens, parent, depth, score, *_ = jax.lax.fori_loop(0, budget, step, carry)
    num_nodes = 1 + jnp.sum(parent >= 0).astype(jnp.int32)
    return tokens, parent, depth, score, num_nodes


def build_tree_from_topk(top_logprobs, top_ids, root, budget: int) -> TreeArrays:
    """top_logprobs [S, D, K] float32, top_ids [S, D, K] int32, root [S] -> TreeArrays (jnp). jit-able, static
    budget."""
    _check_topk_shapes(top_logprobs, top_ids, root)
    max_depth = top_logprobs.shape[1]
    search = jax.vmap(lambda lp, ids, r: _search_one(lp, ids, r, budget))
    tokens, parent, depth, score, num_nodes = search(jnp.asarray(top_logprobs, jnp.float32),
                                                     jnp.asarray(top_ids, jnp.int32), jnp.asarray(root))
    first_child, next_sibling = tree_links(parent)
    return TreeArrays(tokens, parent, depth, first_child, next_sibling, tree_visible(parent, max_depth), num_nodes,
                      score)


def prefix_tree(tree: TreeArrays, budget: int) -> TreeArrays:
    """The first budget + 1 nodes of a best-first tree (`budget` static, at most the tree's): its nodes, links
    beyond the prefix cut to -1, visible [S, B+1, B+1]. Nodes are in pop order (a parent before its children), so
    this is exactly the tree a build at this budget returns, given the same top-K per depth or the default
    K = min(B, V): a candidate of rank >= B can only be pushed after B pops, so the extra candidates of a larger K
    never reach the first B pops, and the other candidates' push counters keep their order (ties break as before)."""
    keep = budget + 1
    cut = lambda links: jnp.where(links < keep, links, -1)
    return TreeArrays(tree.tokens[:, :keep], tree.parent[:, :keep], tree.depth[:, :keep],
                      cut(tree.first_child[:, :keep]), cut(tree.next_sibling[:, :keep]),
                      tree.visible[:, :keep, :keep], jnp.minimum(tree.num_nodes, keep), tree.score[:, :keep])


def build_tree(draft_logits, root, budget: int, topk: int | None = None) -> TreeArrays:
    """draft_logits [S, D, V], root [S] int -> TreeArrays (jnp): `build_tree_heapq` with the float32 `draft_topk`.

    Pure JAX with fixed shapes: jit with `budget` and `topk` static.
    """
    k = resolve_topk(budget, draft_logits.shape[-1], topk)
    top_logprobs, top_ids = draft_topk(draft_logits, k)
    return build_tree_from_topk(top_logprobs, top_ids, root, budget)


# ----------------------------------------------------------------------------------------------------- accept


def accept_tree_python(tree: TreeArrays, target_tokens, max_depth: int) -> AcceptResult:
    """The accept walk as a plain python loop over streams, following first_child / next_sibling (numpy)."""
    first_child = np.asarray(tree.first_child)
    next_sibling = np.asarray(tree.next_sibling)
    tokens = np.asarray(tree.tokens)
    target_tokens = np.asarray(target_tokens)
    n_streams = tokens.shape[0]
    path = np.full((n_streams, max_depth + 1), -1, np.int32)
    num_accepted = np.zeros(n_streams, np.int32)
    next_token = np.zeros(n_streams, np.int32)
    for s in range(n_streams):
        node, accepted = 0, 0
        path[s, 0] = 0
        while accepted < max_depth:
            want = target_tokens[s, node]
            child = first_child[s, node]
            while child >= 0 and tokens[s, child] != want:
                child = next_sibling[s, child]
            if child < 0:
                break
            node = child
            accepted += 1
            path[s, accepted] = node
        num_accepted[s] = accepted
        next_token[s] = target_tokens[s, node]
    return AcceptResult(path, num_accepted, next_token)


def accept_tree(tree: TreeArrays, target_tokens, max_depth: int) -> AcceptResult:
    """Accept walk: tree with B + 1 slots, target_tokens [S, B+1] int32 (the target's token at each node) ->
    AcceptResult. jit-able with `max_depth` static.

    From the root, the child of the current node carrying the target's token (the first in sibling order; the
    children of a node are exactly the slots whose parent is that node) becomes the current node, for at most
    `max_depth` steps. Emitted tokens = tokens[path[1..num_accepted]] + [next_token].
    """
    parent = jnp.asarray(tree.parent)
    tokens = jnp.asarray(tree.tokens)
    target_tokens = jnp.asarray(target_tokens, jnp.int32)

    def walk(parent, tokens, target):
        def step(i, carry):
            node, accepted, alive, path = carry
            match = (parent == node) & (tokens == target[node]) & alive
            found = match.any()
            child = jnp.argmax(match).astype(jnp.int32)
            node = jnp.where(found, child, node)
            accepted = accepted + found.astype(jnp.int32)
            path = path.at[i + 1].set(jnp.where(found, child, -1))
            return node, accepted, found, path

        path = jnp.full(max_depth + 1, -1, jnp.int32).at[0].set(0)
        node, accepted, _, path = jax.lax.fori_loop(0, max_depth, step, (jnp.int32(0), jnp.int32(0), True, path))
        return path, accepted, target[node]

    path, num_accepted, next_token = jax.vmap(walk)(parent, tokens, target_tokens)
    return AcceptResult(path, num_accepted, next_token)


def random_tree_visible(rng: np.random.Generator, streams: int, nodes: int) -> np.ndarray:
    """visible [S, T, T] bool of random trees (parent[i] drawn below i; row i = row parent(i) | {i}): test inputs."""
    vis = np.zeros((streams, nodes, nodes), bool)
    for s in range(streams):
        for i in range(nodes):
            if i:
                vis[s, i] = vis[s, rng.integers(0, i)]
            vis[s, i, i] = True
    return vis
