"""Check and time the GPU kernels against their XLA references and baselines at K2.6 shapes.

    PYTHONPATH=. python3 experiments/kernels/bench_kernels.py --out=experiments/results/kernels/kernels.json
    PYTHONPATH=. python3 experiments/kernels/bench_kernels.py --quick   # small shapes, interpret mode: a CPU smoke run

Timings are device times from profiler traces and ceilings are measured in the same run (experiments/timing.py).

Sections (--sections), one module each: ceilings (timing.measure_ceilings), attention (kernels_attention.py:
tree_verify_attention), moe (kernels_moe.py: int4_moe), tree (kernels_tree.py: tree_build and tree_accept); not in
the default list, GPU only: mgpu (kernels_attention_mgpu.py: variants of the Mosaic GPU tree-verify attention beside
the Triton kernel), combine (kernels_combine.py: the split-K combine kernel against XLA's at every split count) and
skinny (kernels_skinny.py: skinny_matmul against XLA at the tp=8 share's dense products, M = 1-64).
This script runs them, writes the JSON after every case and plots the results beside it.
"""
from __future__ import annotations

import json
import os
import platform
import time

import numpy as np
from absl import flags

import jax

from experiments.kernels.kernels_attention import attention_cases, attention_f32_check, case_name, run_attention
from experiments.kernels.kernels_attention_mgpu import run_attention_mgpu
from experiments.kernels.kernels_combine import run_combine
from experiments.kernels.kernels_skinny import run_skinny
from experiments.kernels.kernels_moe import run_moe
from experiments.kernels.kernels_tree import run_tree
from experiments.run_record import code_version, write_json
from experiments.timing import measure_ceilings
from kdtree_jax import cli, plots
from pallas_kernels import tree_verify_attention_triton as attn_triton
from pallas_kernels.triton_call import LAUNCHERS

flags.DEFINE_string("out", "experiments/results/kernels/kernels.json", "where the JSON results go")
flags.DEFINE_list("sections", ["ceilings", "attention", "moe", "tree"], "which parts to run")
flags.DEFINE_integer("reps", 15, "timed calls per measurement (median reported)")
flags.DEFINE_list("sweep", ["attention", "moe"], "sections (attention, moe) whose representative cases also time "
                  "alternative tilings; '' for none")
flags.DEFINE_list("attention_splits", [], "split-K counts also timed on every attention case: the Triton kernel's "
                  "(those it admits: at most prefix / (2 block_k), at most 4 waves of programs) and the Mosaic GPU "
                  "op's (up to one cache block a split; peers `mosaic_gpu:num_splits=N`)")
flags.DEFINE_list("attention_cases", [], "the attention cases to run, each 'S/H/N/T' (streams, heads, prefix, "
                  "nodes; default: every case)")
flags.DEFINE_list("moe_tokens", [], "the int4_moe token counts M to run (default: every case)")
flags.DEFINE_list("moe_sweep_tokens", ["1", "1024", "4096"], "token counts M whose int4_moe case sweeps tilings")
flags.DEFINE_enum("attention_sweep_launcher", attn_triton.LAUNCHER, list(LAUNCHERS), "the `triton_call` launcher of the "
                  "Triton kernel's tilings and split counts in the attention sweep (the op's own is its module's "
                  "LAUNCHER; with --attention_launch_peers its default tiling is also timed through the others)")
flags.DEFINE_bool("attention_launch_peers", False, "also time the Triton kernel's default tiling through the other "
                  "`triton_call` launchers (peers `triton:launch:NAME`; their compiles about double a case's time)")
flags.DEFINE_float("attention_budget_s", 240.0, "start no new attention case past this many seconds of the section")
flags.DEFINE_float("moe_budget_s", 200.0, "start no new int4_moe case past this many seconds of the section")
flags.DEFINE_float("tree_budget_s", 240.0, "start no new tree case past this many seconds of the section")
flags.DEFINE_bool("merge", False, "keep the sections of an existing --out that this run does not measure, and "
                  "with --attention_cases the attention cases it does not re-run (their own run's meta and ceilings "
                  "recorded under meta.merged): one JSON from runs split over device calls")
flags.DEFINE_bool("plot", True, "also write a PNG of the results beside the JSON")
flags.DEFINE_bool("quick", False, "small shapes in interpret mode, to smoke-test the script on a CPU")
F = flags.FLAGS


RESULTS: dict = {}
EARLIER_ROWS: dict = {}     # --merge: the earlier run's attention rows by case, for the cases this run skips


def _dump():
    write_json(F.out, RESULTS)


def main(_):
    start = time.time()
    for flag, allowed in (("sections", ("ceilings", "attention", "moe", "tree", "mgpu", "combine", "skinny")),
                          ("sweep", ("attention", "moe"))):
        unknown = set(getattr(F, flag)) - set(allowed)
        if unknown:
            raise ValueError(f"--{flag}: unknown {sorted(unknown)}; choose from {list(allowed)} ('' for none)")
    dev = jax.devices()[0]
    RESULTS.update(meta=dict(jax=jax.__version__, backend=jax.default_backend(), device=dev.device_kind,
                             host=platform.node(), date=time.strftime("%Y-%m-%d %H:%M:%S"), code=code_version(),
                             sections=F.sections, reps=F.reps, quick=F.quick, sweep=F.sweep,
                             attention_splits=F.attention_splits, attention_cases=F.attention_cases,
                             attention_sweep_launcher=F.attention_sweep_launcher,
                             attention_launch_peers=F.attention_launch_peers,
                             moe_tokens=F.moe_tokens,
                             moe_sweep_tokens=F.moe_sweep_tokens,
                             xla_flags=os.environ.get("XLA_FLAGS", "")),
                   ceilings={}, checks={}, attention=[], attention_mgpu=[], attention_combine=[], int4_moe=[], tree=[],
                   skinny_matmul=[])
    if F.merge:
        merge_earlier_run(F.out)
    if "ceilings" in F.sections:
        RESULTS["ceilings"] = measure_ceilings(F.reps, F.quick)
    else:   # H200_FACTS.md leads, used only when the ceilings are not measured
        RESULTS["ceilings"] = dict(bandwidth_GBps=4300.0, matmul_TFLOPs=780.0, bandwidth_method="assumed")
    ceil = RESULTS["ceilings"]
    print(f"ceilings: {ceil['bandwidth_GBps']:.0f} GB/s ({ceil['bandwidth_method']}), "
          f"{ceil['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    _dump()
    if "attention" in F.sections:
        try:
            RESULTS["checks"]["attention_f32"] = attention_f32_check(F.quick)
        except Exception as e:  # noqa: BLE001 - a failed check is a result; the benchmark goes on
            RESULTS["checks"]["attention_f32"] = f"{type(e).__name__}: {str(e)[:2000]}"
        print("attention f32 check:", RESULTS["checks"]["attention_f32"], flush=True)
        run_attention(ceil, RESULTS["attention"], time.time() + F.attention_budget_s, F.reps, F.quick,
                      "attention" in F.sweep, [int(s) for s in F.attention_splits], _dump, F.attention_cases,
                      F.attention_sweep_launcher, F.attention_launch_peers)
        if F.merge:
            keep_earlier_rows()
        order = {case_name(case): i for i, case in enumerate(attention_cases(F.quick))}
        RESULTS["attention"].sort(key=lambda row: order.get(case_name(row), len(order)))   # merged rows: table order
    if "mgpu" in F.sections:
        run_attention_mgpu(ceil, RESULTS["attention_mgpu"], time.time() + F.attention_budget_s, F.reps, F.quick, _dump)
    if "combine" in F.sections:
        run_combine(ceil, RESULTS["attention_combine"], time.time() + F.attention_budget_s, F.reps, _dump)
    if "skinny" in F.sections:
        run_skinny(ceil, RESULTS["skinny_matmul"], time.time() + F.moe_budget_s, F.reps, _dump)
    if "moe" in F.sections:
        run_moe(ceil, RESULTS["int4_moe"], RESULTS["checks"], time.time() + F.moe_budget_s, F.reps, F.quick,
                [int(m) for m in F.moe_sweep_tokens] if "moe" in F.sweep else [], _dump,
                [int(m) for m in F.moe_tokens])
        print("int4_moe f32 checks:", {k: v for k, v in RESULTS["checks"].items() if k.startswith("int4_moe")},
              flush=True)
    if "tree" in F.sections:
        run_tree(RESULTS["tree"], RESULTS["checks"], time.time() + F.tree_budget_s, F.reps, F.quick, _dump)
        print("tree kernels identical to the heapq spec and the python accept walk:",
              RESULTS["checks"]["tree_identical"], flush=True)
    RESULTS["meta"]["wall_s"] = time.time() - start
    _dump()
    print(f"wrote {F.out} in {time.time() - start:.0f} s", flush=True)
    if F.plot:
        plot_results(RESULTS, os.path.splitext(F.out)[0] + ".png")


SECTION_KEYS = {"attention": ("attention",), "mgpu": ("attention_mgpu",), "combine": ("attention_combine",),
                "moe": ("int4_moe",), "tree": ("tree",), "skinny": ("skinny_matmul",)}


def merge_earlier_run(path: str) -> None:
    """--merge: copy into RESULTS the sections of the JSON at `path` that this run does not measure, with their
    checks, and, where this run measures only some attention cases (--attention_cases), the earlier run's other
    attention cases (this run's rows are added after them), and keep its rows for `keep_earlier_rows` (the cases this
    run skips on its time budget); record that run's meta and ceilings under meta.merged (each row's fractions stay
    those of the ceilings measured in its own run)."""
    if not os.path.exists(path):
        raise ValueError(f"--merge: {path} does not exist; run without --merge first")
    with open(path) as f:
        earlier = json.load(f)
    kept = [name for name, keys in SECTION_KEYS.items()
            if name not in F.sections and any(earlier.get(key) for key in keys)]
    for name in kept:
        for key in SECTION_KEYS[name]:
            RESULTS[key] = earlier[key]
    RESULTS["checks"].update(earlier.get("checks", {}))
    kept_cases = []
    EARLIER_ROWS.update({case_name(row): row for row in earlier.get("attention", []) if "skipped" not in row})
    if "attention" in F.sections and F.attention_cases:
        RESULTS["attention"] = [row for row in earlier.get("attention", [])
                                if case_name(row) not in F.attention_cases]
        kept_cases = [case_name(row) for row in RESULTS["attention"]]
    RESULTS["meta"]["merged"] = dict(sections=kept, attention_cases=kept_cases, meta=earlier.get("meta"),
                                     ceilings=earlier.get("ceilings"))


def keep_earlier_rows() -> None:
    """--merge: each attention case this run skipped on its time budget keeps the earlier run's row, if it had one
    (named in meta.merged.attention_cases), rather than a row saying it was skipped."""
    for i, row in enumerate(RESULTS["attention"]):
        name = case_name(row)
        if "skipped" in row and name in EARLIER_ROWS:
            RESULTS["attention"][i] = EARLIER_ROWS[name]
            RESULTS["meta"]["merged"]["attention_cases"].append(name)


def plot_results(results: dict, path: str) -> None:
    """One panel per measured section: attention (fraction of roofline and speedup over XLA per case), int4_moe
    (kernel vs the XLA bf16 baselines per M), tree (build paths vs the heap peer per B) and skinny_matmul (the
    layer's dense products, kernel vs XLA per M)."""
    plt = plots.pyplot()
    sections = [name for name in ("attention", "int4_moe", "tree", "skinny_matmul")
                if any("kernel_us" in r or "kernel_from_topk_us" in r or r.get("product") == "layer"
                       for r in results.get(name, []))]
    if not sections:
        return
    fig, axes = plt.subplots(1, len(sections), figsize=(6 * len(sections), 4.2), squeeze=False)
    for ax, name in zip(axes[0], sections):
        rows = [r for r in results[name]
                if "kernel_us" in r or "kernel_from_topk_us" in r or r.get("product") == "layer"]
        if name == "attention":
            x = np.arange(len(rows))
            ax.bar(x - 0.2, [r["roofline_fraction"] for r in rows], 0.4, label="fraction of roofline")
            ax.bar(x + 0.2, [r["speedup_vs_reference"] / 10 for r in rows], 0.4, label="speedup over XLA / 10")
            ax.axhline(0.7, ls="--", color="C0", lw=0.8)
            ax.axhline(0.3, ls="--", color="C1", lw=0.8)
            ax.set_xticks(x, [f"S{r['streams']} H{r['heads']} N{r['prefix'] // 1024}k T{r['nodes']}" for r in rows],
                          rotation=70, fontsize=7)
            ax.set_title("tree_verify_attention (dashed: targets 70%, 3x)", fontsize=9)
        elif name == "int4_moe":
            m = [r["tokens"] for r in rows]
            ax.plot(m, [r["kernel_us"] for r in rows], "o-", label="int4_moe kernel")
            for base in sorted({b for r in rows for b in r["baselines_us"]}):
                pts = [(r["tokens"], r["baselines_us"][base]) for r in rows if base in r["baselines_us"]]
                ax.plot(*zip(*pts), "s--", label=base)
            ax.plot(m, [r["roofline_us"] for r in rows], ":", color="gray", label="roofline")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens M")
            ax.set_title("int4_moe, K2.6 experts", fontsize=9)
        elif name == "skinny_matmul":
            m = [r["rows"] for r in rows]
            for variant in rows[0]["busy_us"]:
                ax.plot(m, [r["busy_us"][variant] for r in rows], "o-", label=variant)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("rows M")
            ax.set_title("one layer's dense products, tp=8 share (device busy, sum of 8)", fontsize=9)
        else:
            b = [r["budget"] for r in rows]
            for key, label in (("kernel_from_topk_us", "build kernel (from top-K)"),
                               ("reference_from_topk_us", "jnp reference (from top-K)"),
                               ("topk_us", "top-K (shared)"), ("peer_us", "heapq CPU peer, whole")):
                ax.plot(b, [r[key] for r in rows], "o-", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget B")
            ax.set_title(f"tree build, {rows[0]['streams']} streams, V={rows[0]['vocab']}", fontsize=9)
        if name != "attention":
            ax.set_yscale("log")
            ax.set_ylabel("us")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"kernels on {results['meta']['device']}", fontsize=10)
    plots.save(fig, path)


if __name__ == "__main__":
    cli.run(main)
