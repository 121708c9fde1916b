"""Routed experts of one K2.6 MoE layer on one GPU against expert parallelism over tp GPUs, side by side in one run.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 experiments/bench_expert_parallel.py \
        --out=experiments/results/sharding/expert_parallel_x2.json       # on 2 x H200
    PYTHONPATH=. python3 experiments/bench_expert_parallel.py --quick  # CPU smoke run (fake devices, small shapes)

For each token count M and each INT4 kernel (--kernels): the same random INT4 experts (E = 384, D = 7168, I = 2048,
top-8, uniform random routing) as one array on device 0, timed through the kernel alone (tp = 1), and split over a
tp mesh on their expert axis, timed through `parallel.expert_parallel` (each device runs the kernel on its own
experts, the pairs of other devices' experts drop out of its routing, one psum over tp). The tp time is the span of
both devices' events, the psum included. Device times from profiler traces (experiments/timing.py). Also recorded:
the mean pairs per device whose expert is local, and the ratio tp / one GPU against the target 0.6 at M >= 64.
"""
from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments.kernels.kernels_moe import INT4_KERNELS, moe_routing, moe_shapes, random_experts
from experiments.timing import BF16, Job, rel_err, time_jobs
from kdtree_jax import cli, plots, sharding
from kdtree_jax.model import parallel
from pallas_kernels import int4_moe as moe

flags.DEFINE_list("tokens", ["1", "8", "64", "256", "1024", "4096"], "token counts M")
flags.DEFINE_multi_enum("kernels", ["triton"], sorted(INT4_KERNELS),
                        "INT4 implementations timed: triton (int4_moe_triton.int4_moe, jax-triton), reference (XLA)")
flags.DEFINE_integer("tp", 0, "expert-parallel devices (0: every local device)")
flags.DEFINE_integer("reps", 10, "timed calls per case (median reported)")
flags.DEFINE_float("time_budget_s", 400.0, "start no new M after this many seconds")
flags.DEFINE_bool("quick", False, "small shapes, reference kernel, CPU smoke run")
flags.DEFINE_string("out", "experiments/results/sharding/expert_parallel.json",
                    "JSON results (rewritten after every M)")
F = flags.FLAGS

TARGET_RATIO = 0.6     # the bound on tp=2 / one GPU at M >= 64


def _kernel(name: str):
    return moe.int4_moe_reference if F.quick else INT4_KERNELS[name]


def main(_):
    start = time.time()
    tp = F.tp or jax.device_count()
    mesh = sharding.make_mesh(tp=tp, devices=jax.devices()[:tp])
    shape, _ = moe_shapes(F.quick)
    e, d, k = shape["experts"], shape["hidden"], shape["top_k"]
    one = jax.devices()[0]
    experts_one = jax.device_put(random_experts(jax.random.key(3), e, d, shape["inter"]), one)
    experts_tp = jax.device_put(experts_one, NamedSharding(mesh, P(parallel.TP)))
    results = dict(meta=dict(devices=[dv.device_kind for dv in jax.devices()[:tp]], tp=tp, jax=jax.__version__,
                             date=time.strftime("%Y-%m-%d %H:%M:%S"), reps=F.reps, quick=F.quick, **shape,
                             target_ratio=TARGET_RATIO), cases=[])
    for m in [int(t) for t in F.tokens]:
        if time.time() - start > F.time_budget_s:
            results["cases"].append(dict(tokens=m, skipped="time budget"))
            continue
        sets = []
        for s in range(3):
            ids, w = moe_routing(jax.random.key(1000 * m + s), m, e, k)
            sets.append((jax.random.normal(jax.random.key(50 + s), (m, d), BF16), ids, w))
        per_device = e // tp
        local_pairs = [float(np.mean([np.sum(np.asarray(ids) // per_device == dv) for dv in range(tp)]))
                       for _, ids, _ in sets]
        one_sets = [jax.device_put((x, experts_one, i, w), one) for x, i, w in sets]
        replicated = NamedSharding(mesh, P())
        tp_sets = [(jax.device_put(x, replicated), experts_tp, *jax.device_put((i, w), replicated)) for x, i, w in sets]
        for name in F.kernels:
            kernel = _kernel(name)
            one_fn = jax.jit(kernel)
            tp_fn = sharding.under_mesh(mesh, jax.jit(functools.partial(parallel.expert_parallel, kernel)))
            try:
                err = rel_err(np.asarray(tp_fn(*tp_sets[0]), np.float32), np.asarray(one_fn(*one_sets[0]), np.float32))
                t = time_jobs([Job("one", one_fn, one_sets), Job("tp", tp_fn, tp_sets)], F.reps)
                case = dict(tokens=m, kernel=name, one_gpu_us=t["one"]["us"], tp_us=t["tp"]["us"],
                            ratio=t["tp"]["us"] / t["one"]["us"], local_pairs_per_device=float(np.mean(local_pairs)),
                            pairs=m * k, rel_err_tp_vs_one=err, timings=t)
            except Exception as ex:  # noqa: BLE001 - a failing kernel is a result; the other cases go on
                case = dict(tokens=m, kernel=name, error=f"{type(ex).__name__}: {str(ex)[:1500]}")
            results["cases"].append(case)
            if "error" in case:
                logging.warning("M=%d %s: %s", m, name, case["error"])
            else:
                print(f"M={m:5d} {name:14s} one GPU {case['one_gpu_us']:9.1f} us | tp={tp} {case['tp_us']:9.1f} us | "
                      f"ratio {case['ratio']:.2f} (target <= {TARGET_RATIO} at M >= 64) | local pairs "
                      f"{case['local_pairs_per_device']:.0f}/{m * k} | tp vs one rel err {err:.1e}", flush=True)
            _save(results)
    results["meta"]["wall_s"] = time.time() - start
    _save(results)
    _plot(results, os.path.splitext(F.out)[0] + ".png")


def _save(results):
    os.makedirs(os.path.dirname(os.path.abspath(F.out)), exist_ok=True)
    with open(F.out, "w") as f:
        json.dump(results, f, indent=1, default=str)


def _plot(results, path):
    rows = [c for c in results["cases"] if "ratio" in c]
    if not rows:
        return
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted({c["kernel"] for c in rows}):
        pts = [(c["tokens"], c["ratio"]) for c in rows if c["kernel"] == name]
        ax.plot(*zip(*pts), "o-", label=name)
    ax.axhline(TARGET_RATIO, ls="--", color="gray", lw=0.8, label=f"target {TARGET_RATIO}")
    ax.axhline(1 / results["meta"]["tp"], ls=":", color="gray", lw=0.8, label="1 / tp")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens M")
    ax.set_ylabel(f"routed-expert time, tp={results['meta']['tp']} / one GPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    plots.save(fig, path)


if __name__ == "__main__":
    cli.run(main)
