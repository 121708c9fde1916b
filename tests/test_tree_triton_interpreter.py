"""The Triton tree kernels (tree build, tree accept) run on the CPU in Triton's interpreter, through the same host
code as on the GPU (`tree_triton.run_build` / `run_accept`), and equal their specifications bit for bit.

The pure-JAX references equal the python specifications (heapq build, python accept loop; tests/test_tree.py), so
the cases compare a kernel with the specification directly. The build kernel searches a given top-K: it gets the
specification's (`reference_topk`, float64) and must return the specification's arrays bit for bit.

The interpreter's outputs start as poison (-7 for ints, NaN for floats), so a slot the kernel forgets to write cannot
match. Triton must be in interpreter mode from its first import, so the test re-runs this file in a child process
with TRITON_INTERPRET=1.
"""

import numpy as np
import pytest

from conftest import random_targets, in_triton_interpreter, interpreter_parent
from pallas_kernels import tree as T

test_in_the_interpreter = interpreter_parent(__file__)


def assert_same(got, want, fields):
    for name, g, w in zip(fields, got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_array_equal(g, w, err_msg=name)


def build_kernel(logits, root, budget: int, topk=None):
    """The build kernel (Triton's interpreter) on the specification's top-K of logits [S, D, V]."""
    from pallas_kernels import tree_triton as TT
    from triton_interpreter import interpreter_call

    top = T.reference_topk(logits, T.resolve_topk(budget, np.shape(logits)[-1], topk))
    return TT.run_build(interpreter_call, *top, root, budget, None)


def accept_kernel(tree, target, max_depth: int):
    """The accept kernel (Triton's interpreter)."""
    from pallas_kernels import tree_triton as TT
    from triton_interpreter import interpreter_call

    return TT.run_accept(interpreter_call, T.TreeArrays(*map(np.asarray, tree)), target, max_depth)


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


@in_triton_interpreter
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


@in_triton_interpreter
def test_build_kernel_minus_inf_scores():
    rng = np.random.default_rng(11)
    logits = random_logits(rng, 3, 3, 6, ties=False)
    logits[:, :, 2:] = -np.inf
    root = rng.integers(0, 6, size=3).astype(np.int32)
    got = build_kernel(logits, root, 40)
    assert np.isneginf(np.asarray(got.score)).any()
    assert_same(got, T.build_tree_heapq(logits, root, 40), T.TreeArrays._fields)


@in_triton_interpreter
@pytest.mark.parametrize("budget,block,topk", [(0, 4, None), (3, 4, 1), (7, 8, None), (64, 16, 4), (40, 5, None)])
def test_accept_kernel_matches_reference(budget, block, topk):
    rng = np.random.default_rng(budget + 7 * block)
    vocab = 16
    logits, root = random_draft(rng, 6, block, vocab)
    tree = T.build_tree_heapq(logits, root, budget, topk)
    for _ in range(2):
        target = random_targets(rng, tree, vocab, hit_rate=0.7)
        want = T.accept_tree_python(tree, target, block - 1)
        assert_same(accept_kernel(tree, target, block - 1), want, T.AcceptResult._fields)


@in_triton_interpreter
def test_accept_kernel_full_depth():
    """Targets that follow the first child everywhere: the walk reaches the deepest level of a chain."""
    rng = np.random.default_rng(5)
    block = 6
    logits, root = random_draft(rng, 2, block, 32)
    tree = T.build_tree_heapq(logits, root, block - 1, 1)
    target = np.roll(tree.tokens, -1, axis=1)
    got = accept_kernel(tree, target, block - 1)
    np.testing.assert_array_equal(got.num_accepted, [block - 1] * 2)
    np.testing.assert_array_equal(got.path, np.tile(np.arange(block), (2, 1)))
    assert_same(got, T.accept_tree_python(tree, target, block - 1), T.AcceptResult._fields)
