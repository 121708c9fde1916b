"""Mutation check of the test suite: small deliberate bugs, each applied to a temporary copy of the working tree, must
make the default test selection (`make test`: `pytest -m "not slow"`) fail.

  .venv/bin/python experiments/mutants.py                        # every mutant, a markdown table at the end
  .venv/bin/python experiments/mutants.py --mutants=argmax_below_root,draft_topk_unnormalised --out=/tmp/m.json

Each mutant names the tests expected to catch it (files, or single tests to show which one does); they run with
`-m "not slow" -x`, a subset of the default selection, so a failure there fails `make test` too. A first row
("none") runs the same files on the unmutated copy, which must pass, so that a failure is the mutant's. The copy takes the working tree as it is (uncommitted edits
included; .git, .venv and caches left out) and runs with this interpreter and PYTHONPATH set to the copy. A mutant
whose code no longer matches its snippet is reported as "stale" (update the snippet), never as caught. History and
results: experiments/notes/testing.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from absl import flags

from kdtree_jax import cli

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".whl", "tmp", "*.egg-info")

FLAGS = flags.FLAGS
flags.DEFINE_list("mutants", [], "names of the mutants to run (empty: all)")
flags.DEFINE_string("out", "", "also write the results as JSON here")
flags.DEFINE_integer("timeout_s", 1200, "limit per pytest run")


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # what the mutant does, in words
    path: str  # file to change, relative to the repository root
    edits: tuple[tuple[str, str], ...]  # (snippet, replacement): each snippet must occur exactly once
    tests: tuple[str, ...]  # tests expected to catch it (files or test ids)


MUTANTS = (
    Mutant("draft_topk_unnormalised", "draft_topk ranks x - max(x) instead of log-softmax(x)",
           "pallas_kernels/tree.py",
           (("    lp = jax.nn.log_softmax(jnp.asarray(draft_logits, jnp.float32), axis=-1)\n",
             "    x = jnp.asarray(draft_logits, jnp.float32)\n    lp = x - x.max(axis=-1, keepdims=True)\n"),),
           ("tests/test_tree.py",)),
    Mutant("int4_nibbles_reversed", "pack_int4 and unpack_int4 both put value 8j + i in nibble 7 - i",
           "pallas_kernels/int4_layout.py",
           (("    shifts = (4 * np.arange(NIBBLES_PER_WORD, dtype=np.uint32))\n",
             "    shifts = (4 * np.arange(NIBBLES_PER_WORD - 1, -1, -1, dtype=np.uint32))\n"),
            ("    shifts = 4 * jnp.arange(NIBBLES_PER_WORD, dtype=jnp.int32)\n",
             "    shifts = 4 * jnp.arange(NIBBLES_PER_WORD - 1, -1, -1, dtype=jnp.int32)\n")),
           ("tests/test_int4_layout.py", "tests/test_hf_fixtures.py")),
    Mutant("argmax_below_root", "at T > 0 the target's token at every tree node but the root is its argmax",
           "kdtree_jax/decode.py",
           (("    picked = pick_tokens(logits, spec.temperature, keys, tree.depth, spec.depth + 1)\n",
             "    picked = pick_tokens(logits, spec.temperature, keys, tree.depth, spec.depth + 1)\n"
             "    picked = picked.at[:, 1:].set(jnp.argmax(logits[:, 1:], axis=-1).astype(jnp.int32))\n"),),
           ("tests/test_sampling.py",)),
    Mutant("temperature_only_at_the_root", "at T > 0 the nodes below the root sample at T = 1",
           "kdtree_jax/decode.py",
           (("    picked = pick_tokens(logits, spec.temperature, keys, tree.depth, spec.depth + 1)\n",
             "    picked = pick_tokens(logits, spec.temperature, keys, tree.depth, spec.depth + 1)\n"
             "    below = pick_tokens(logits[:, 1:], 1.0 if spec.temperature else 0.0,\n"
             "                        jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys))\n"
             "    picked = picked.at[:, 1:].set(below)\n"),),
           ("tests/test_sampling.py",)),
    Mutant("attention_kernel_drops_last_prefix_row", "the Triton attention kernel skips the last committed cache row",
           "pallas_kernels/tree_verify_attention_triton.py",
           (("        col_ok = b * BK + tl.arange(0, BK) < prefix\n",
             "        col_ok = b * BK + tl.arange(0, BK) < prefix - 1\n"),),
           ("tests/test_attention_triton_interpreter.py",)),
    Mutant("attention_kernel_hides_first_tree_row", "the Triton attention kernel never shows the root's tree row",
           "pallas_kernels/tree_verify_attention_triton.py",
           (("        col_ok = u < NUM_NODES\n", "        col_ok = (u > 0) & (u < NUM_NODES)\n"),),
           ("tests/test_attention_triton_interpreter.py",)),
    Mutant("accept_kernel_stops_at_depth_1", "the accept kernel never walks past the first level",
           "pallas_kernels/tree_triton.py",
           (("    while (alive != 0) & (accepted < MAX_DEPTH):\n", "    while (alive != 0) & (accepted < 1):\n"),),
           ("tests/test_tree_triton_interpreter.py",)),
    Mutant("int4_scales_tiled", "dequantize_int4 tiles the group scales instead of repeating each one 32 times",
           "pallas_kernels/int4_layout.py",
           (("    s = jnp.repeat(jnp.asarray(scale, jnp.float32), group, axis=-1)\n",
             "    s = jnp.tile(jnp.asarray(scale, jnp.float32), group)\n"),),
           ("tests/test_int4_layout.py", "tests/test_hf_fixtures.py")),
    Mutant("exact_products_untiled", "the exact mode's products run at the caller's row count, not in fixed tiles",
           "pallas_kernels/batch_invariant.py",
           (("    out = lax.map(lambda tile: fixed_dot(tile, w, b_nk=True), rows)\n",
             "    out = fixed_dot(rows.reshape(-1, k)[:m], w, b_nk=True)\n"
             "    out = jnp.pad(out, ((0, tiles * ROW_TILE - m), (0, 0)))\n"),),
           ("tests/test_exact.py",)),
    Mutant("yarn_mscale_not_squared", "the softmax scale takes YaRN's mscale once instead of squared",
           "kdtree_jax/config.py",
           (("        return self.qk_head_dim ** -0.5 * self.yarn_mscale ** 2\n",
             "        return self.qk_head_dim ** -0.5 * self.yarn_mscale\n"),),
           ("tests/test_hf_fixtures.py",)),
    Mutant("routing_weights_biased", "the routing weights include e_score_correction_bias (selection only in V3)",
           "pallas_kernels/router_topk.py",
           (("    weights = jnp.take_along_axis(scores, ids, axis=-1)\n",
             "    weights = jnp.take_along_axis(scores + bias.astype(jnp.float32), ids, axis=-1)\n"),),
           ("tests/test_hf_fixtures.py",)),
)


def apply(mutant: Mutant, tree: str) -> None:
    path = os.path.join(tree, mutant.path)
    with open(path) as f:
        text = f.read()
    for snippet, replacement in mutant.edits:
        if text.count(snippet) != 1:
            raise LookupError(f"{mutant.path}: the snippet {snippet.strip()!r} occurs {text.count(snippet)} times")
        text = text.replace(snippet, replacement)
    with open(path, "w") as f:
        f.write(text)


def run_tests(tree: str, tests: tuple[str, ...]) -> tuple[int, str, float]:
    """pytest -m "not slow" -x on `tests` in `tree` -> (exit code, first failing test or error line, seconds)."""
    env = dict(os.environ, PYTHONPATH=tree)
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-rfE", "-p", "no:cacheprovider",
                           "-m", "not slow", *tests], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=FLAGS.timeout_s)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, failed[0] if failed else (lines[-1] if lines else ""), time.time() - start


def main(argv):
    del argv
    known = {m.name: m for m in MUTANTS}
    unknown = sorted(set(FLAGS.mutants) - set(known))
    if unknown:
        raise ValueError(f"unknown mutants {unknown}; choose among {sorted(known)}")
    chosen = [known[n] for n in FLAGS.mutants] if FLAGS.mutants else list(MUTANTS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mutants_") as tmp:
        pristine = os.path.join(tmp, "pristine")
        shutil.copytree(ROOT, pristine, ignore=COPY_IGNORE)
        all_tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        code, detail, seconds = run_tests(pristine, all_tests)
        rows.append(dict(mutant="none", bug="(the unmutated copy)", tests=list(all_tests),
                         outcome="pass" if code == 0 else "FAILS", detail=detail, seconds=round(seconds)))
        print(rows[-1], flush=True)
        for mutant in chosen:
            tree = os.path.join(tmp, mutant.name)
            shutil.copytree(pristine, tree)
            try:
                apply(mutant, tree)
            except LookupError as e:
                rows.append(dict(mutant=mutant.name, bug=mutant.bug, tests=list(mutant.tests), outcome="stale",
                                 detail=str(e), seconds=0))
                continue
            code, detail, seconds = run_tests(tree, mutant.tests)
            outcome = {0: "MISSED", 1: "caught"}.get(code, f"pytest exit {code}")
            rows.append(dict(mutant=mutant.name, bug=mutant.bug, tests=list(mutant.tests), outcome=outcome,
                             detail=detail, seconds=round(seconds)))
            print(rows[-1], flush=True)
            shutil.rmtree(tree)
    print("\n| mutant | bug | outcome | first failing test | s |\n|---|---|---|---|---:|")
    for r in rows:
        print(f"| {r['mutant']} | {r['bug']} | {r['outcome']} | {r['detail']} | {r['seconds']} |")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(rows, f, indent=2)
    if rows[0]["outcome"] != "pass" or any(r["outcome"] != "caught" for r in rows[1:]):
        raise SystemExit(1)


if __name__ == "__main__":
    cli.run(main)
