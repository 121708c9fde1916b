"""The Mosaic GPU tree-verify attention with clusters of C query tiles of a split sharing the cache's loads by TMA
multicast (`tree_verify_attention_mgpu`'s `multicast_tiles`) against C = 1, side by side in one run, on cases whose
streams have several 64-row query tiles (T x H >= 128 rows). Each variant is the op (kernel, then the split-K
combine) with its frame bias made beforehand, timed per call of `timing.BACK_TO_BACK` calls in one jitted function
over input sets rotated past the L2; the table gives the op's and the attention kernel's device times and the kernel's
ratio to C = 1. GPU only:

    python3 experiments/kernels/attention_multicast.py --out=experiments/results/kernels/attention_multicast.json

Writes the JSON (--out) and a bar plot of the kernels' times beside it.
"""
from __future__ import annotations

import os

import jax
import numpy as np
from absl import flags, logging

from experiments.kernels.kernels_attention import (K26_SCALE, attention_cost, attention_inputs, cache_bytes,
                                                   cache_rows, parse_case)
from experiments.run_record import code_version, write_json
from experiments.timing import back_to_back_job, rel_err, rotation_sets, time_jobs
from kdtree_jax import cli, plots
from pallas_kernels import tree_verify_attention as attn
from pallas_kernels import tree_verify_attention_mgpu as attn_mgpu

flags.DEFINE_list("cases", ["1/8/8192/16", "1/8/16384/16", "1/8/32768/16", "1/8/65536/16", "4/8/32768/16",
                            "1/16/32768/8", "1/8/32768/32", "1/8/32768/64"], "S/H/N/T: streams, heads, prefix, nodes")
flags.DEFINE_list("sizes", ["1", "2", "4"], "multicast_tiles values (each where it divides a stream's tiles)")
flags.DEFINE_integer("reps", 15, "timed windows per variant (median reported)")
flags.DEFINE_string("out", "experiments/results/kernels/attention_multicast.json", "JSON results (a PNG beside it)")
F = flags.FLAGS
KERNEL = "tree_verify_attention_mgpu_mosaic_gpu_kernel"   # the kernel's event name in the device trace


def run_case(case: dict, sizes: list[int], key) -> list[dict]:
    """One row per multicast size that divides the case's tiles: times, error against the reference."""
    s, h, t = case["streams"], case["heads"], case["nodes"]
    tiles = attn_mgpu.query_tiles(t * h)
    sets = []
    for i in range(rotation_sets(cache_bytes(case), 16)):
        args = attention_inputs(jax.random.fold_in(key, i), case, np.random.default_rng(i))
        bias = attn_mgpu.frame_bias(args[4], args[5], h, attn_mgpu.padded_rows(t * h))
        sets.append((*args, bias))
    ref = attn.tree_verify_attention_reference(*sets[0][:6], scale=K26_SCALE)
    flops, bytes_ = attention_cost(case)
    rows = []
    for size in sizes:
        if tiles % size:
            continue
        fn = jax.jit(lambda *a, c=size: attn_mgpu.tree_verify_attention(*a[:6], scale=K26_SCALE, bias=a[6],
                                                                        multicast_tiles=c))
        timing = time_jobs([back_to_back_job("op", fn, sets)], F.reps)["op"]
        kernels = timing.get("kernels_us") or {}
        rows.append(dict(case, tiles=tiles, multicast_tiles=size,
                         num_splits=attn_mgpu.default_num_splits(s, t * h, cache_rows(case)),
                         op_us=timing["us"], kernel_us=kernels.get(KERNEL), kernels_us=kernels,
                         rel_err_bf16=rel_err(fn(*sets[0]), ref), flops=flops, bytes=bytes_, input_sets=len(sets)))
        logging.info("%s C=%d: op %.2f us, kernel %s us", case, size, timing["us"], kernels.get(KERNEL))
    base = rows[0]["kernel_us"]
    for row in rows:
        row["kernel_vs_c1"] = row["kernel_us"] / base if base and row["kernel_us"] else None
    return rows


def main(_):
    if jax.default_backend() != "gpu":
        cli.fail("attention_multicast.py times the Mosaic GPU kernel: run it on the GPU")
    sizes = [int(x) for x in F.sizes]
    if 1 not in sizes or any(c not in attn_mgpu.MULTICAST_SIZES for c in sizes):
        cli.fail(f"--sizes {F.sizes}: each must be one of {attn_mgpu.MULTICAST_SIZES}, 1 among them (the baseline)")
    sizes = sorted(set(sizes))
    rows = []
    print(f"{'case S/H/N/T':16s} {'tiles':>5s} {'splits':>6s} {'C':>2s} {'op us':>8s} {'kernel us':>10s} "
          f"{'vs C=1':>7s} {'err':>8s}")
    for i, text in enumerate(F.cases):
        for row in run_case(parse_case(text), sizes, jax.random.key(i)):
            rows.append(row)
            ratio = row["kernel_vs_c1"]
            print(f"{text:16s} {row['tiles']:5d} {row['num_splits']:6d} {row['multicast_tiles']:2d} "
                  f"{row['op_us']:8.2f} {row['kernel_us'] or float('nan'):10.2f} "
                  f"{ratio if ratio is not None else float('nan'):7.3f} {row['rel_err_bf16']:8.1e}", flush=True)
    meta = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, sizes=sizes, reps=F.reps,
                code=code_version())
    write_json(F.out, dict(meta=meta, rows=rows))
    plot(rows, os.path.splitext(F.out)[0] + ".png", meta)


def plot(rows, path: str, meta: dict) -> None:
    plt = plots.pyplot()
    cases = list(dict.fromkeys(f"{r['streams']}/{r['heads']}/{r['prefix']}/{r['nodes']}" for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cases)), 4))
    width = 0.8 / len(meta["sizes"])
    for k, size in enumerate(meta["sizes"]):
        got = {f"{r['streams']}/{r['heads']}/{r['prefix']}/{r['nodes']}": r["kernel_us"] for r in rows
               if r["multicast_tiles"] == size}
        x = [i + (k - (len(meta["sizes"]) - 1) / 2) * width for i, c in enumerate(cases) if got.get(c)]
        ax.bar(x, [got[c] for c in cases if got.get(c)], width, label=f"multicast_tiles={size}")
    ax.set_xticks(range(len(cases)), cases, rotation=30, fontsize=8)
    ax.set_ylabel("attention kernel, us per call (back to back)")
    ax.set_title(f"query tiles sharing the cache's loads by multicast ({meta['device']}, code {meta['code']})")
    ax.legend()
    plots.save(fig, path)


if __name__ == "__main__":
    cli.run(main)
