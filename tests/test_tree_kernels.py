"""Tree build / accept Pallas kernels (interpret mode on the CPU) equal their references.

The pure-JAX references equal the python specifications (heapq build, python accept loop; tests/test_tree.py), so
most cases compare a kernel with the specification directly, which costs no extra compilation; the dispatch test
and one accept case compare with the jitted references. The build kernel searches a given top-K: it gets the
specification's (`reference_topk`, float64) and must return the specification's arrays bit for bit; from logits it
runs `draft_topk` first, which the dispatch test covers.

Interpret mode fills every output with poison before the kernel runs (NaN for floats, INT32_MIN for ints), so a
slot the kernel forgets to write cannot match the reference.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tree as T
from pallas_kernels import ops
from pallas_kernels import tree_accept as TA
from pallas_kernels import tree_build as TB
from conftest import random_targets

accept_ref = jax.jit(TA.tree_accept_reference, static_argnums=2)


def assert_same(got, want, fields):
    for name, g, w in zip(fields, got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_array_equal(g, w, err_msg=name)


def build_kernel(logits, root, budget: int, topk=None):
    """The build kernel (interpret mode) on the specification's top-K of logits [S, D, V]."""
    top = T.reference_topk(logits, T.resolve_topk(budget, np.shape(logits)[-1], topk))
    return TB.tree_build_from_topk(*map(jnp.asarray, top), jnp.asarray(root), budget=budget, interpret=True)


def random_logits(rng, n_streams, max_depth, vocab, ties: bool):
    """[S, D, V] float32; with ties, few distinct values and the same row at every depth (equal log-probs and
    equal path sums)."""
    if not ties:
        return rng.normal(scale=2.0, size=(n_streams, max_depth, vocab)).astype(np.float32)
    row = rng.integers(0, 4, size=(n_streams, 1, vocab)).astype(np.float32)
    return np.repeat(row, max_depth, axis=1)


def random_draft(rng, n_streams, block, vocab):
    """(draft logits [S, L-1, V], root [S]); half the streams with ties."""
    logits = np.concatenate([random_logits(rng, n_streams // 2, block - 1, vocab, ties=False),
                             random_logits(rng, n_streams - n_streams // 2, block - 1, vocab, ties=True)])
    root = rng.integers(0, vocab, size=n_streams).astype(np.int32)
    return logits, root


@pytest.mark.parametrize("budget,block,vocab,topk", [
    (0, 4, 64, None),  # ar: root only
    (3, 4, 64, 1),  # chain
    (7, 8, 64, None),
    (31, 16, 128, 4),  # B + 1 fills the padded slots exactly
    (64, 16, 512, None),
    (100, 6, 32, 8),
    (50, 3, 4, None),  # V < B
    (40, 4, 3, None),  # the heap runs dry: padding slots
])
def test_build_kernel_matches_reference(budget, block, vocab, topk):
    rng = np.random.default_rng(budget * 31 + block)
    logits, root = random_draft(rng, 4, block, vocab)
    assert_same(build_kernel(logits, root, budget, topk), T.build_tree_heapq(logits, root, budget, topk),
                T.TreeArrays._fields)


def test_build_kernel_minus_inf_scores():
    rng = np.random.default_rng(11)
    logits = random_logits(rng, 3, 3, 6, ties=False)
    logits[:, :, 2:] = -np.inf
    root = rng.integers(0, 6, size=3).astype(np.int32)
    got = build_kernel(logits, root, 40)
    assert np.isneginf(np.asarray(got.score)).any()
    assert_same(got, T.build_tree_heapq(logits, root, 40), T.TreeArrays._fields)


def test_build_config_and_limits():
    with pytest.raises(ValueError, match="num_warps"):
        TB.BuildConfig(num_warps=3)
    assert TB.BuildConfig().warps(32) == 1 and TB.BuildConfig(num_warps=2).warps(32) == 2
    lp = jnp.zeros((1, 15, 1), jnp.float32)
    with pytest.raises(ValueError, match="31-bit"):
        TB.tree_build_from_topk(lp, jnp.zeros((1, 15, 1), jnp.int32), jnp.zeros(1, jnp.int32), budget=40000,
                                interpret=True)



@pytest.mark.parametrize("budget,block,topk", [(0, 4, None), (3, 4, 1), (7, 8, None), (64, 16, 4), (40, 5, None)])
def test_accept_kernel_matches_reference(budget, block, topk):
    rng = np.random.default_rng(budget + 7 * block)
    vocab = 16
    logits, root = random_draft(rng, 6, block, vocab)
    tree = T.build_tree_heapq(logits, root, budget, topk)
    for _ in range(2):
        target = random_targets(rng, tree, vocab, hit_rate=0.7)
        want = T.accept_tree_python(tree, target, block - 1)
        assert_same(TA.tree_accept(tree, target, block - 1, interpret=True), want, T.AcceptResult._fields)


def test_accept_kernel_full_depth():
    """Targets that follow the first child everywhere: the walk reaches the deepest level of a chain."""
    rng = np.random.default_rng(5)
    block = 6
    logits, root = random_draft(rng, 2, block, 32)
    tree = T.build_tree_heapq(logits, root, block - 1, 1)
    target = np.roll(tree.tokens, -1, axis=1)
    got = TA.tree_accept(tree, target, block - 1, interpret=True)
    np.testing.assert_array_equal(got.num_accepted, [block - 1] * 2)
    np.testing.assert_array_equal(got.path, np.tile(np.arange(block), (2, 1)))
    assert_same(got, accept_ref(tree, target, block - 1), T.AcceptResult._fields)


def test_ops_dispatch_kernels_equal_references():
    rng = np.random.default_rng(9)
    logits, root = random_draft(rng, 2, 5, 16)
    logits = jnp.asarray(logits)
    with ops.implementation("reference"):
        tree_ref = ops.tree_build(logits, root, 12)
        target = random_targets(rng, tree_ref, 16, hit_rate=0.7)
        acc_ref = ops.tree_accept(tree_ref, target, 4)
    with ops.implementation("kernel", interpret=True):
        tree = ops.tree_build(logits, root, 12)
        acc = ops.tree_accept(tree, target, 4)
    assert_same(tree, tree_ref, T.TreeArrays._fields)
    assert_same(acc, acc_ref, T.AcceptResult._fields)
