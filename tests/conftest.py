"""Shared test helpers, and the suite's XLA flags: the cheap CPU compile (no expensive LLVM passes), ~30% less CPU
time per test; the suite checks results, not CPU speed. Set before jax starts its backend; child processes inherit
them through the environment."""
import itertools
import os
import subprocess
import sys

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{FAST_COMPILE} {os.environ.get('XLA_FLAGS', '')}".strip()

import jax  # noqa: E402 (after XLA_FLAGS)
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdtree_jax import config as config_lib
from kdtree_jax.drafter import DrafterCache
from pallas_kernels.tree import reference_topk


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_in_child(test_file: str, env: dict, parent_test: str) -> None:
    """Run test_file's tests except `parent_test` in a child pytest with `env` added (a setting that must hold from
    the process start); assert that all of them passed and none was skipped."""
    proc = subprocess.run([sys.executable, "-m", "pytest", os.path.abspath(test_file), "-p", "no:cacheprovider",
                           "-k", f"not {parent_test}"], cwd=ROOT, env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary, proc.stdout[-2000:]


IN_TRITON_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
in_triton_interpreter = pytest.mark.skipif(not IN_TRITON_INTERPRETER,
                                           reason="runs in the TRITON_INTERPRET=1 child (test_in_the_interpreter)")


def interpreter_parent(test_file: str):
    """The parent-process test of a file of Triton-interpreter cases (each marked `in_triton_interpreter`): it runs
    the file's other tests in a child with TRITON_INTERPRET=1 (Triton reads it at its first import) and JAX on the
    CPU. Assign it to `test_in_the_interpreter` in the file."""
    @pytest.mark.skipif(IN_TRITON_INTERPRETER, reason="this is the child")
    def test_in_the_interpreter():
        run_in_child(test_file, dict(TRITON_INTERPRET="1", JAX_PLATFORMS="cpu"), "test_in_the_interpreter")
    return test_in_the_interpreter


def causal_logits(model, tokens, absorbed: bool = True):
    """A causal prefill of tokens [S, T] from an empty cache -> logits [S, T, V] f32."""
    return model.causal(tokens, absorbed=absorbed).logits


def rel_err(a, b) -> float:
    """|a - b| / |b| (Frobenius norms), computed in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_targets(rng, tree, vocab: int, hit_rate: float):
    """[S, B+1] int32 target tokens: with probability hit_rate the token of a random child of the node (so walks go
    deep), else a random token."""
    tokens, parent = np.asarray(tree.tokens), np.asarray(tree.parent)
    target = rng.integers(0, vocab, size=tokens.shape).astype(np.int32)
    for s, i in itertools.product(range(tokens.shape[0]), range(tokens.shape[1])):
        children = np.flatnonzero(parent[s] == i)
        if children.size and rng.random() < hit_rate:
            target[s, i] = tokens[s, rng.choice(children)]
    return target


def assert_topk_matches_reference(logits, k: int, got, exact_ids: bool) -> None:
    """got = draft_topk(logits [S, D, V], k) against reference_topk (float64): the same top-k log-probs to float32
    rounding, each id carrying the log-prob reported for it, no id twice; exact_ids: the ids themselves (inputs whose
    equal log-probs are exactly equal in both, e.g. integer logits, where ties go to the smaller id)."""
    got_lp, got_ids = (np.asarray(a) for a in got)
    want_lp, want_ids = reference_topk(logits, k)
    np.testing.assert_allclose(got_lp, want_lp, rtol=1e-6, atol=1e-6)
    all_lp, all_ids = reference_topk(logits, np.shape(logits)[-1])
    lp_of_id = np.empty_like(all_lp)
    np.put_along_axis(lp_of_id, all_ids, all_lp, axis=-1)
    np.testing.assert_allclose(np.take_along_axis(lp_of_id, got_ids, axis=-1), want_lp, rtol=1e-6, atol=1e-6)
    assert all(len(set(row)) == k for row in got_ids.reshape(-1, k))
    if exact_ids:
        np.testing.assert_array_equal(got_ids, want_ids)


class OracleDrafter(nnx.Module):
    """Drafts the target's own greedy continuation (known from an ar run), so acceptance is high.

    At every third position the true token is ranked SECOND behind a decoy: a chain stops there while a tree with
    K >= 2 keeps going, so multi-token rounds, branching and compaction are all exercised.
    """

    def __init__(self, cfg: config_lib.DrafterConfig, sequences: np.ndarray):
        self.cfg = cfg
        self.truth = nnx.Variable(jnp.asarray(sequences, jnp.int32))  # [S, total]: prompt + ar output

    def init_cache(self, num_streams, capacity):
        return DrafterCache((), ())

    def extend_cache(self, cache, hidden, positions, offsets, count=None):
        return cache

    def draft(self, embed, lm_head, bonus, start, cache, ctx_len):
        depth, vocab = self.cfg.block_size - 1, self.cfg.vocab_size
        idx = start[:, None] + jnp.arange(1, depth + 1)[None, :]
        truth = jnp.take_along_axis(self.truth[...], jnp.clip(idx, 0, self.truth.shape[1] - 1), axis=1)
        logits = jax.random.normal(jax.random.key(0), (bonus.shape[0], depth, vocab))
        decoy = (truth + 1) % vocab
        demote = (idx % 3) == 0
        logits = jax.vmap(jax.vmap(lambda l, t, d, dm: l.at[t].set(8.0).at[d].set(jnp.where(dm, 9.0, l[d]))))(
            logits, truth, decoy, demote)
        return logits
