"""Check and time the Pallas kernels against their XLA references and baselines at K2.6 shapes (GPU).

    PYTHONPATH=. python3 experiments/bench_kernels.py --out=experiments/results/kernels.json
    PYTHONPATH=. python3 experiments/bench_kernels.py --quick      # small shapes, interpret mode: a CPU smoke run

Every timing is device time: the span of the GPU events of one call, read from a JAX profiler trace (the call runs
inside a TraceAnnotation and is waited for), median over --reps calls after a warm-up, with inputs rotated over
enough sets to exceed the L2 cache. Ceilings are measured in the same run: the best of a plain copy and an
elementwise pass for bandwidth (bytes read + written), an 8192^3 bf16 matmul for FLOP/s.
"""
from __future__ import annotations

import dataclasses
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

from pallas_kernels import int4_moe as moe
from pallas_kernels import tree_verify_attention as attn
from kdtree_jax.tree import random_tree_visible

flags.DEFINE_string("out", "experiments/results/kernels.json", "where the JSON results go")
flags.DEFINE_list("sections", ["ceilings", "attention", "moe"], "which parts to run")
flags.DEFINE_integer("reps", 15, "timed calls per measurement (median reported)")
flags.DEFINE_bool("sweep", True, "also time alternative tilings on the representative cases")
flags.DEFINE_float("attention_budget_s", 240.0, "start no new attention case past this many seconds of the section")
flags.DEFINE_float("moe_budget_s", 200.0, "start no new int4_moe case past this many seconds of the section")
flags.DEFINE_bool("quick", False, "small shapes in interpret mode, to smoke-test the script on a CPU")
F = flags.FLAGS

L2_BYTES = 60e6          # H200 L2; input sets are rotated so that one pass over them exceeds it several times
ROTATE_BYTES = 200e6
GAP_S = 0.002            # host pause between timed calls, so calls never overlap on the device
BF16 = jnp.bfloat16


# ----------------------------------------------------------------------------------------------------- timing
def _annotation_spans(trace_dir: str) -> tuple[dict[str, list[float]], dict[str, dict[str, list[float]]]]:
    """From the trace in trace_dir: ({job: [device span in us of each call]},
    {job: {GPU kernel name: [its total us in each call]}})."""
    from jax.profiler import ProfileData
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {}, {}
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
    spans: dict[str, list[float]] = {}
    kernels: dict[str, dict[str, list[float]]] = {}
    for name, lo, hi in windows:
        i0, i1 = np.searchsorted(starts, lo), np.searchsorted(starts, hi)
        inside = [d for d in device[i0:i1] if d[1] <= hi]
        if inside:
            job = name.split("|")[1]
            spans.setdefault(job, []).append((max(d[1] for d in inside) - inside[0][0]) / 1e3)
            per_call: dict[str, float] = {}
            for d in inside:
                per_call[d[2]] = per_call.get(d[2], 0.0) + (d[1] - d[0]) / 1e3
            for kernel, us in per_call.items():
                kernels.setdefault(job, {}).setdefault(kernel[:80], []).append(us)
    return spans, kernels


@dataclasses.dataclass
class Job:
    name: str
    fn: object          # jitted callable
    arg_sets: list      # list of argument tuples, rotated


def time_jobs(jobs: list[Job], reps: int) -> dict[str, dict]:
    """Warm up every job, then time them all in one profiler session. Returns {name: timing dict}."""
    for job in jobs:
        for args in job.arg_sets[:2]:
            jax.block_until_ready(job.fn(*args))
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
                args = job.arg_sets[r % len(job.arg_sets)]
                time.sleep(GAP_S)
                with jax.profiler.TraceAnnotation(f"bench|{job.name}|{r}"):
                    t0 = time.perf_counter()
                    jax.block_until_ready(job.fn(*args))
                    wall[job.name].append((time.perf_counter() - t0) * 1e6)
    finally:
        if traced:
            jax.profiler.stop_trace()
    spans, kernels = _annotation_spans(trace_dir) if traced else ({}, {})
    out = {}
    for job in jobs:
        dev = spans.get(job.name, [])
        entry = {"wall_us": float(np.median(wall[job.name]))}
        if len(dev) >= reps // 2:
            busy = {k: float(np.median(v)) for k, v in kernels.get(job.name, {}).items()}
            top = sorted(busy.items(), key=lambda kv: -kv[1])[:8]
            entry.update(us=float(np.median(dev)), method="device", device_spread_us=float(np.std(dev)),
                         kernels_us=dict(top), kernel_launches=len(busy))
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


def attention_cases():
    if F.quick:
        return [dict(streams=1, heads=8, prefix=256, nodes=t) for t in (1, 16)] + [
            dict(streams=2, heads=4, prefix=128, nodes=5)]
    cases = [dict(streams=1, heads=h, prefix=p, nodes=t) for h in (8, 64) for p in (4096, 32768)
             for t in (1, 16, 64, 256)]
    return cases + [dict(streams=8, heads=8, prefix=32768, nodes=64)]


def attention_sweep(case) -> list[attn.AttentionConfig]:
    """Alternative tilings, tried on four prefix-32768 cases when --sweep."""
    if (not F.sweep or F.quick or case["prefix"] != 32768 or case["streams"] > 1
            or (case["heads"], case["nodes"]) not in ((8, 1), (8, 16), (64, 16), (64, 256))):
        return []
    rows = case["nodes"] * case["heads"]
    base = attn.default_config(case["streams"], rows, case["prefix"] + case["nodes"])
    fewer, more = dict(num_splits=max(1, base.num_splits // 2)), dict(num_splits=2 * base.num_splits)
    if rows <= 16:
        variants = [dict(block_k=128), dict(block_k=32, num_stages=3), more]
    else:
        variants = [dict(block_k=32), dict(block_q=32, num_warps=4), dict(block_q=32, block_k=32, num_stages=3), fewer]
    return [dataclasses.replace(base, **v) for v in variants]




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
    scale = (192 ** -0.5)
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
                    lambda *a, cfg=cfg: attn.tree_verify_attention(*a, scale=scale, config=cfg, interpret=interpret))
            ref_fn = jax.jit(lambda *a: attn.tree_verify_attention_reference(*a, scale=scale))
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


# ---------------------------------------------------------------------------------------------------- int4 moe
def moe_shapes():
    if F.quick:
        return dict(experts=16, hidden=512, inter=256, top_k=4), (1, 8, 64)
    return dict(experts=384, hidden=7168, inter=2048, top_k=8), (1, 8, 64, 256, 1024, 4096)


def moe_sweep(m: int, n_pairs: int, num_experts: int) -> list[moe.MoeConfig]:
    if not F.sweep or F.quick or m not in (1, 4096):
        return []
    base = moe.default_config(n_pairs, num_experts)
    if base.block_m == 16:
        variants = [dict(block_n=128), dict(block_n=32), dict(num_stages=4)]
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


def main(_):
    start = time.time()
    dev = jax.devices()[0]
    RESULTS.update(meta=dict(jax=jax.__version__, backend=jax.default_backend(), device=dev.device_kind,
                             host=platform.node(), date=time.strftime("%Y-%m-%d %H:%M:%S"), reps=F.reps,
                             quick=F.quick), ceilings={}, checks={}, attention=[], int4_moe=[])
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
    if "moe" in F.sections:
        run_moe(ceil, RESULTS["int4_moe"], RESULTS["checks"], time.time() + F.moe_budget_s)
        print("int4_moe f32 check:", RESULTS["checks"].get("int4_moe_f32_16_tokens"), flush=True)
    RESULTS["meta"]["wall_s"] = time.time() - start
    _dump()
    print(f"wrote {F.out} in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    app.run(main)
