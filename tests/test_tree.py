"""Draft trees: draft_topk equals the float64 reference top-K, the jit builder equals the heapq specification (ties
included), hand-made trees, invariants, accept.

The specification's log-probs come from numpy in float64 (`reference_topk`), the jit builder's from jax in float32
(`draft_topk`): from the same top-K the two builders must give identical arrays, ties included; from logits without
near ties the trees must be the same and the path scores may differ by float32 rounding (SCORE_RTOL). (With ties,
sums equal in exact arithmetic may round apart differently in the two, so ties are checked from the same top-K.)
"""
import itertools

import jax
import numpy as np
import pytest

from pallas_kernels import tree as T
from conftest import assert_topk_matches_reference, random_targets

build_jit = jax.jit(T.build_tree, static_argnums=(2, 3))
build_from_topk_jit = jax.jit(T.build_tree_from_topk, static_argnums=3)
accept_jit = jax.jit(T.accept_tree, static_argnums=2)
topk_jit = jax.jit(T.draft_topk, static_argnums=(1, 2))
# Path scores from float32 log-probs against the float64 reference's, rounded: a few float32 ulps per depth.
SCORE_RTOL = 1e-6


def assert_trees_equal(got, want, score_rtol: float = 0.0):
    """Every field bit for bit (shape and dtype too); with score_rtol, scores within that relative tolerance."""
    for name, g, w in zip(T.TreeArrays._fields, got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, g.dtype, w.shape, w.dtype)
        if name == "score" and score_rtol:
            np.testing.assert_allclose(g, w, rtol=score_rtol, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)


def random_logits(rng, n_streams, max_depth, vocab, ties: bool):
    """[S, D, V] float32. With ties: few distinct integer logits and the same row at every depth, so equal log-probs
    (top-K ties) and equal path sums (a + b == b + a) both occur."""
    if not ties:
        return rng.normal(scale=2.0, size=(n_streams, max_depth, vocab)).astype(np.float32)
    row = rng.integers(0, 4, size=(n_streams, 1, vocab)).astype(np.float32)
    return np.repeat(row, max_depth, axis=1)


def chain_tokens(tree, s, i):
    """Tokens along the path from the root (excluded) to node i of stream s."""
    out = []
    while i > 0:
        out.append(int(tree.tokens[s, i]))
        i = int(tree.parent[s, i])
    return tuple(reversed(out))


# --------------------------------------------------------------------------------------------- jit == heapq


def _combos():
    """B x L x K; the default run keeps every K at L = 16 and K = B at the other block sizes (the rest is slow)."""
    for budget, block in itertools.product([0, 1, 7, 64, 300], [2, 8, 16]):
        for k in sorted({1, 4, budget}):
            if budget == 0 and k != 0:
                continue
            marks = [] if block == 16 or k == budget else [pytest.mark.slow]
            yield pytest.param(budget, block, k or None, marks=marks)


def assert_jit_matches_heapq(logits, root, budget: int, topk=None):
    """The jit search from the specification's top-K gives the specification's arrays bit for bit."""
    top = T.reference_topk(logits, T.resolve_topk(budget, np.shape(logits)[-1], topk))
    assert_trees_equal(build_from_topk_jit(*top, root, budget), T.build_tree_heapq(logits, root, budget, topk))


@pytest.mark.parametrize("budget,block,topk", list(_combos()))
def test_jit_matches_heapq(budget, block, topk):
    rng = np.random.default_rng(1000 * budget + 10 * block + (topk or 0))
    vocab = 512
    logits = np.concatenate([random_logits(rng, 2, block - 1, vocab, ties=False),
                             random_logits(rng, 2, block - 1, vocab, ties=True)])
    assert_jit_matches_heapq(logits, rng.integers(0, vocab, size=4), budget, topk)


@pytest.mark.parametrize("budget,block,vocab,topk", [(7, 16, 512, None), (64, 16, 512, 4), (300, 8, 512, None),
                                                     (40, 4, 3, None)])
def test_build_tree_from_logits_matches_heapq(budget, block, vocab, topk):
    """End to end (draft_topk, then the search) on logits without near ties: the specification's trees."""
    rng = np.random.default_rng(budget + block + vocab)
    logits = random_logits(rng, 3, block - 1, vocab, ties=False)
    root = rng.integers(0, vocab, size=3)
    assert_trees_equal(build_jit(logits, root, budget, topk), T.build_tree_heapq(logits, root, budget, topk),
                       SCORE_RTOL)


@pytest.mark.parametrize("budget,block,vocab", [(50, 3, 4), (300, 4, 3), (9, 5, 2)])
def test_jit_matches_heapq_small_vocab(budget, block, vocab):
    """V < B, including trees the heap cannot fill (padding slots)."""
    rng = np.random.default_rng(budget + vocab)
    logits = np.concatenate([random_logits(rng, 2, block - 1, vocab, ties=False),
                             random_logits(rng, 2, block - 1, vocab, ties=True)])
    root = rng.integers(0, vocab, size=4)
    assert_jit_matches_heapq(logits, root, budget)
    if T.max_tree_nodes(block - 1, vocab) < budget:
        assert (T.build_tree_heapq(logits, root, budget).num_nodes < budget + 1).all()


def test_masked_vocab_minus_inf_scores():
    """-inf logits give -inf scores that are still popped, in push order, before the heap runs dry."""
    rng = np.random.default_rng(7)
    logits = random_logits(rng, 3, 3, 6, ties=False)
    logits[:, :, 2:] = -np.inf
    root = rng.integers(0, 6, size=3)
    want = T.build_tree_heapq(logits, root, 40)
    assert np.isneginf(want.score).any() and (want.num_nodes == 41).all()
    assert_jit_matches_heapq(logits, root, 40)


# --------------------------------------------------------------------------------------------- hand-made trees

HAND_CASES = [
    # (top_logprobs [D][K], top_ids [D][K], root, budget, expected fields)
    dict(  # ties: sibling pushed before the first child wins; depth is not sorted
        lp=[[-1.0, -2.0], [-1.0, -3.0]], ids=[[10, 11], [20, 21]], root=5, budget=4,
        tokens=[5, 10, 11, 20, 20], parent=[-1, 0, 0, 1, 2], depth=[0, 1, 1, 2, 2],
        first_child=[1, 3, 4, -1, -1], next_sibling=[-1, 2, -1, -1, -1], score=[0, -1, -2, -2, -3],
        num_nodes=5, visible=[{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 2, 4}]),
    dict(  # deep before wide, then a tie between an old sibling and a newer one: the older push wins
        lp=[[-1.0, -6.0], [-1.0, -5.0]], ids=[[3, 4], [6, 7]], root=2, budget=3,
        tokens=[2, 3, 6, 4], parent=[-1, 0, 1, 0], depth=[0, 1, 2, 1],
        first_child=[1, 2, -1, -1], next_sibling=[-1, 3, -1, -1], score=[0, -1, -2, -6],
        num_nodes=4, visible=[{0}, {0, 1}, {0, 1, 2}, {0, 3}]),
    dict(  # chain (top-1 per depth, budget = D)
        lp=[[-1.0], [-1.0], [-1.0]], ids=[[7], [8], [9]], root=1, budget=3,
        tokens=[1, 7, 8, 9], parent=[-1, 0, 1, 2], depth=[0, 1, 2, 3],
        first_child=[1, 2, 3, -1], next_sibling=[-1, -1, -1, -1], score=[0, -1, -2, -3],
        num_nodes=4, visible=[{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]),
    dict(  # the heap runs dry: padding slots
        lp=[[-1.0, -2.0]], ids=[[3, 4]], root=9, budget=4,
        tokens=[9, 3, 4, 0, 0], parent=[-1, 0, 0, -1, -1], depth=[0, 1, 1, 0, 0],
        first_child=[1, -1, -1, -1, -1], next_sibling=[-1, 2, -1, -1, -1], score=[0, -1, -2, -np.inf, -np.inf],
        num_nodes=3, visible=[{0}, {0, 1}, {0, 2}, {3}, {4}]),
]


def hand_tree(case):
    lp = np.asarray(case["lp"], np.float32)[None]
    ids = np.asarray(case["ids"], np.int32)[None]
    root = np.asarray([case["root"]], np.int32)
    return lp, ids, root


@pytest.mark.parametrize("case", HAND_CASES, ids=range(len(HAND_CASES)))
def test_hand_made_trees(case):
    lp, ids, root = hand_tree(case)
    slots = case["budget"] + 1
    visible = np.zeros((1, slots, slots), bool)
    for i, row in enumerate(case["visible"]):
        visible[0, i, sorted(row)] = True
    want = T.TreeArrays(
        tokens=np.asarray([case["tokens"]], np.int32), parent=np.asarray([case["parent"]], np.int32),
        depth=np.asarray([case["depth"]], np.int32), first_child=np.asarray([case["first_child"]], np.int32),
        next_sibling=np.asarray([case["next_sibling"]], np.int32), visible=visible,
        num_nodes=np.asarray([case["num_nodes"]], np.int32), score=np.asarray([case["score"]], np.float32))
    assert_trees_equal(T.build_tree_heapq_from_topk(lp, ids, root, case["budget"]), want)
    assert_trees_equal(build_from_topk_jit(lp, ids, root, case["budget"]), want)


# --------------------------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("budget,block,vocab", [(10, 4, 3), (39, 4, 3), (20, 5, 2), (30, 3, 6)])
def test_invariants_and_top_b_prefixes(budget, block, vocab):
    rng = np.random.default_rng(budget * block)
    n_streams, depth_max = 3, block - 1
    logits = random_logits(rng, n_streams, depth_max, vocab, ties=False)
    root = rng.integers(0, vocab, size=n_streams)
    tree = T.build_tree_heapq(logits, root, budget)  # == build_tree (test_jit_matches_heapq)
    k = T.resolve_topk(budget, vocab)
    top_lp, top_ids = T.reference_topk(logits, k)
    for s in range(n_streams):
        n = int(tree.num_nodes[s])
        assert n == 1 + min(budget, T.max_tree_nodes(depth_max, k))
        for i in range(1, n):
            p = tree.parent[s, i]
            assert 0 <= p < i and tree.depth[s, i] == tree.depth[s, p] + 1
            ancestors = {i}
            while p >= 0:
                ancestors.add(int(p))
                p = tree.parent[s, p]
            assert set(np.flatnonzero(tree.visible[s, i])) == ancestors
            sib = tree.next_sibling[s, i]
            if sib >= 0:
                assert sib > i and tree.parent[s, sib] == tree.parent[s, i]
                assert tree.score[s, sib] <= tree.score[s, i]
        # brute force: the tree's prefixes are exactly the top-B prefixes by score (random inputs: no ties)
        all_scores = {}
        for length in range(1, depth_max + 1):
            for ranks in itertools.product(range(k), repeat=length):
                sc = np.float32(0.0)
                for d, r in enumerate(ranks):
                    sc = np.float32(sc + top_lp[s, d, r])
                all_scores[tuple(int(top_ids[s, d, r]) for d, r in enumerate(ranks))] = sc
        best = sorted(all_scores, key=lambda prefix: -all_scores[prefix])[:n - 1]
        got = {chain_tokens(tree, s, i): tree.score[s, i] for i in range(1, n)}
        assert set(got) == set(best)
        for prefix, sc in got.items():
            assert sc == all_scores[prefix]


def test_chain_and_ar_special_cases():
    rng = np.random.default_rng(3)
    block, vocab = 6, 32
    logits = random_logits(rng, 2, block - 1, vocab, ties=False)
    root = rng.integers(0, vocab, size=2)
    chain = build_jit(logits, root, block - 1, 1)
    np.testing.assert_array_equal(chain.parent, np.tile(np.arange(-1, block - 1), (2, 1)))
    np.testing.assert_array_equal(chain.tokens[:, 1:], np.argmax(logits, -1))
    ar = build_jit(logits, root, 0, None)
    np.testing.assert_array_equal(ar.tokens, root[:, None])
    np.testing.assert_array_equal(ar.num_nodes, [1, 1])
    target = rng.integers(0, vocab, size=(2, 1)).astype(np.int32)
    res = accept_jit(ar, target, block - 1)
    np.testing.assert_array_equal(res.num_accepted, [0, 0])
    np.testing.assert_array_equal(res.next_token, target[:, 0])
    np.testing.assert_array_equal(res.path, np.tile([0] + [-1] * (block - 1), (2, 1)))


# --------------------------------------------------------------------------------------------- accept


@pytest.mark.parametrize("target_at,path,accepted,next_token", [
    ({0: 10, 1: 20, 3: 33}, [0, 1, 3], 2, 33),  # accepted to the full depth
    ({0: 11, 2: 21}, [0, 2, -1], 1, 21),  # no child of node 2 carries 21
    ({0: 99}, [0, -1, -1], 0, 99),  # nothing accepted: the target's root token is the bonus
])
def test_accept_hand_made(target_at, path, accepted, next_token):
    lp, ids, root = hand_tree(HAND_CASES[0])
    tree = T.build_tree_heapq_from_topk(lp, ids, root, HAND_CASES[0]["budget"])
    target = np.full((1, 5), 77, np.int32)
    for node, tok in target_at.items():
        target[0, node] = tok
    want = T.AcceptResult(np.asarray([path], np.int32), np.asarray([accepted], np.int32),
                          np.asarray([next_token], np.int32))
    for got in (T.accept_tree_python(tree, target, 2), accept_jit(tree, target, 2)):
        for name, g, w in zip(T.AcceptResult._fields, got, want):
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)



@pytest.mark.parametrize("budget,block,topk", [(7, 8, None), (64, 16, 4), (30, 4, None), (0, 4, None)])
def test_accept_jit_matches_python(budget, block, topk):
    rng = np.random.default_rng(budget + block)
    vocab = 64
    logits = np.concatenate([random_logits(rng, 4, block - 1, vocab, ties=False),
                             random_logits(rng, 4, block - 1, vocab, ties=True)])
    root = rng.integers(0, vocab, size=8)
    tree = T.build_tree_heapq(logits, root, budget, topk)
    for _ in range(3):
        target = random_targets(rng, tree, vocab, hit_rate=0.5)
        want = T.accept_tree_python(tree, target, block - 1)
        got = accept_jit(tree, target, block - 1)
        for name, g, w in zip(T.AcceptResult._fields, got, want):
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)
        accepted = want.path[np.arange(8), want.num_accepted]
        np.testing.assert_array_equal(want.next_token, target[np.arange(8), accepted])


# --------------------------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("vocab,k,chunk", [(32768, 32, None), (4096, 8, 16), (4097, 9, 16), (1000, 5, 7),
                                           (50, 10, 2), (64, 64, None), (300, 1, 4)])
def test_chunked_top_k_equals_lax_top_k(vocab, k, chunk):
    """Values and indices bit for bit, with many ties (5 distinct values), rows of -inf and a ragged last chunk."""
    rng = np.random.default_rng(vocab * 31 + k)
    x = rng.integers(0, 5, size=(2, 3, vocab)).astype(np.float32) + rng.choice([0.0, 0.5], size=(2, 3, vocab))
    x[0, 0] = -np.inf
    x[1, 2, rng.random(vocab) < 0.7] = -np.inf
    want = jax.lax.top_k(x, k)
    got = T.chunked_top_k(jax.numpy.asarray(x), k, chunk)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("vocab,k,chunk,ties", [(512, 64, None, False), (512, 64, None, True), (4096, 300, 16, False),
                                                 (4096, 300, 16, True), (6, 6, None, False)])
def test_draft_topk_matches_float64_reference(vocab, k, chunk, ties):
    """draft_topk (jax, float32, chunked or not) against the specification's float64 numpy log-softmax and argsort,
    with masked (-inf) entries."""
    rng = np.random.default_rng(vocab + k)
    logits = random_logits(rng, 3, 5, vocab, ties=ties)
    logits[0, 1, rng.random(vocab) < 0.3] = -np.inf
    assert_topk_matches_reference(logits, k, topk_jit(logits, k, chunk), exact_ids=ties)


def test_topk_chunk_size():
    assert T.topk_chunk_size(163840, 64) == 64 and T.topk_chunk_size(163840, 512) == 16
    assert T.topk_chunk_size(7, 7) == 0  # nothing to gain: one top_k over the row
    assert T.topk_chunk_size(4096, 32) == 0  # small vocabularies keep one launch-bound top_k


def test_max_tree_nodes():
    assert T.max_tree_nodes(3, 2) == 14
    assert T.max_tree_nodes(0, 5) == 0
    assert T.max_tree_nodes(15, 1) == 15
    assert T.max_tree_nodes(15, 163840) == T.MAX_NODES_CAP


@pytest.mark.parametrize("budget,block,vocab,match", [
    (4, 1, 10, "block_size"), (-1, 8, 10, "budget=-1"), (5, 2, 4, "exceeds"), (1, 8, 0, "vocab_size"),
])
def test_check_budget_raises(budget, block, vocab, match):
    with pytest.raises(ValueError, match=match):
        T.check_budget(budget, block, vocab)


def test_check_budget_accepts():
    T.check_budget(0, 2, 10)
    T.check_budget(4, 2, 4)
    T.check_budget(14, 4, 2)
    T.check_budget(1024, 16, 163840)
