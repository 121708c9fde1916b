"""The tree-verify attention op against its XLA reference when called alone, by the host's wall clock with no
profiler attached: what one isolated call costs its caller, launches included.

The bench's "alone" times (`bench_kernels.py`, `kernel_us` / `reference_us`) are device spans read from a profiler
trace, and the profiler's callbacks lengthen every kernel launch on the host; where the op's second kernel waits for
its launch (prefix 4096, T = 1: kernels.md, "Tenth session") that inflates the span. Here each call is one
`block_until_ready` round trip with nothing attached, the peers interleaved in a random order every repetition over
input sets rotated past the L2, and `floor` (a jitted one-kernel call on a small array) measures the round trip
itself, so that `wall - floor` is the part of the call that is the op's or the reference's. The op runs with its plan
made beforehand, as the model makes it once per forward (`ops.tree_verify_plan`).

    python3 experiments/kernels/attention_alone_wall.py --out=experiments/results/kernels/attention_alone_wall.json

Writes the JSON (--out) and a bar plot of wall - floor beside it. GPU only.
"""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from tqdm import tqdm

from experiments.kernels.kernels_attention import K26_SCALE, attention_inputs, cache_bytes, case_name, parse_case
from experiments.run_record import code_version, write_json
from experiments.timing import rotation_sets
from kdtree_jax import cli, plots
from pallas_kernels import ops
from pallas_kernels import tree_verify_attention as attn

flags.DEFINE_list("cases", ["1/8/4096/1", "1/64/4096/1", "1/8/4096/16", "1/64/4096/16", "1/64/32768/1"],
                  "S/H/N/T: streams, heads, prefix, nodes")
flags.DEFINE_integer("reps", 400, "isolated calls per peer and case (median reported)")
flags.DEFINE_string("out", "experiments/results/kernels/attention_alone_wall.json", "JSON results (a PNG beside it)")
F = flags.FLAGS


def peers(case: dict, sets: list) -> dict:
    """{name: (jitted fn, its argument sets)}: the op (plan made beforehand), the XLA reference, and the floor."""
    planned = [(*a, ops.tree_verify_plan(a[4], a[5], num_heads=case["heads"])) for a in sets]
    return {"op": (jax.jit(lambda *a: ops.tree_verify_attention(*a, scale=K26_SCALE)), planned),
            "reference": (jax.jit(lambda *a: attn.tree_verify_attention_reference(*a, scale=K26_SCALE)), sets),
            "floor": (jax.jit(lambda x: x + 1), [(jnp.zeros((8,), jnp.float32),)] * len(sets))}


def wall_times(fns: dict, reps: int, seed: int) -> dict:
    """{name: [wall us of each isolated call]}: every repetition calls each peer once, in a random order, on the
    next of its argument sets, and waits for its result."""
    rng = np.random.default_rng(seed)
    times = {name: [] for name in fns}
    for name, (fn, sets) in fns.items():      # compile, warm up
        for args in sets:
            jax.block_until_ready(fn(*args))
    for r in tqdm(range(reps), desc="isolated calls", leave=False):
        for name in rng.permutation(list(fns)):
            fn, sets = fns[name]
            args = sets[r % len(sets)]
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(1e6 * (time.perf_counter() - start))
    return times


def main(_):
    cases = [parse_case(text) for text in F.cases]
    if jax.default_backend() != "gpu":
        cli.fail("attention_alone_wall.py times GPU calls: run it on the GPU")
    print(f"{'case S/H/N/T':16s} {'backend':>10s} {'op us':>8s} {'ref us':>8s} {'floor us':>9s} "
          f"{'op - floor':>11s} {'ref - floor':>12s} {'x ref':>6s}")
    rows = []
    for i, (text, case) in enumerate(zip(F.cases, cases)):
        sets = [attention_inputs(jax.random.fold_in(jax.random.key(i), k), case, np.random.default_rng(k))
                for k in range(rotation_sets(cache_bytes(case), 16))]
        times = wall_times(peers(case, sets), F.reps, seed=i)
        med = {name: float(np.median(t)) for name, t in times.items()}
        own = {name: med[name] - med["floor"] for name in ("op", "reference")}
        row = dict(case, backend=ops.attention_backend(*sets[0][:4]), wall_us=med,
                   wall_p10_p90_us={name: [float(np.percentile(t, 10)), float(np.percentile(t, 90))]
                                    for name, t in times.items()},
                   op_us=own["op"], reference_us=own["reference"], speedup_vs_reference=own["reference"] / own["op"],
                   input_sets=len(sets))
        rows.append(row)
        logging.info("%s: %s", text, med)
        print(f"{text:16s} {row['backend']:>10s} {med['op']:8.1f} {med['reference']:8.1f} {med['floor']:9.1f} "
              f"{own['op']:11.1f} {own['reference']:12.1f} {row['speedup_vs_reference']:6.2f}", flush=True)
    meta = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, reps=F.reps, code=code_version())
    write_json(F.out, dict(meta=meta, rows=rows))
    plot(rows, os.path.splitext(F.out)[0] + ".png", meta)


def plot(rows, path: str, meta: dict) -> None:
    plots.grouped_bars(path, [case_name(r) for r in rows],
                       {"tree_verify_attention (ops), plan made before": [r["op_us"] for r in rows],
                        "XLA reference": [r["reference_us"] for r in rows]},
                       ylabel="wall us per isolated call, less the floor", log=True,
                       title=f"alone, no profiler ({meta['device']}, code {meta['code']})")


if __name__ == "__main__":
    cli.run(main)
