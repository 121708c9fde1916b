"""Device time of jitted calls, for every benchmark script: profiler-trace timing, wall clock, the machine's ceilings.

Every timing of `time_jobs` is device time: the span of the GPU events of one call, read from a JAX profiler trace
(the call runs inside a TraceAnnotation and is waited for), median over `reps` calls after a warm-up, with inputs
rotated over enough sets to exceed the L2 cache (ROTATE_BYTES). Where there is no device trace (the CPU) it is the
wall clock. Ceilings are measured in the same run: the best of a plain copy and an elementwise pass for bandwidth
(bytes read + written), an 8192^3 bf16 matmul for FLOP/s.
"""
from __future__ import annotations

import dataclasses
import glob
import math
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

ROTATE_BYTES = 200e6     # bytes of the input sets rotated over: several times the H200's 60 MB L2
GAP_S = 0.002            # host pause between timed calls, so calls never overlap on the device
BACK_TO_BACK = 8         # calls of the op in one jitted function where a section also times a steady state
                         # (`back_to_back_job`: one dispatch, the kernels enqueued one after another, as in a step)
BF16 = jnp.bfloat16


def rotation_sets(set_bytes: float, most: int) -> int:
    """How many input sets of set_bytes each to rotate over so that they pass ROTATE_BYTES (the L2 cannot hold
    them): at least 2, at most `most`."""
    return int(min(most, max(2, math.ceil(ROTATE_BYTES / set_bytes))))


@dataclasses.dataclass
class Call:
    """The device side of one timed call, from the profiler trace."""
    span_us: float                  # first event start to last event end
    events_us: dict[str, float]     # total us per GPU event name (kernels and copies)
    events: int                     # device events (kernel launches + copies)
    d2h_copies: int                 # device-to-host copies (e.g. a while loop's predicate, once per iteration)
    timeline: list                  # [line, name, start_us, duration_us] of every host and device event in the
                                    # call's window, times from the window's start (sorted by start)
    window_us: float                # the host annotation's length (the call as the host saw it)


def annotation_calls(trace_dir: str, prefix: str = "bench|") -> dict[str, list[Call]]:
    """From the trace in trace_dir: {job: [Call of each timed call]}, the calls being the host annotations named
    `<prefix><job>|<rep>`."""
    from jax.profiler import ProfileData
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        return {}
    data = ProfileData.from_file(sorted(files)[-1])
    windows, device, host = [], [], []
    for plane in data.planes:
        is_device = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            for ev in line.events:
                if is_device and ev.duration_ns > 0:
                    device.append((ev.start_ns, ev.start_ns + ev.duration_ns, ev.name))
                elif not is_device and ev.name.startswith(prefix):
                    windows.append((ev.name, ev.start_ns, ev.start_ns + ev.duration_ns))
                elif not is_device:
                    host.append((ev.start_ns, ev.start_ns + ev.duration_ns, ev.name, f"{plane.name}/{line.name}"))
    device.sort()
    host.sort()
    starts = np.array([d[0] for d in device])
    host_starts = np.array([h[0] for h in host])
    calls: dict[str, list[Call]] = {}
    for name, lo, hi in windows:
        i0, i1 = np.searchsorted(starts, lo), np.searchsorted(starts, hi)
        inside = [d for d in device[i0:i1] if d[1] <= hi]
        if inside:
            per_event: dict[str, float] = {}
            for d in inside:
                per_event[d[2][:80]] = per_event.get(d[2][:80], 0.0) + (d[1] - d[0]) / 1e3
            host_inside = host[np.searchsorted(host_starts, lo):np.searchsorted(host_starts, hi)]
            timeline = sorted([["device", d[2][:120], (d[0] - lo) / 1e3, (d[1] - d[0]) / 1e3] for d in inside]
                              + [[h[3], h[2][:120], (h[0] - lo) / 1e3, (h[1] - h[0]) / 1e3] for h in host_inside],
                              key=lambda e: e[2])
            calls.setdefault(name.split("|")[1], []).append(Call(
                span_us=(max(d[1] for d in inside) - inside[0][0]) / 1e3, events_us=per_event, events=len(inside),
                d2h_copies=sum(d[2].startswith("MemcpyD2H") for d in inside), timeline=timeline,
                window_us=(hi - lo) / 1e3))
    return calls


@dataclasses.dataclass
class Job:
    name: str
    fn: object                  # jitted callable
    arg_sets: list = dataclasses.field(default_factory=list)   # argument tuples, rotated
    fresh_args: object = None   # or () -> a new argument tuple for every call (donated arguments), made and waited
                                # for outside the timed window
    calls: int = 1              # calls of the op that one call of fn makes (`back_to_back_job`); the job's times are
                                # per call of the op: the window's numbers / calls

    def __post_init__(self):
        if self.calls < 1 or (self.calls > 1 and self.fresh_args is not None):
            raise ValueError(f"Job {self.name}: calls={self.calls} must be >= 1, and 1 with fresh_args")

    def args(self, r: int):
        if self.fresh_args is not None:
            return jax.block_until_ready(self.fresh_args())
        return self.arg_sets[r % len(self.arg_sets)]

    def warmups(self) -> int:
        return 2 if self.fresh_args is not None else min(2, len(self.arg_sets))


def back_to_back_job(name: str, fn, arg_sets: list, calls: int = BACK_TO_BACK) -> Job:
    """A Job whose every call runs fn on `calls` of arg_sets (rotated) inside one jitted function: one host dispatch
    and the kernels enqueued one after another, as in a decode step's executable, so that the host's per-call launch
    time before the first kernel is not counted; its times are per call of fn."""
    chained = jax.jit(lambda *groups: [fn(*group) for group in groups])
    groups = [tuple(arg_sets[(i * calls + c) % len(arg_sets)] for c in range(calls)) for i in range(len(arg_sets))]
    return Job(name, chained, groups, calls=calls)


def time_jobs(jobs: list[Job], reps: int, timeline: bool = False) -> dict[str, dict]:
    """Warm up every job, then time them all in one profiler session. Returns {name: timing dict}: `us` (device span,
    or wall clock when there is no device trace), `wall_us`; with a trace also `busy_us` (sum of the call's device
    events), `kernels_us` (the 8 longest event names), `device_events` and `d2h_copies` per call (per timed window
    divided by `Job.calls`), and with `timeline` the host and device events of the window whose span is the median
    (`Call.timeline`)."""
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
                    wall[job.name].append((time.perf_counter() - t0) * 1e6 / job.calls)
    finally:
        if traced:
            jax.profiler.stop_trace()
    calls = annotation_calls(trace_dir) if traced else {}
    out = {}
    for job in jobs:
        dev = calls.get(job.name, [])
        entry = {"wall_us": float(np.median(wall[job.name]))}
        if len(dev) >= max(1, reps // 2):  # a device trace of (most of) the calls
            k = job.calls                  # a window's numbers per call
            names = {name for c in dev for name in c.events_us}
            per_name = {name: float(np.median([c.events_us.get(name, 0.0) for c in dev])) / k for name in names}
            top = sorted(per_name.items(), key=lambda kv: -kv[1])[:8]
            entry.update(us=float(np.median([c.span_us for c in dev])) / k, method="device",
                         device_spread_us=float(np.std([c.span_us for c in dev])) / k,
                         busy_us=float(np.median([sum(c.events_us.values()) for c in dev])) / k,
                         kernels_us=dict(top), kernel_launches=len(names),
                         device_events=float(np.median([c.events for c in dev])) / k,
                         d2h_copies=float(np.median([c.d2h_copies for c in dev])) / k)
            if timeline:
                entry["timeline"] = sorted(dev, key=lambda c: c.span_us)[len(dev) // 2].timeline
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



def wall_us(fn, arg_sets, reps: int, warmup: int = 0) -> float:
    """Median wall clock (us) of fn(*args), args rotated over arg_sets, waited for, after `warmup` untimed calls,
    outside any profiler: the host's view of a call."""
    for r in range(warmup):
        jax.block_until_ready(fn(*arg_sets[r % len(arg_sets)]))
    times = []
    for r in range(reps):
        args = arg_sets[r % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(times))


# --------------------------------------------------------------------------------------------------- ceilings
def measure_ceilings(reps: int, quick: bool) -> dict:
    """Bandwidth (GB/s) and matmul rate (TFLOP/s) of this device, with their timings; `quick`: small arrays, a CPU
    smoke run."""
    n = (1 << 31) if not quick else (1 << 20)                        # 4 GiB of bf16
    x = jax.random.normal(jax.random.key(0), (n,), BF16)
    m = 8192 if not quick else 256
    a, b = (jax.random.normal(jax.random.key(i), (m, m), BF16) for i in (1, 2))
    t = time_jobs([Job("copy", jax.jit(jnp.copy), [(x,)]),
                   Job("elementwise", jax.jit(lambda v: v + 1), [(x,)]),
                   Job("matmul", jax.jit(jnp.matmul), [(a, b)])], reps)
    moved = 2 * x.size * x.dtype.itemsize
    bw = {k: gb_per_s(moved, t[k]["us"]) for k in ("copy", "elementwise")}
    best = max(bw, key=bw.get)
    return {"bandwidth_GBps": bw[best], "bandwidth_method": f"{best} of {moved / 1e9:.1f} GB (read + write)",
            "copy_GBps": bw["copy"], "elementwise_GBps": bw["elementwise"],
            "matmul_TFLOPs": tflop_per_s(2 * m ** 3, t["matmul"]["us"]), "matmul_shape": [m, m, m],
            "timings": t}


def gb_per_s(bytes_: float, us: float) -> float:
    """The rate, in GB/s, of moving bytes_ in us microseconds."""
    return bytes_ / (us * 1e-6) / 1e9


def tflop_per_s(flops: float, us: float) -> float:
    """The rate, in TFLOP/s, of flops in us microseconds."""
    return flops / (us * 1e-6) / 1e12


def roofline(flops: float, bytes_: float, ceil: dict) -> float:
    """Floor in us: the larger of bytes over bandwidth and FLOPs over the matmul rate."""
    return max(bytes_ / (ceil["bandwidth_GBps"] * 1e9), flops / (ceil["matmul_TFLOPs"] * 1e12)) * 1e6

