"""Idle device time inside one call of the tree-verify attention op: the span of a call's GPU events (first start to
last end) against their busy time (sum of durations), per variant, on decode cases. Run it once per XLA setting
(XLA_FLAGS is read when JAX starts) to see where the gaps come from:

    python3 experiments/launch_gaps.py --label=default --out=experiments/results/launch_gaps_default.json
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 experiments/launch_gaps.py --label=no_command_buffers \
        --out=experiments/results/launch_gaps_no_command_buffers.json

Variants: `op` (ops.tree_verify_attention: Mosaic GPU kernel, then the Triton combine kernel), `op_planned` (the op
with its `ops.tree_verify_plan` made beforehand, as the model does once per forward), `triton` (the Triton
kernel and its combine), `mosaic_partials` (the Mosaic GPU kernel and its input fusions, no combine), `mosaic_twice`
(two Mosaic GPU kernels of different scales in one call: is there a gap before the second too?),
`mosaic_combine_in_kernel` (the kernel joining its own partials: a zeroed semaphore buffer, then the kernel).
GPU only. Writes the JSON (--out) with the host and device events of each variant's median call (`timeline`: when
each launch was issued on the host against when its kernel ran), and a bar plot of span and busy time beside it.
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
from absl import flags

from experiments.kernels_attention import K26_SCALE, attention_inputs
from experiments.timing import Job, time_jobs
from kdtree_jax import cli, plots
from pallas_kernels import ops
from pallas_kernels import tree_verify_attention_mgpu as attn_mgpu
from pallas_kernels import tree_verify_attention_triton as attn_triton

flags.DEFINE_list("cases", ["64:4096:1", "8:4096:16", "64:32768:1"], "heads:prefix:nodes of one stream each")
flags.DEFINE_integer("reps", 15, "timed calls per variant (median reported)")
flags.DEFINE_float("show_us", 0.5, "print the timeline's events at least this long (all are in the JSON)")
flags.DEFINE_string("label", "default", "name of the XLA setting of this run (recorded with XLA_FLAGS)")
flags.DEFINE_string("out", "experiments/results/launch_gaps.json", "JSON results (a PNG beside it)")
F = flags.FLAGS


def variants(args) -> dict:
    """{name: (jitted function, its arguments)} for the operands `args` (q_lat, q_rope, c_kv, k_rope, prefix_len,
    visible)."""
    s, t, h, _ = args[0].shape
    rows = t * h
    splits = attn_mgpu.default_num_splits(s, rows, args[2].shape[1])

    def partials(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, scale=K26_SCALE):
        q_lat, q_rope = attn_mgpu.query_rows(q_lat), attn_mgpu.query_rows(q_rope)
        return attn_mgpu.attention_partials(
            q_lat, q_rope, c_kv, k_rope, prefix_len, attn_mgpu.frame_bias(prefix_len, visible, h, q_lat.shape[1]),
            scale=scale, num_nodes=t, num_splits=splits)

    op = jax.jit(lambda *a: ops.tree_verify_attention(*a, scale=K26_SCALE))
    out = {"op": op, "op_planned": op,
           "triton": jax.jit(lambda *a: attn_triton.tree_verify_attention(*a, scale=K26_SCALE)),
           "mosaic_partials": jax.jit(partials),
           "mosaic_twice": jax.jit(lambda *a: (partials(*a), partials(*a, scale=K26_SCALE / 2)))}
    if splits > 1:
        out["mosaic_combine_in_kernel"] = jax.jit(
            lambda *a: attn_mgpu.tree_verify_attention(*a, scale=K26_SCALE, combine_in_kernel=True))
    planned = (*args, ops.tree_verify_plan(args[4], args[5], num_heads=h))
    return {name: (fn, planned if name == "op_planned" else args) for name, fn in out.items()}


def main(_):
    if jax.default_backend() != "gpu":
        cli.fail("launch_gaps.py times GPU events: run it on the GPU")
    rows = []
    for i, spec in enumerate(F.cases):
        heads, prefix, nodes = (int(x) for x in spec.split(":"))
        case = dict(streams=1, heads=heads, prefix=prefix, nodes=nodes)
        args = attention_inputs(jax.random.key(i), case, np.random.default_rng(i))
        times = time_jobs([Job(name, fn, [fn_args]) for name, (fn, fn_args) in variants(args).items()], F.reps,
                          timeline=True)
        for name, t in times.items():
            row = dict(case, variant=name, span_us=t["us"], busy_us=t.get("busy_us"), kernels_us=t.get("kernels_us"),
                       timeline=t.get("timeline"))
            rows.append(row)
            print(f"H={heads:2d} N={prefix:6d} T={nodes:3d} {name:26s} span {t['us']:7.1f} us  busy "
                  f"{t.get('busy_us', float('nan')):7.1f} us  {t.get('kernels_us')}", flush=True)
            for line, event, start, duration in t.get("timeline") or []:
                if line == "device" or duration >= F.show_us:
                    print(f"    {start:8.1f} +{duration:7.1f} us  {line[-28:]:28s} {event[:90]}")
    meta = dict(label=F.label, xla_flags=os.environ.get("XLA_FLAGS", ""), jax=jax.__version__,
                device=jax.devices()[0].device_kind)
    os.makedirs(os.path.dirname(os.path.abspath(F.out)), exist_ok=True)
    with open(F.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1, default=str)
    plot(rows, os.path.splitext(F.out)[0] + ".png", meta)


def plot(rows, path: str, meta: dict) -> None:
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["span_us"] for r in rows], 0.4, label="span (first start to last end)")
    ax.bar(x + 0.2, [r["busy_us"] or 0 for r in rows], 0.4, label="busy (sum of kernel times)")
    ax.set_xticks(x, [f"H{r['heads']} N{r['prefix']} T{r['nodes']}\n{r['variant']}" for r in rows], rotation=90,
                  fontsize=7)
    ax.set_ylabel("us per call")
    ax.set_title(f"tree-verify attention: device span vs busy ({meta['label']}, {meta['device']})")
    ax.legend()
    plots.save(fig, path)


if __name__ == "__main__":
    cli.run(main)
