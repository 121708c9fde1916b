"""The tree-verify attention op against FlashMLA's sm90 dense decode (bf16), side by side in one run, on the decode
shapes of #14: the anchor the issue names, measured on the same H200 at the same shapes.

At one stream FlashMLA schedules as the op does: the stream's T x H query rows in 64-row tiles, each tile's cache
split over about 132 / tiles multiprocessors, then a combine kernel (its partials f32, the op's Mosaic GPU ones bf16);
streams are its batch.
Both attend the same keys: the prefix and a chain of T nodes (FlashMLA's causal mask over the nodes is the chain's
ancestor mask), so their outputs agree to bf16 rounding. Each is timed per call of `timing.BACK_TO_BACK` calls over
input sets rotated past the L2: the op in one jitted function (`timing.back_to_back_job`), FlashMLA in one CUDA graph
(PyTorch, CUDA events; its kernels' device times from PyTorch's profiler, after every case's JAX timing: JAX's
profiler cannot take CUPTI once PyTorch's has).

FlashMLA is not a dependency: build its extension first (`experiments/peers/build_flashmla.sh`, which says where its
sources come from), then on the GPU:

    python3 experiments/kernels/attention_flashmla.py --flashmla=/tmp/flashmla \
        --out=experiments/results/kernels/attention_flashmla.json

Writes the JSON (--out) and a bar plot of both per-call times beside it.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # PyTorch shares the GPU in this process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags, logging  # noqa: E402

from experiments.kernels.kernels_attention import (K26_SCALE, attention_cost, attention_inputs,  # noqa: E402
                                                   cache_bytes, case_name, cache_rows, parse_case)
from experiments.peers import flashmla  # noqa: E402
from experiments.run_record import code_version, write_json  # noqa: E402
from experiments.timing import (BACK_TO_BACK, back_to_back_job, measure_ceilings, rel_err, roofline,  # noqa: E402
                                rotation_sets, time_jobs)
from kdtree_jax import cli, plots  # noqa: E402
from pallas_kernels import ops  # noqa: E402
from pallas_kernels import tree_verify_attention as attn  # noqa: E402

flags.DEFINE_list("cases", ["1/8/32768/1", "1/8/32768/16", "1/64/32768/1", "1/64/32768/16", "1/8/4096/1",
                            "1/64/4096/1", "1/64/4096/16", "1/8/32768/64", "1/64/32768/64", "8/8/32768/64",
                            "8/8/32768/16", "8/64/32768/1"],
                  "S/H/N/T: streams (FlashMLA's batch), heads, prefix, nodes")
flags.DEFINE_string("flashmla", None, "directory holding the flashmla_decode extension (build_flashmla.sh's OUT_DIR)")
flags.DEFINE_integer("reps", 15, "timed windows per peer (median reported)")
flags.DEFINE_string("out", "experiments/results/kernels/attention_flashmla.json", "JSON results (a PNG beside it)")
flags.mark_flag_as_required("flashmla")
F = flags.FLAGS


def flashmla_graph(torch, fm, sets):
    """A CUDA graph of BACK_TO_BACK FlashMLA calls rotated over sets (its scheduler's metadata made once, as a decode
    step reuses it), the first call's (out, lse, metadata, split offsets) (the graph reads the last two: keep them
    with it), and the split offsets per stream as a list."""
    first = flashmla.decode(fm, sets[0], K26_SCALE)
    meta, splits = first[2], first[3]

    def calls():
        for c in range(BACK_TO_BACK):
            flashmla.decode(fm, sets[c % len(sets)], K26_SCALE, meta, splits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph, first, splits.tolist()


def time_graph(torch, graph, reps: int) -> dict:
    """Per call of the graph's BACK_TO_BACK calls, us: the median over reps replays by CUDA events, and its spread."""
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / BACK_TO_BACK)
    return dict(us=float(np.median(times)), us_spread=float(np.std(times)))


def graph_kernels_us(torch, graph, reps: int) -> dict:
    """{'splitkv' | 'combine' | name: device us per call} of the graph's kernels, from PyTorch's profiler. Run it after
    every JAX timing: once PyTorch's profiler has held CUPTI, JAX's cannot subscribe to it in this process."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    short = {"splitkv": "splitkv", "combine": "combine"}
    return {next((v for k, v in short.items() if k in e.key), e.key[:60]): e.device_time_total / (reps * BACK_TO_BACK)
            for e in prof.key_averages() if e.device_time_total > 0}


def run_case(torch, fm, case: dict, ceil: dict, key) -> tuple[dict, tuple]:
    """One row (the op's and FlashMLA's per-call times, their errors against the op's XLA reference) and FlashMLA's
    graph with the input sets it replays on, whose kernels `graph_kernels_us` times once every case has run."""
    sets = []
    for i in range(rotation_sets(cache_bytes(case), 16)):
        args = attention_inputs(jax.random.fold_in(key, i), case, np.random.default_rng(i))
        args = (*args[:5], jnp.asarray(flashmla.chain_visible(case["streams"], case["nodes"])))
        sets.append((*args, ops.tree_verify_plan(args[4], args[5], num_heads=case["heads"])))
    ref = attn.tree_verify_attention_reference(*sets[0][:6], scale=K26_SCALE).astype(jnp.float32)
    op = jax.jit(lambda *a: ops.tree_verify_attention(*a, scale=K26_SCALE))
    ours = time_jobs([back_to_back_job("op", op, sets)], F.reps)["op"]
    peer_sets = [flashmla.inputs(torch, a) for a in sets]
    graph, first, splits = flashmla_graph(torch, fm, peer_sets)
    peer = time_graph(torch, graph, F.reps)
    theirs = jnp.asarray(first[0].float().cpu().numpy())
    flops, bytes_ = attention_cost(case)
    floor = roofline(flops, bytes_, ceil)
    row = dict(case, cache_rows=cache_rows(case), backend=ops.attention_backend(*sets[0][:4]),
               op_us=ours["us"], op_timing_method=ours["method"], op_kernels_us=ours.get("kernels_us"),
               flashmla_us=peer["us"], flashmla_us_spread=peer["us_spread"], flashmla_split_offsets=splits,
               op_vs_flashmla=peer["us"] / ours["us"], roofline_us=floor, op_roofline_fraction=floor / ours["us"],
               flashmla_roofline_fraction=floor / peer["us"],
               op_rel_err_bf16=rel_err(op(*sets[0]).astype(jnp.float32), ref),
               flashmla_rel_err_bf16=rel_err(theirs, ref),
               input_sets=len(sets))
    logging.info("%s: op %.2f us, FlashMLA %.2f us", case, row["op_us"], row["flashmla_us"])
    return row, (graph, peer_sets, first)      # the graph replays on these tensors: kept alive with it


def main(_):
    cases = [parse_case(text) for text in F.cases]
    if jax.default_backend() != "gpu":
        cli.fail("attention_flashmla.py times CUDA kernels: run it on a Hopper GPU")
    import torch
    try:
        fm = flashmla.load(F.flashmla)
    except ImportError as e:
        cli.fail(f"--flashmla={F.flashmla}: {e}")
    ceil = measure_ceilings(F.reps, quick=False)
    print(f"ceilings: {ceil['bandwidth_GBps']:.0f} GB/s, {ceil['matmul_TFLOPs']:.0f} TFLOP/s")
    print(f"{'case S/H/N/T':16s} {'backend':>10s} {'op us':>8s} {'FlashMLA us':>12s} {'FlashMLA / op':>14s} "
          f"{'op roof':>8s} {'FlashMLA roof':>14s} {'op err':>8s} {'FlashMLA err':>13s}")
    rows, graphs = [], []
    for i, (text, case) in enumerate(zip(F.cases, cases)):
        row, graph = run_case(torch, fm, case, ceil, jax.random.key(i))
        rows.append(row)
        graphs.append(graph)
        print(f"{text:16s} {row['backend']:>10s} {row['op_us']:8.2f} {row['flashmla_us']:12.2f} "
              f"{row['op_vs_flashmla']:14.2f} {row['op_roofline_fraction']:8.1%} "
              f"{row['flashmla_roofline_fraction']:14.1%} {row['op_rel_err_bf16']:8.1e} "
              f"{row['flashmla_rel_err_bf16']:13.1e}", flush=True)
    print("kernels, device us per call (op | FlashMLA):")
    for text, row, graph in zip(F.cases, rows, graphs):
        row["flashmla_kernels_us"] = graph_kernels_us(torch, graph[0], F.reps)
        print(f"{text:16s} " + " ".join(f"{k} {v:.2f}" for k, v in (row["op_kernels_us"] or {}).items()) + " | "
              + " ".join(f"{k} {v:.2f}" for k, v in row["flashmla_kernels_us"].items()), flush=True)
    meta = dict(jax=jax.__version__, torch=torch.__version__, device=jax.devices()[0].device_kind,
                ceilings={k: v for k, v in ceil.items() if k != "timings"}, reps=F.reps, back_to_back=BACK_TO_BACK,
                code=code_version())
    write_json(F.out, dict(meta=meta, rows=rows))
    plot(rows, os.path.splitext(F.out)[0] + ".png", meta)


def plot(rows, path: str, meta: dict) -> None:
    plots.grouped_bars(path, [case_name(r) for r in rows],
                       {"tree_verify_attention (ops)": [r["op_us"] for r in rows],
                        "FlashMLA dense decode": [r["flashmla_us"] for r in rows]},
                       ylabel="us per call (back to back)", log=True,
                       title=f"the op against FlashMLA ({meta['device']}, code {meta['code']})")


if __name__ == "__main__":
    cli.run(main)
