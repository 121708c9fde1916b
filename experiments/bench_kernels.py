"""Check and time the Pallas kernels against their XLA references and baselines at K2.6 shapes (GPU).

    PYTHONPATH=. python3 experiments/bench_kernels.py --out=experiments/results/kernels.json
    PYTHONPATH=. python3 experiments/bench_kernels.py --quick      # small shapes, interpret mode: a CPU smoke run

Every timing is device time: the span of the GPU events of one call, read from a JAX profiler trace (the call runs
inside a TraceAnnotation and is waited for), median over --reps calls after a warm-up, with inputs rotated over
enough sets to exceed the L2 cache. Ceilings are measured in the same run: the best of a plain copy and an
elementwise pass for bandwidth (bytes read + written), an 8192^3 bf16 matmul for FLOP/s.

Sections (--sections): ceilings, attention (tree_verify_attention), moe (int4_moe), tree (tree_build and tree_accept
at S = 16 streams, D = 15, V = 163840, B = 16..512: kernel, jnp reference, and the CPU heap per request that the
paper's code uses, timed by wall clock since it crosses the host; every tree is checked bit-identical to the heapq
specification and every accept walk to the python loop), mgpu (not in the default list: the experimental Mosaic GPU
prefix kernel beside the Triton kernel on the attention cases with >= 64 query rows, no tree node visible).
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
import platform
import tempfile
import time

import numpy as np
from absl import app, flags

import jax
import jax.numpy as jnp
from jax import lax

from kdtree_jax import plots
from pallas_kernels.tree import (TreeArrays, accept_tree, accept_tree_python, build_tree_from_topk,
                             build_tree_heapq_from_topk, draft_topk, random_tree_visible, resolve_topk)
from pallas_kernels import int4_moe as moe
from pallas_kernels import ops
from pallas_kernels import prefix_attention_mgpu as mgpu_attn
from pallas_kernels import tree_accept as taccept
from pallas_kernels import tree_build as tbuild
from pallas_kernels import tree_verify_attention as attn

flags.DEFINE_string("out", "experiments/results/kernels.json", "where the JSON results go")
flags.DEFINE_list("sections", ["ceilings", "attention", "moe", "tree"], "which parts to run")
flags.DEFINE_integer("reps", 15, "timed calls per measurement (median reported)")
flags.DEFINE_list("sweep", ["attention", "moe"], "sections (attention, moe) whose representative cases also time "
                  "alternative tilings; '' for none")
flags.DEFINE_list("attention_splits", [], "split-K counts also timed on every attention case (those it admits: at "
                  "most prefix / (2 block_k), at most 4 waves of programs)")
flags.DEFINE_list("moe_sweep_tokens", ["1", "4096"], "token counts M whose int4_moe case sweeps tilings")
flags.DEFINE_float("attention_budget_s", 240.0, "start no new attention case past this many seconds of the section")
flags.DEFINE_float("moe_budget_s", 200.0, "start no new int4_moe case past this many seconds of the section")
flags.DEFINE_float("tree_budget_s", 240.0, "start no new tree case past this many seconds of the section")
flags.DEFINE_bool("plot", True, "also write a PNG of the results beside the JSON")
flags.DEFINE_bool("quick", False, "small shapes in interpret mode, to smoke-test the script on a CPU")
F = flags.FLAGS

L2_BYTES = 60e6          # H200 L2; input sets are rotated so that one pass over them exceeds it several times
ROTATE_BYTES = 200e6
GAP_S = 0.002            # host pause between timed calls, so calls never overlap on the device
BF16 = jnp.bfloat16


# ----------------------------------------------------------------------------------------------------- timing
@dataclasses.dataclass
class Call:
    """The device side of one timed call, from the profiler trace."""
    span_us: float                  # first event start to last event end
    events_us: dict[str, float]     # total us per GPU event name (kernels and copies)
    events: int                     # device events (kernel launches + copies)
    d2h_copies: int                 # device-to-host copies (e.g. a while loop's predicate, once per iteration)


def _annotation_calls(trace_dir: str) -> dict[str, list[Call]]:
    """From the trace in trace_dir: {job: [Call of each timed call]}."""
    from jax.profiler import ProfileData
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {}
    data = ProfileData.from_file(sorted(files)[-1])
    windows, device = [], []
    for plane in data.planes:
        is_device = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            for ev in line.events:
                if is_device and ev.duration_ns > 0:
                    device.append((ev.start_ns, ev.start_ns + ev.duration_ns, ev.name))
                elif not is_device and ev.name.startswith("bench|"):
                    windows.append((ev.name, ev.start_ns, ev.start_ns + ev.duration_ns))
    device.sort()
    starts = np.array([d[0] for d in device])
    calls: dict[str, list[Call]] = {}
    for name, lo, hi in windows:
        i0, i1 = np.searchsorted(starts, lo), np.searchsorted(starts, hi)
        inside = [d for d in device[i0:i1] if d[1] <= hi]
        if inside:
            per_event: dict[str, float] = {}
            for d in inside:
                per_event[d[2][:80]] = per_event.get(d[2][:80], 0.0) + (d[1] - d[0]) / 1e3
            calls.setdefault(name.split("|")[1], []).append(Call(
                span_us=(max(d[1] for d in inside) - inside[0][0]) / 1e3, events_us=per_event, events=len(inside),
                d2h_copies=sum(d[2].startswith("MemcpyD2H") for d in inside)))
    return calls


@dataclasses.dataclass
class Job:
    name: str
    fn: object                  # jitted callable
    arg_sets: list = dataclasses.field(default_factory=list)   # argument tuples, rotated
    fresh_args: object = None   # or () -> a new argument tuple for every call (donated arguments), made and waited
                                # for outside the timed window

    def args(self, r: int):
        if self.fresh_args is not None:
            return jax.block_until_ready(self.fresh_args())
        return self.arg_sets[r % len(self.arg_sets)]

    def warmups(self) -> int:
        return 2 if self.fresh_args is not None else min(2, len(self.arg_sets))


def time_jobs(jobs: list[Job], reps: int) -> dict[str, dict]:
    """Warm up every job, then time them all in one profiler session. Returns {name: timing dict}: `us` (device span,
    or wall clock when there is no device trace), `wall_us`; with a trace also `busy_us` (sum of the call's device
    events), `kernels_us` (the 8 longest event names), `device_events` and `d2h_copies` per call."""
    for job in jobs:
        for r in range(job.warmups()):
            jax.block_until_ready(job.fn(*job.args(r)))
    wall: dict[str, list[float]] = {job.name: [] for job in jobs}
    trace_dir = tempfile.mkdtemp(prefix="bench_trace_")
    traced = True
    try:
        jax.profiler.start_trace(trace_dir)
    except Exception:  # noqa: BLE001 - no profiler: fall back to wall-clock timing
        traced = False
    try:
        for job in jobs:
            for r in range(reps):
                args = job.args(r)
                time.sleep(GAP_S)
                with jax.profiler.TraceAnnotation(f"bench|{job.name}|{r}"):
                    t0 = time.perf_counter()
                    jax.block_until_ready(job.fn(*args))
                    wall[job.name].append((time.perf_counter() - t0) * 1e6)
    finally:
        if traced:
            jax.profiler.stop_trace()
    calls = _annotation_calls(trace_dir) if traced else {}
    out = {}
    for job in jobs:
        dev = calls.get(job.name, [])
        entry = {"wall_us": float(np.median(wall[job.name]))}
        if len(dev) >= max(1, reps // 2):  # a device trace of (most of) the calls
            names = {k for c in dev for k in c.events_us}
            per_name = {k: float(np.median([c.events_us.get(k, 0.0) for c in dev])) for k in names}
            top = sorted(per_name.items(), key=lambda kv: -kv[1])[:8]
            entry.update(us=float(np.median([c.span_us for c in dev])), method="device",
                         device_spread_us=float(np.std([c.span_us for c in dev])),
                         busy_us=float(np.median([sum(c.events_us.values()) for c in dev])),
                         kernels_us=dict(top), kernel_launches=len(names),
                         device_events=float(np.median([c.events for c in dev])),
                         d2h_copies=float(np.median([c.d2h_copies for c in dev])))
        else:
            entry.update(us=entry["wall_us"], method="wall")
        out[job.name] = entry
    return out


def try_candidates(fns: dict, run, ref) -> tuple[dict, dict]:
    """Run each candidate once: ({name: rel err vs ref}, {name: error}); failing candidates leave `fns`.
    The default ("kernel") must work."""
    errors, failed = {}, {}
    for name in list(fns):
        try:
            errors[name] = rel_err(run(fns[name]), ref)
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile is a result, not a crash
            if name == "kernel":
                raise
            failed[name] = f"{type(e).__name__}: {str(e)[:500]}"
            del fns[name]
    return errors, failed


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --------------------------------------------------------------------------------------------------- ceilings
def measure_ceilings(reps: int) -> dict:
    n = (1 << 31) if not F.quick else (1 << 20)                        # 4 GiB of bf16
    x = jax.random.normal(jax.random.key(0), (n,), BF16)
    m = 8192 if not F.quick else 256
    a, b = (jax.random.normal(jax.random.key(i), (m, m), BF16) for i in (1, 2))
    t = time_jobs([Job("copy", jax.jit(jnp.copy), [(x,)]),
                   Job("elementwise", jax.jit(lambda v: v + 1), [(x,)]),
                   Job("matmul", jax.jit(jnp.matmul), [(a, b)])], reps)
    moved = 2 * x.size * x.dtype.itemsize
    bw = {k: moved / (t[k]["us"] * 1e-6) / 1e9 for k in ("copy", "elementwise")}
    best = max(bw, key=bw.get)
    return {"bandwidth_GBps": bw[best], "bandwidth_method": f"{best} of {moved / 1e9:.1f} GB (read + write)",
            "copy_GBps": bw["copy"], "elementwise_GBps": bw["elementwise"],
            "matmul_TFLOPs": 2 * m ** 3 / (t["matmul"]["us"] * 1e-6) / 1e12, "matmul_shape": [m, m, m],
            "timings": t}


def roofline(flops: float, bytes_: float, ceil: dict) -> float:
    """Floor in us: the larger of bytes over bandwidth and FLOPs over the matmul rate."""
    return max(bytes_ / (ceil["bandwidth_GBps"] * 1e9), flops / (ceil["matmul_TFLOPs"] * 1e12)) * 1e6


# -------------------------------------------------------------------------------------------------- attention
K26_LAT, K26_ROPE = 512, 64
K26_SCALE = 192 ** -0.5  # 1 / sqrt(qk_nope 128 + qk_rope 64), the benchmark's softmax scale


def attention_cases():
    if F.quick:
        return [dict(streams=1, heads=8, prefix=256, nodes=t) for t in (1, 16)] + [
            dict(streams=2, heads=4, prefix=128, nodes=5)]
    cases = [dict(streams=1, heads=h, prefix=p, nodes=t) for h in (8, 64) for p in (4096, 32768)
             for t in (1, 16, 64, 256)]
    return cases + [dict(streams=8, heads=8, prefix=32768, nodes=64)]


def attention_sweep(case) -> list[attn.AttentionConfig]:
    """Alternative tilings: --attention_splits on every case, and with --sweep=attention tilings on four prefix-32768
    cases."""
    rows = case["nodes"] * case["heads"]
    base = attn.default_config(case["streams"], rows, case["prefix"] + case["nodes"])
    splits = [dataclasses.replace(base, num_splits=s) for s in sorted({int(s) for s in F.attention_splits})
              if s != base.num_splits and s <= attn.max_splits(case["prefix"] + case["nodes"], base.block_k)
              and attn.query_tiles(case["streams"], rows, base.block_q) * s <= 4 * attn.wave_slots(base.block_q)]
    if ("attention" not in F.sweep or F.quick or case["prefix"] != 32768 or case["streams"] > 1
            or (case["heads"], case["nodes"]) not in ((8, 1), (8, 16), (64, 16), (64, 256))):
        return splits
    fewer, more = dict(num_splits=max(1, base.num_splits // 2)), dict(num_splits=2 * base.num_splits)
    if rows <= 16:
        variants = [dict(block_k=128), dict(block_k=32, num_stages=3), more]
    else:
        variants = [dict(block_k=32), dict(block_q=32, num_warps=4), dict(block_q=32, block_k=32, num_stages=3), fewer]
    return splits + [dataclasses.replace(base, **v) for v in variants]


def attention_inputs(key, case, rng):
    s, t, h, p = case["streams"], case["nodes"], case["heads"], case["prefix"]
    n = p + t
    k = jax.random.split(key, 4)
    return (jax.random.normal(k[0], (s, t, h, K26_LAT), BF16), jax.random.normal(k[1], (s, t, h, K26_ROPE), BF16),
            jax.random.normal(k[2], (s, n, K26_LAT), BF16), jax.random.normal(k[3], (s, n, K26_ROPE), BF16),
            jnp.full((s,), p, jnp.int32), jnp.asarray(random_tree_visible(rng, s, t)))


def attention_cost(case) -> tuple[float, float]:
    """Useful FLOPs and the fewest HBM bytes (cache rows once, q once, out once) of one call."""
    s, t, h, p = case["streams"], case["nodes"], case["heads"], case["prefix"]
    rows = p + t
    flops = 2.0 * s * t * h * rows * (2 * K26_LAT + K26_ROPE)
    bytes_ = 2.0 * s * (rows * (K26_LAT + K26_ROPE) + t * h * (2 * K26_LAT + K26_ROPE))
    return flops, bytes_


def run_attention(ceil, results, deadline):
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(0)
    for ci, case in enumerate(attention_cases()):
        if time.time() > deadline:
            results.append(dict(case, skipped="time budget"))
            continue
        try:
            _, _, _, p = case["streams"], case["nodes"], case["heads"], case["prefix"]
            one = 2.0 * case["streams"] * (p + case["nodes"]) * (K26_LAT + K26_ROPE)
            n_sets = int(min(32, max(2, math.ceil(ROTATE_BYTES / one))))
            sets = [attention_inputs(jax.random.key(1000 * ci + i), case, rng) for i in range(n_sets)]
            configs = [None] + attention_sweep(case)
            fns = {}
            for cfg in configs:
                fns["kernel" if cfg is None else f"kernel:{cfg}"] = jax.jit(
                    lambda *a, cfg=cfg: attn.tree_verify_attention(*a, scale=K26_SCALE, config=cfg,
                                                                   interpret=interpret))
            ref_fn = jax.jit(lambda *a: attn.tree_verify_attention_reference(*a, scale=K26_SCALE))
            ref = ref_fn(*sets[0]).astype(jnp.float32)
            errors, failed = try_candidates(fns, lambda fn: fn(*sets[0]).astype(jnp.float32), ref)
            jobs = [Job(name, fn, sets) for name, fn in fns.items()] + [Job("reference", ref_fn, sets)]
            t = time_jobs(jobs, F.reps)
            flops, bytes_ = attention_cost(case)
            floor = roofline(flops, bytes_, ceil)
            best = min(fns, key=lambda k: t[k]["us"])
            k_us, r_us = t["kernel"]["us"], t["reference"]["us"]
            entry = dict(case, config=str(attn.default_config(case["streams"], case["nodes"] * case["heads"],
                                                               case["prefix"] + case["nodes"])),
                         kernel_us=k_us, reference_us=r_us, speedup_vs_reference=r_us / k_us,
                         GBps=bytes_ / (k_us * 1e-6) / 1e9, TFLOPs=flops / (k_us * 1e-6) / 1e12,
                         roofline_us=floor, roofline_fraction=floor / k_us, rel_err_bf16=errors["kernel"],
                         best_config=best, best_us=t[best]["us"], best_roofline_fraction=floor / t[best]["us"],
                         timing_method=t["kernel"]["method"], input_sets=n_sets,
                         sweep={k: dict(us=t[k]["us"], rel_err=errors[k]) for k in fns if k != "kernel"},
                         sweep_failed=failed, timings=t)
        except Exception as e:  # noqa: BLE001 - record the failure and go on with the other cases
            entry = dict(case, error=f"{type(e).__name__}: {str(e)[:2000]}")
        results.append(entry)
        _print_attention_row(entry)
        _dump()


def attention_f32_check() -> dict:
    """f32 inputs (IEEE dots in the kernel) on a ragged batch with random trees: split-K on and off."""
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(1)
    s, t, h, n = 4, 16, 8, (1024 if not F.quick else 96)
    key = jax.random.split(jax.random.key(7), 4)
    args = (jax.random.normal(key[0], (s, t, h, K26_LAT)), jax.random.normal(key[1], (s, t, h, K26_ROPE)),
            jax.random.normal(key[2], (s, n, K26_LAT)), jax.random.normal(key[3], (s, n, K26_ROPE)),
            jnp.asarray([0, n - t, 37, n // 2], jnp.int32), jnp.asarray(random_tree_visible(rng, s, t)))
    ref = attn.tree_verify_attention_reference(*args, scale=0.05)
    out = {}
    for splits in (1, 4):
        cfg = attn.AttentionConfig(block_q=16, block_k=16, num_splits=splits)   # f32 tiles: small, for shared memory
        got = attn.tree_verify_attention(*args, scale=0.05, config=cfg, interpret=interpret)
        out[f"splits={splits}"] = rel_err(got, ref)
    return out


def run_attention_mgpu(ceil, results, deadline):
    """The experimental Mosaic GPU prefix kernel beside the Triton kernel, both at the Triton kernel's split count, on
    the attention cases whose T x H query rows fill 64-row tiles, with no tree node visible (so both attend the prefix
    only; the Triton kernel also walks the empty tree block). One input set (no rotation past the L2: a ratio, not a
    roofline); errors against the reference."""
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(1)
    for ci, case in enumerate(attention_cases()):
        s, t, h, p = case["streams"], case["nodes"], case["heads"], case["prefix"]
        rows = t * h
        if rows % mgpu_attn.BLOCK_Q:
            continue
        if time.time() > deadline:
            results.append(dict(case, skipped="time budget"))
            continue
        q_lat, q_rope, c_kv, k_rope, prefix_len, _ = attention_inputs(jax.random.key(5000 + ci), case, rng)
        visible = jnp.zeros((s, t, t), bool)
        pad = ((0, 0), (0, -(p + t) % mgpu_attn.BLOCK_KV), (0, 0))   # cache rows to whole blocks (never attended)
        splits = attn.default_config(s, rows, p + t).num_splits
        args = {"triton": (q_lat, q_rope, c_kv, k_rope, prefix_len, visible),
                "mgpu": (q_lat.reshape(s, rows, -1), q_rope.reshape(s, rows, -1), jnp.pad(c_kv, pad),
                         jnp.pad(k_rope, pad), prefix_len)}
        fns = {"triton": jax.jit(lambda *a: attn.tree_verify_attention(*a, scale=K26_SCALE, interpret=interpret)),
               "mgpu": jax.jit(lambda *a: mgpu_attn.merge_partials(*mgpu_attn.prefix_attention_partials(
                   *a, scale=K26_SCALE, num_splits=splits, interpret=interpret)))}
        ref = attn.tree_verify_attention_reference(*args["triton"], scale=K26_SCALE).reshape(s, rows, -1)
        entry, jobs = dict(case, splits=splits, errors={}, failed={}), []
        for name, fn in fns.items():
            try:
                entry["errors"][name] = rel_err(fn(*args[name]).reshape(s, rows, -1), ref)
                jobs.append(Job(name, fn, [args[name]]))
            except Exception as e:  # noqa: BLE001 - a kernel that does not compile is a result
                entry["failed"][name] = f"{type(e).__name__}: {str(e)[:2000]}"
        times = time_jobs(jobs, F.reps) if jobs else {}
        flops, bytes_ = attention_cost(case)
        floor = roofline(flops, bytes_, ceil)
        entry.update({f"{name}_us": times[name]["us"] for name in times},
                     **{f"{name}_roofline_fraction": floor / times[name]["us"] for name in times}, timings=times)
        if "triton_us" in entry and "mgpu_us" in entry:
            entry["mgpu_speedup"] = entry["triton_us"] / entry["mgpu_us"]
        results.append(entry)
        print(f"mgpu attention S={s} H={h:2d} N={p:6d} T={t:3d} splits {splits:3d} | triton "
              f"{entry.get('triton_us', float('nan')):8.1f} us | mgpu {entry.get('mgpu_us', float('nan')):8.1f} us "
              f"| x {entry.get('mgpu_speedup', float('nan')):5.2f} | errors {entry['errors']} | failed "
              f"{sorted(entry['failed'])}", flush=True)
        _dump()


# ---------------------------------------------------------------------------------------------------- int4 moe
def moe_shapes():
    if F.quick:
        return dict(experts=16, hidden=512, inter=256, top_k=4), (1, 8, 64)
    return dict(experts=384, hidden=7168, inter=2048, top_k=8), (1, 8, 64, 256, 1024, 4096)


def moe_sweep(m: int, n_pairs: int, num_experts: int) -> list[moe.MoeConfig]:
    if "moe" not in F.sweep or F.quick or str(m) not in F.moe_sweep_tokens:
        return []
    base = moe.default_config(n_pairs, num_experts)
    if base.block_m == 16:
        variants = [dict(block_n=128), dict(block_n=32), dict(block_n=32, num_warps=2), dict(block_n=16, num_warps=2),
                    dict(num_stages=3), dict(num_stages=5), dict(num_warps=8)] + [
            dict(block_m=bm, use_mma=False) for bm in (1, 2, 4)]
    else:
        variants = [dict(block_m=128), dict(block_m=32, block_n=128, num_warps=4), dict(block_n=64, num_warps=4)]
    return [dataclasses.replace(base, **v) for v in variants]


@jax.jit
def _random_experts(key):
    """Random INT4 experts at the configured shape, in the compressed-tensors layout, repacked for the kernel."""
    shape, _ = moe_shapes()
    e, d, i = shape["experts"], shape["hidden"], shape["inter"]
    ks = jax.random.split(key, 6)
    words = lambda k, o, n: lax.bitcast_convert_type(jax.random.bits(k, (e, o, n // 8), jnp.uint32), jnp.int32)
    scales = lambda k, o, n: (jax.random.uniform(k, (e, o, n // moe.GROUP), minval=0.5, maxval=1.5)
                              * (0.7 / math.sqrt(n))).astype(BF16)
    return moe.Int4Experts.from_compressed_tensors(words(ks[0], i, d), scales(ks[1], i, d), words(ks[2], i, d),
                                                   scales(ks[3], i, d), words(ks[4], d, i), scales(ks[5], d, i))


@jax.jit
def _bf16_weights(experts: moe.Int4Experts):
    """Dequantized bf16 weights for the XLA baselines, one expert at a time: gate_up [E, D, 2I], down [E, I, D]."""
    d, i = experts.hidden_size, experts.intermediate_size

    def one(args):
        gp, gs, up, us, dp, ds = (a[None] for a in args)
        gate = moe.dequantize_kernel_layout(gp, gs, d)[0]
        upw = moe.dequantize_kernel_layout(up, us, d)[0]
        down = moe.dequantize_kernel_layout(dp, ds, i)[0]
        return jnp.concatenate([gate, upw], axis=0).T.astype(BF16), down.T.astype(BF16)
    return lax.map(one, tuple(experts))


def ragged_dot_moe(x, gate_up, down, ids, weights):
    """XLA baseline: sort pairs by expert, two lax.ragged_dot over bf16 weights, unsort and sum."""
    m, k = ids.shape
    e = gate_up.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat)
    xs = x[order // k]
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    gu = lax.ragged_dot(xs, gate_up, sizes, preferred_element_type=jnp.float32)
    g, u = jnp.split(gu, 2, axis=1)
    y = lax.ragged_dot((jax.nn.silu(g) * u).astype(x.dtype), down, sizes, preferred_element_type=jnp.float32)
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros((m, x.shape[1]), jnp.float32).at[order // k].add(y).astype(x.dtype)


def gather_einsum_moe(x, gate_up, down, ids, weights):
    """XLA baseline: per slot, gather the tokens' bf16 experts and einsum."""
    out = jnp.zeros(x.shape, jnp.float32)
    for j in range(ids.shape[1]):
        gu = jnp.einsum("md,mdn->mn", x, gate_up[ids[:, j]], preferred_element_type=jnp.float32)
        g, u = jnp.split(gu, 2, axis=1)
        y = jnp.einsum("mi,mid->md", (jax.nn.silu(g) * u).astype(x.dtype), down[ids[:, j]],
                       preferred_element_type=jnp.float32)
        out = out + weights[:, j:j + 1] * y
    return out.astype(x.dtype)


def moe_routing(key, m, num_experts, top_k):
    """Distinct top-k experts per token (random scores), normalised weights."""
    k1, k2 = jax.random.split(key)
    ids = jnp.argsort(jax.random.uniform(k1, (m, num_experts)), axis=1)[:, :top_k].astype(jnp.int32)
    w = jax.random.uniform(k2, (m, top_k), minval=0.1, maxval=1.0)
    return ids, w / w.sum(1, keepdims=True)


def moe_cost(ids: np.ndarray, shape: dict) -> tuple[float, float, int]:
    """(FLOPs, bytes of the touched experts + x + out, touched experts) of one call."""
    d, i = shape["hidden"], shape["inter"]
    touched = len(np.unique(ids))
    weight_bytes = 3 * d * i * (0.5 + 2 / moe.GROUP)
    return 2.0 * ids.size * 3 * d * i, touched * weight_bytes + 2 * 2.0 * ids.shape[0] * d, touched


def run_moe(ceil, results, checks, deadline):
    interpret = jax.default_backend() != "gpu"
    shape, token_counts = moe_shapes()
    e, d, k = shape["experts"], shape["hidden"], shape["top_k"]
    experts = _random_experts(jax.random.key(3))
    gate_up_bf16 = down_bf16 = None
    for m in token_counts:
        if time.time() > deadline:
            results.append(dict(tokens=m, skipped="time budget"))
            continue
        try:
            sets = []
            for s in range(4):
                ids, w = moe_routing(jax.random.key(100 * m + s), m, e, k)
                sets.append((jax.random.normal(jax.random.key(7 + s), (m, d), BF16), experts, ids, w))
            fns = {"kernel": jax.jit(lambda *a: moe.int4_moe(*a, interpret=interpret))}
            for cfg in moe_sweep(m, m * k, e):
                fns[f"kernel:{cfg}"] = jax.jit(lambda *a, cfg=cfg: moe.int4_moe(*a, config=cfg, interpret=interpret))
            ref_fn = jax.jit(moe.int4_moe_reference)
            x0, _, ids0, w0 = sets[0]
            sub = min(m, 32)
            ref = ref_fn(x0[:sub], experts, ids0[:sub], w0[:sub]).astype(jnp.float32)
            errors, failed = try_candidates(fns, lambda fn: fn(*sets[0])[:sub].astype(jnp.float32), ref)
            jobs = [Job(name, fn, sets) for name, fn in fns.items()]
            if m <= 64:
                jobs.append(Job("reference_int4", ref_fn, sets))
            if m <= 256 and not interpret:
                if gate_up_bf16 is None:
                    gate_up_bf16, down_bf16 = _bf16_weights(experts)
                bf16_sets = [(x, gate_up_bf16, down_bf16, ids, w) for x, _, ids, w in sets]
                jobs.append(Job("xla_ragged_dot_bf16", jax.jit(ragged_dot_moe), bf16_sets))
                if m <= 64:
                    jobs.append(Job("xla_gather_einsum_bf16", jax.jit(gather_einsum_moe), bf16_sets))
            t = time_jobs(jobs, F.reps)
            flops, bytes_, touched = moe_cost(np.asarray(ids0), shape)
            floor = roofline(flops, bytes_, ceil)
            k_us = t["kernel"]["us"]
            best = min(fns, key=lambda n: t[n]["us"])
            baselines = {n: t[n]["us"] for n in t if n.startswith("xla_") or n.startswith("reference")}
            bf16 = [t[n]["us"] for n in t if n.startswith("xla_")]
            entry = dict(tokens=m, **shape, config=str(moe.default_config(m * k, e)), touched_experts=touched,
                         kernel_us=k_us, baselines_us=baselines,
                         speedup_vs_best_xla_bf16=(min(bf16) / k_us) if bf16 else None,
                         touched_GBps=bytes_ / (k_us * 1e-6) / 1e9,
                         bandwidth_fraction=bytes_ / (k_us * 1e-6) / 1e9 / ceil["bandwidth_GBps"],
                         TFLOPs=flops / (k_us * 1e-6) / 1e12,
                         matmul_fraction=flops / (k_us * 1e-6) / 1e12 / ceil["matmul_TFLOPs"],
                         roofline_us=floor, roofline_fraction=floor / k_us,
                         rel_err_bf16_first_tokens=errors["kernel"], checked_tokens=sub,
                         best_config=best, best_us=t[best]["us"],
                         sweep={n: dict(us=t[n]["us"], rel_err=errors[n]) for n in fns if n != "kernel"},
                         sweep_failed=failed, timing_method=t["kernel"]["method"], timings=t)
        except Exception as ex:  # noqa: BLE001 - record the failure and go on with the other cases
            entry = dict(tokens=m, error=f"{type(ex).__name__}: {str(ex)[:2000]}")
        results.append(entry)
        _print_moe_row(entry)
        _dump()
    del gate_up_bf16, down_bf16
    try:
        checks["int4_moe_f32_16_tokens"] = _moe_f32_check(experts, shape, interpret)
    except Exception as e:  # noqa: BLE001 - a failed check is a result
        checks["int4_moe_f32_16_tokens"] = f"{type(e).__name__}: {str(e)[:2000]}"


def _moe_f32_check(experts, shape, interpret) -> float:
    """f32 activations (IEEE dots): kernel vs reference at the full expert shape, 16 tokens, two ids off-device."""
    ids, w = moe_routing(jax.random.key(11), 16, shape["experts"], shape["top_k"])
    ids = ids.at[0, 0].set(-1).at[1, 1].set(shape["experts"])          # other devices' experts contribute 0
    x = jax.random.normal(jax.random.key(12), (16, shape["hidden"]), jnp.float32)
    return rel_err(moe.int4_moe(x, experts, ids, w, interpret=interpret), moe.int4_moe_reference(x, experts, ids, w))


# -------------------------------------------------------------------------------------------------------- tree
TREE_BLOCK = 16             # L: the root plus D = L - 1 drafted depths
DRAFT_LOGIT_SCALE = 4.0     # random draft logits N(0, 4^2): a few tokens carry most of each depth's mass
ACCEPT_FOLLOW = 0.8         # chance that the target's token at a node is one of the node's children's


def tree_shapes() -> tuple[dict, tuple[int, ...]]:
    """(streams, depth, vocab) and the budgets B."""
    if F.quick:
        return dict(streams=4, depth=TREE_BLOCK - 1, vocab=1000), (7, 40)
    return dict(streams=16, depth=TREE_BLOCK - 1, vocab=163840), (16, 64, 256, 512)


def same_arrays(got, want) -> bool:
    """Every field bit-identical, same shapes and dtypes (NamedTuples of arrays)."""
    return all(np.asarray(g).shape == np.asarray(w).shape and np.asarray(g).dtype == np.asarray(w).dtype
               and np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))


def walk_targets(rng: np.random.Generator, tree: TreeArrays, vocab: int) -> np.ndarray:
    """target_tokens [S, B+1] for an accept walk: at each node, with probability ACCEPT_FOLLOW the token of one of its
    children (picked at random), else a random token."""
    parent, tokens = np.asarray(tree.parent), np.asarray(tree.tokens)
    out = rng.integers(0, vocab, size=parent.shape).astype(np.int32)
    for s in range(parent.shape[0]):
        for node in range(parent.shape[1]):
            children = np.flatnonzero(parent[s] == node)
            if children.size and rng.random() < ACCEPT_FOLLOW:
                out[s, node] = tokens[s, rng.choice(children)]
    return out


def _ops_tree_build(implementation: str, budget: int, example):
    """ops.tree_build(logits, root, budget) compiled with the kernel or the reference (ops reads the choice when
    tracing)."""
    with ops.implementation(implementation):
        return jax.jit(lambda logits, root: ops.tree_build(logits, root, budget)).lower(*example).compile()


def time_heap_peer(topk_fn, logit_sets, budget: int, reps: int) -> tuple[dict, list[TreeArrays]]:
    """The CPU heap per request, as the paper's code and SGLang's port do it: device top-K -> copy to the host ->
    python heapq, one stream after the other -> copy the tree arrays back to the device. Wall clock (perf_counter)
    per stage, median over reps after one warm-up pass over the sets. Returns ({stage or "total": us}, the host
    trees of each set)."""
    stages: dict[str, list[float]] = {name: [] for name in ("topk", "d2h", "heap", "h2d", "total")}
    trees: list = [None] * len(logit_sets)
    for r in range(reps + len(logit_sets)):
        i = r % len(logit_sets)
        logits, root = logit_sets[i]
        t0 = time.perf_counter()
        top = jax.block_until_ready(topk_fn(logits))
        t1 = time.perf_counter()
        (top_logprobs, top_ids), root_host = jax.device_get((top, root))
        t2 = time.perf_counter()
        tree = build_tree_heapq_from_topk(top_logprobs, top_ids, root_host, budget)
        t3 = time.perf_counter()
        jax.block_until_ready(jax.device_put(tree))
        t4 = time.perf_counter()
        if r < len(logit_sets):
            trees[i] = tree
            continue
        for name, us in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            stages[name].append(us * 1e6)
    return {name: float(np.median(v)) for name, v in stages.items()}, trees


def wall_us(fn, arg_sets, reps: int) -> float:
    """Median wall clock of fn(*args), waited for, outside any profiler: the host's view of a call, as for the peer."""
    times = []
    for r in range(reps):
        args = arg_sets[r % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(times))


def tree_case(shape: dict, budget: int, logit_sets, rng: np.random.Generator, interpret: bool) -> dict:
    """Build (kernel, reference, heap peer) and accept (kernel, reference) at one budget; bit-identity checks."""
    depth, vocab = shape["depth"], shape["vocab"]
    k = resolve_topk(budget, vocab)
    topk_fn = jax.jit(lambda logits: draft_topk(logits, k))
    topk_sets = [(*topk_fn(logits), root) for logits, root in logit_sets]
    peer, specs = time_heap_peer(topk_fn, logit_sets, budget, F.reps)
    builds = {"kernel_from_topk": jax.jit(functools.partial(tbuild.tree_build_from_topk, budget=budget,
                                                            interpret=interpret)),
              "reference_from_topk": jax.jit(functools.partial(build_tree_from_topk, budget=budget)),
              "kernel_from_logits": _ops_tree_build("kernel", budget, logit_sets[0]),
              "reference_from_logits": _ops_tree_build("reference", budget, logit_sets[0])}
    identical = {name: all(same_arrays(fn(*args), spec)
                           for args, spec in zip(topk_sets if name.endswith("topk") else logit_sets, specs))
                 for name, fn in builds.items()}
    accept_sets = [(TreeArrays(*map(jnp.asarray, spec)), jnp.asarray(walk_targets(rng, spec, vocab))) for spec in specs]
    walks = [accept_tree_python(spec, target, depth) for spec, (_, target) in zip(specs, accept_sets)]
    accepts = {"accept_kernel": jax.jit(functools.partial(taccept.tree_accept, max_depth=depth, interpret=interpret)),
               "accept_reference": jax.jit(functools.partial(accept_tree, max_depth=depth))}
    accept_identical = {name: all(same_arrays(fn(*args), walk) for args, walk in zip(accept_sets, walks))
                        for name, fn in accepts.items()}
    jobs = [Job(name, fn, topk_sets if name.endswith("topk") else logit_sets) for name, fn in builds.items()]
    full_sort_fn = jax.jit(lambda logits: draft_topk(logits, k, chunk=0))
    topk_identical = all(same_arrays(topk_fn(logits), full_sort_fn(logits)) for logits, _ in logit_sets)
    jobs += [Job("topk", topk_fn, [(logits,) for logits, _ in logit_sets]),
             Job("topk_full_sort", full_sort_fn, [(logits,) for logits, _ in logit_sets])]
    jobs += [Job(name, fn, accept_sets) for name, fn in accepts.items()]
    t = time_jobs(jobs, F.reps)
    kernel_us, end_to_end_wall = t["kernel_from_topk"]["us"], wall_us(builds["kernel_from_logits"], logit_sets, F.reps)
    peer_after_topk = peer["d2h"] + peer["heap"] + peer["h2d"]
    build_kernel = [us for name, us in t["kernel_from_topk"].get("kernels_us", {}).items() if "tree_build" in name]
    return dict(shape, budget=budget, topk=k, input_sets=len(logit_sets),
                identical=identical["kernel_from_topk"] and identical["kernel_from_logits"],
                identical_detail=identical, accept_identical=all(accept_identical.values()),
                accept_identical_detail=accept_identical,
                mean_accepted=float(np.mean([w.num_accepted for w in walks])),
                kernel_from_topk_us=kernel_us, build_kernel_us=build_kernel[0] if build_kernel else None,
                reference_from_topk_us=t["reference_from_topk"]["us"],
                kernel_from_logits_us=t["kernel_from_logits"]["us"],
                reference_from_logits_us=t["reference_from_logits"]["us"], topk_us=t["topk"]["us"],
                topk_full_sort_us=t["topk_full_sort"]["us"], topk_identical_to_full_sort=topk_identical,
                accept_kernel_us=t["accept_kernel"]["us"], accept_reference_us=t["accept_reference"]["us"],
                peer_us=peer["total"], peer_stages_us=peer, peer_after_topk_us=peer_after_topk,
                peer_over_kernel=peer_after_topk / kernel_us, meets_50x=peer_after_topk / kernel_us >= 50,
                kernel_from_logits_wall_us=end_to_end_wall, peer_over_kernel_end_to_end=peer["total"] / end_to_end_wall,
                reference_over_kernel=t["reference_from_topk"]["us"] / kernel_us,
                timing_method=t["kernel_from_topk"]["method"], timings=t)


def run_tree(results, checks, deadline):
    interpret = jax.default_backend() != "gpu"
    shape, budgets = tree_shapes()
    s, d, v = shape["streams"], shape["depth"], shape["vocab"]
    n_sets = int(min(8, max(2, math.ceil(ROTATE_BYTES / (4.0 * s * d * v)))))
    rng = np.random.default_rng(5)
    logit_sets = [(jax.random.normal(jax.random.key(500 + i), (s, d, v)) * DRAFT_LOGIT_SCALE,
                   jnp.asarray(rng.integers(0, v, s), jnp.int32)) for i in range(n_sets)]
    for budget in budgets:
        if time.time() > deadline:
            results.append(dict(shape, budget=budget, skipped="time budget"))
            continue
        try:
            entry = tree_case(shape, budget, logit_sets, rng, interpret)
        except Exception as e:  # noqa: BLE001 - record the failure and go on with the other cases
            entry = dict(shape, budget=budget, error=f"{type(e).__name__}: {str(e)[:2000]}")
        results.append(entry)
        _print_tree_row(entry)
        _dump()
    done = [r for r in results if "identical" in r]
    checks["tree_identical"] = bool(done) and all(r["identical"] and r["accept_identical"]
                                                  and r["topk_identical_to_full_sort"] for r in done)


# ------------------------------------------------------------------------------------------------------ output
RESULTS: dict = {}


def _dump():
    os.makedirs(os.path.dirname(os.path.abspath(F.out)), exist_ok=True)
    with open(F.out, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def _print_attention_row(r):
    if "error" in r or "skipped" in r:
        print(f"attention S={r['streams']} H={r['heads']} N={r['prefix']} T={r['nodes']}: "
              f"{r.get('error') or r.get('skipped')}", flush=True)
        return
    print(f"attention S={r['streams']:2d} H={r['heads']:2d} N={r['prefix']:6d} T={r['nodes']:3d} | kernel "
          f"{r['kernel_us']:9.1f} us  ref {r['reference_us']:9.1f} us  x{r['speedup_vs_reference']:5.2f} | "
          f"{r['GBps']:6.0f} GB/s {r['TFLOPs']:6.1f} TF/s roof {r['roofline_fraction']:5.1%} | best "
          f"{r['best_us']:9.1f} ({r['best_roofline_fraction']:5.1%}) | err {r['rel_err_bf16']:.1e}", flush=True)


def _print_moe_row(r):
    if "error" in r or "skipped" in r:
        print(f"int4_moe M={r['tokens']}: {r.get('error') or r.get('skipped')}", flush=True)
        return
    base = " ".join(f"{k}={v:.1f}" for k, v in r["baselines_us"].items())
    print(f"int4_moe M={r['tokens']:5d} experts {r['touched_experts']:3d} | kernel {r['kernel_us']:9.1f} us | "
          f"{r['touched_GBps']:6.0f} GB/s ({r['bandwidth_fraction']:5.1%}) {r['TFLOPs']:6.1f} TF/s "
          f"({r['matmul_fraction']:5.1%}) | best {r['best_us']:9.1f} | {base} | err "
          f"{r['rel_err_bf16_first_tokens']:.1e}", flush=True)


def _print_tree_row(r):
    if "error" in r or "skipped" in r:
        print(f"tree S={r['streams']} B={r['budget']}: {r.get('error') or r.get('skipped')}", flush=True)
        return
    print(f"tree S={r['streams']:2d} D={r['depth']} V={r['vocab']} B={r['budget']:4d} | kernel "
          f"{r['kernel_from_topk_us']:8.1f} us (ref {r['reference_from_topk_us']:9.1f}) | from logits "
          f"{r['kernel_from_logits_us']:8.1f} (top-K {r['topk_us']:8.1f} vs full sort {r['topk_full_sort_us']:8.1f}, "
          f"ref {r['reference_from_logits_us']:9.1f}) | heap peer {r['peer_us']:9.1f} = top-K "
          f"{r['peer_stages_us']['topk']:.1f} + d2h {r['peer_stages_us']['d2h']:.1f} + heap "
          f"{r['peer_stages_us']['heap']:.1f} + h2d {r['peer_stages_us']['h2d']:.1f} | peer/kernel "
          f"{r['peer_over_kernel']:6.1f}x (end to end {r['peer_over_kernel_end_to_end']:5.1f}x) | accept "
          f"{r['accept_kernel_us']:.1f} (ref {r['accept_reference_us']:.1f}) | identical {r['identical']} "
          f"accept {r['accept_identical']}", flush=True)


def main(_):
    start = time.time()
    for flag, allowed in (("sections", ("ceilings", "attention", "moe", "tree", "mgpu")),
                          ("sweep", ("attention", "moe"))):
        unknown = set(getattr(F, flag)) - set(allowed)
        if unknown:
            raise app.UsageError(f"--{flag}: unknown {sorted(unknown)}; choose from {list(allowed)} ('' for none)")
    dev = jax.devices()[0]
    RESULTS.update(meta=dict(jax=jax.__version__, backend=jax.default_backend(), device=dev.device_kind,
                             host=platform.node(), date=time.strftime("%Y-%m-%d %H:%M:%S"), reps=F.reps,
                             quick=F.quick, sweep=F.sweep, attention_splits=F.attention_splits,
                             moe_sweep_tokens=F.moe_sweep_tokens), ceilings={}, checks={}, attention=[],
                   attention_mgpu=[], int4_moe=[], tree=[])
    if "ceilings" in F.sections:
        RESULTS["ceilings"] = measure_ceilings(F.reps)
    else:   # H200_FACTS.md leads, used only when the ceilings are not measured
        RESULTS["ceilings"] = dict(bandwidth_GBps=4300.0, matmul_TFLOPs=780.0, bandwidth_method="assumed")
    ceil = RESULTS["ceilings"]
    print(f"ceilings: {ceil['bandwidth_GBps']:.0f} GB/s ({ceil['bandwidth_method']}), "
          f"{ceil['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    _dump()
    if "attention" in F.sections:
        try:
            RESULTS["checks"]["attention_f32"] = attention_f32_check()
        except Exception as e:  # noqa: BLE001 - a failed check is a result; the benchmark goes on
            RESULTS["checks"]["attention_f32"] = f"{type(e).__name__}: {str(e)[:2000]}"
        print("attention f32 check:", RESULTS["checks"]["attention_f32"], flush=True)
        run_attention(ceil, RESULTS["attention"], time.time() + F.attention_budget_s)
    if "mgpu" in F.sections:
        run_attention_mgpu(ceil, RESULTS["attention_mgpu"], time.time() + F.attention_budget_s)
    if "moe" in F.sections:
        run_moe(ceil, RESULTS["int4_moe"], RESULTS["checks"], time.time() + F.moe_budget_s)
        print("int4_moe f32 check:", RESULTS["checks"].get("int4_moe_f32_16_tokens"), flush=True)
    if "tree" in F.sections:
        run_tree(RESULTS["tree"], RESULTS["checks"], time.time() + F.tree_budget_s)
        print("tree kernels identical to the heapq spec and the python accept walk:",
              RESULTS["checks"]["tree_identical"], flush=True)
    RESULTS["meta"]["wall_s"] = time.time() - start
    _dump()
    print(f"wrote {F.out} in {time.time() - start:.0f} s", flush=True)
    if F.plot:
        plot_results(RESULTS, os.path.splitext(F.out)[0] + ".png")


def plot_results(results: dict, path: str) -> None:
    """One panel per measured section: attention (fraction of roofline and speedup over XLA per case), int4_moe
    (kernel vs the XLA bf16 baselines per M) and tree (build paths vs the heap peer per B)."""
    plt = plots.pyplot()
    sections = [name for name in ("attention", "int4_moe", "tree")
                if any("kernel_us" in r or "kernel_from_topk_us" in r for r in results.get(name, []))]
    if not sections:
        return
    fig, axes = plt.subplots(1, len(sections), figsize=(6 * len(sections), 4.2), squeeze=False)
    for ax, name in zip(axes[0], sections):
        rows = [r for r in results[name] if "kernel_us" in r or "kernel_from_topk_us" in r]
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
    app.run(main)
