"""bench_kernels section `moe`: int4_moe (the Triton kernels, INT4 experts dequantized in registers, launched by
jax-triton; beside them the same kernels launched through XLA's Triton custom call, `launch:xla`, and through this
project's FFI handler, `launch:ffi` (also back to back), and routed by XLA's sort instead of the routing kernel,
`routing:xla`, where the kernel routes) against the XLA
paths over bf16 weights (ragged_dot, gather + einsum), tokamax's ragged_dot over the same INT4 values (each
implementation that runs; the reason for each that does not) and its jnp reference, at K2.6 expert shapes, with f32
checks and optional tilings. On the CPU (--quick) the reference stands in for the kernel (a Triton kernel has
no interpret mode): a smoke run of the script, not of the kernel. The previous Pallas-Triton kernel was timed beside
the Triton one up to results/kernels/kernels.json of the sixth session, then removed.

    cases      M tokens (moe_shapes): x [M,D] bf16, random INT4 experts [E] of D x I, top-k ids / weights [M,k]
    cost       FLOPs of the M x k pairs, bytes of the touched experts + x + out (moe_cost) -> roofline fraction
    times      device span of one call after an idle device (`kernel_us`: the host's launch of each kernel counts
               where the device waits for it), and up to M = 256 per call of timing.BACK_TO_BACK calls in one jitted
               function (`back_to_back_us`, `bandwidth_fraction_back_to_back`: one dispatch, as in a decode step)
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from experiments.timing import (BF16, Job, back_to_back_job, gb_per_s, rel_err, roofline, tflop_per_s, time_jobs,
                                try_candidates)
from pallas_kernels import int4_moe as moe
from pallas_kernels import int4_moe_mgpu as moe_mgpu
from pallas_kernels import int4_moe_triton as moe_triton
from pallas_kernels import ops
from pallas_kernels.triton_call import bound_to


# The default kernels and tiling through the other launchers of `triton_call` (not tilings: kept out of best_config).
LAUNCH_PEERS = {"launch:xla": "xla", "launch:ffi": "ffi"}
MOSAIC_PEER = "mosaic:block_matmul"   # int4_moe_mgpu: the Mosaic GPU block matmul, where the op runs Triton
TRITON_PEER = "triton:default"        # int4_moe_triton at its default tiling, where the op runs Mosaic GPU
ROUTING_PEER = "routing:xla"  # the default kernels, routed by XLA's sort instead of the routing kernel

# The INT4 implementations the scripts time by name: the GPU kernel (Triton) and the pure-JAX reference.
INT4_KERNELS = {"triton": moe_triton.int4_moe, "reference": moe.int4_moe_reference}


def moe_shapes(quick: bool) -> tuple[dict, tuple[int, ...]]:
    """(experts E, hidden D, inter I, top_k) and the token counts M; `quick`: small ones, for a CPU smoke run."""
    if quick:
        return dict(experts=16, hidden=512, inter=256, top_k=4), (1, 8, 64)
    return dict(experts=384, hidden=7168, inter=2048, top_k=8), (1, 8, 64, 256, 1024, 1536, 2048, 4096)


def triton_sweep(m: int, n_pairs: int, num_experts: int, sweep_tokens: list[int]) -> list:
    """Tilings of the Triton kernel timed beside its default when M is one of `sweep_tokens`."""
    if m not in sweep_tokens:
        return []
    base = moe_triton.default_config(n_pairs, num_experts)
    Config = moe_triton.TritonMoeConfig
    per_expert = n_pairs / num_experts
    if per_expert < 16:
        candidates = [Config(block_m=16, block_n=64, words=32, num_stages=4),
                      Config(block_m=16, block_n=64, words=32, num_stages=4, down_block_n=128),
                      Config(block_m=16, block_n=128, words=32, num_stages=3)]
        if n_pairs < moe_triton.WIDE_ROWS_PAIRS:       # few experts: split-K gate_up for more programs in flight
            candidates += [Config(block_m=16, block_n=64, words=32, num_stages=stages, down_block_n=128,
                                  gate_up_splits=splits)
                           for splits, stages in ((2, 4), (2, 3), (4, 3), (4, 2))]
            candidates += [Config(block_m=1, block_n=rows, fma=True, gate_up_splits=splits, down_block_n=down_rows)
                           for rows, splits, down_rows in ((32, 1, 64), (32, 2, 64), (32, 4, 64), (16, 2, 32),
                                                           (16, 4, 32), (64, 4, 64))]
    elif per_expert < 48:
        candidates = [Config(block_m=16, block_n=64, words=32), Config(block_m=32, block_n=128, words=32, num_warps=8),
                      Config(block_m=64, block_n=64, words=32), Config(block_m=128, block_n=128, words=16, num_warps=8),
                      dataclasses.replace(base, group_by_block=False)]
    else:
        candidates = [dataclasses.replace(base, group_by_block=False, down_num_stages=None),
                      dataclasses.replace(base, down_num_stages=None),     # one down block per SM (3 stages)
                      dataclasses.replace(base, group_by_block=False),
                      Config(block_m=64, block_n=128, words=32, num_warps=8, group_by_block=True, down_num_stages=2),
                      dataclasses.replace(base, num_stages=4),
                      dataclasses.replace(base, num_stages=2, down_num_stages=None)]

    def launchable(c):      # grouped blocks sit on the grid's second axis (`run_kernels` refuses an overflow)
        return not c.group_by_block or moe.num_route_blocks(n_pairs, num_experts, c.block_m) <= moe_triton.MAX_GRID_Y

    return list(dict.fromkeys(c for c in candidates if c != base and launchable(c)))


def mosaic_sweep(m: int, sweep_tokens: list[int]) -> dict[str, dict]:
    """{label: int4_moe_mgpu keyword arguments} of the Mosaic GPU int4_moe timed beside its default when M is one of
    `sweep_tokens`: tokens per block, a whole 256-input block per step, down at 64 rows per warpgroup (the default
    takes 128), clusters of two CTAs sharing the activation tile, gate_up at 128 rows per warpgroup."""
    if m not in sweep_tokens:
        return {}
    Config = moe_mgpu.MgpuMatmulConfig
    runs = {f"block_tokens={t}": dict(config=Config(block_tokens=t)) for t in (32, 64, 96, 128)}
    runs["block_tokens=96,tile_k=256"] = dict(config=Config(block_tokens=96, tile_k=256))
    runs["block_tokens=96,down_rows_per_wg=64"] = dict(config=Config(block_tokens=96),
                                                       down_config=Config(block_tokens=96, rows_per_wg=64))
    runs["block_tokens=96,cluster=2"] = dict(config=Config(block_tokens=96, cluster=2))
    for tokens in (64, 96):     # the gated product at 128 rows per warpgroup (4 accumulators), not yet run on a GPU
        runs[f"block_tokens={tokens},rows_per_wg=128"] = dict(config=Config(block_tokens=tokens, rows_per_wg=128))
    return runs


@functools.partial(jax.jit, static_argnames=("e", "d", "i"))
def random_experts(key, e: int, d: int, i: int):
    """Random INT4 experts (E = e, D = d, I = i) in the compressed-tensors layout, repacked for the kernel."""
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


def grouped_moe(x, gate_up, down, ids, weights, *, dot, num_experts: int):
    """A MoE through a grouped matmul: sort the pairs by expert, dot(rows [P, K], weights [E, K, N], group sizes [E])
    -> [P, N] f32 for gate_up [E, D, 2I] then down [E, I, D], unsort and sum. The XLA and tokamax baselines."""
    m, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat)
    xs = x[order // k]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    g, u = jnp.split(dot(xs, gate_up, sizes), 2, axis=1)
    y = dot((jax.nn.silu(g) * u).astype(x.dtype), down, sizes)
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros((m, x.shape[1]), jnp.float32).at[order // k].add(y).astype(x.dtype)


def ragged_dot_moe(x, gate_up, down, ids, weights):
    """XLA baseline: `grouped_moe` with lax.ragged_dot over bf16 weights."""
    dot = functools.partial(lax.ragged_dot, preferred_element_type=jnp.float32)
    return grouped_moe(x, gate_up, down, ids, weights, dot=dot, num_experts=gate_up.shape[0])


TOKAMAX_IMPLEMENTATIONS = ("mosaic", "triton", "xla")


def load_tokamax() -> tuple[object, str | None]:
    """The tokamax peer, an optional import: (the tokamax and qwix modules, None), or (None, why not)."""
    try:
        import qwix          # noqa: PLC0415 - optional peer
        import tokamax       # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - any import failure is the recorded reason
        return None, (f"tokamax did not import ({type(e).__name__}: {str(e)[:300]}); carry tokamax==0.0.17, qwix and "
                      "their wheels (BUILD_NOTES.md, 'One H200')")
    return (tokamax, qwix), None


@jax.jit
def _int4_weights(experts: moe.Int4Experts):
    """The experts' integer values and scales for a grouped matmul, one expert at a time: gate_up (values int4
    [E, D, 2I], scales [E, D/32, 2I]), down (values int4 [E, I, D], scales [E, I/32, D]); values * scales is exactly
    the dequantized weight."""
    d, i = experts.hidden_size, experts.intermediate_size

    def values(packed, scale, in_dim):   # the repacked nibbles as integers q - 8, [out, in] -> [in, out]
        return moe.dequantize_kernel_layout(packed[None], jnp.ones_like(scale[None]), in_dim)[0].T.astype(jnp.int4)

    def one(args):
        gp, gs, up, us, dp, ds = args
        gate_up = jnp.concatenate([values(gp, gs, d), values(up, us, d)], axis=1)
        gate_up_scale = jnp.concatenate([gs, us], axis=1)[:d // moe.GROUP]
        return gate_up, gate_up_scale, values(dp, ds, i), ds[:i // moe.GROUP]
    return lax.map(one, tuple(experts))


def tokamax_moe(x, gate_up_q, gate_up_scale, down_q, down_scale, ids, weights, *, modules, implementation: str):
    """tokamax peer: `grouped_moe` with tokamax.ragged_dot on QArrays (qwix) of the experts' own INT4 values and
    group-32 scales (`_int4_weights`: no re-quantization)."""
    tokamax, qwix = modules
    out_dtype = jnp.bfloat16 if implementation == "mosaic" else jnp.float32   # its Hopper kernel refuses f32 out

    def qarray(values, scale):
        return qwix.QArray(qvalue=values, scale=scale, zero_point=None, qtype=jnp.int4)

    def dot(rows, rhs, sizes):
        return tokamax.ragged_dot(rows, rhs, group_sizes=sizes, preferred_element_type=out_dtype,
                                  implementation=implementation).astype(jnp.float32)
    return grouped_moe(x, qarray(gate_up_q, gate_up_scale), qarray(down_q, down_scale), ids, weights, dot=dot,
                       num_experts=gate_up_q.shape[0])


def tokamax_path_missing(implementation: str) -> str | None:
    """Why tokamax 0.0.17's `implementation` cannot run here, known before trying it (None: try it). Its Triton
    path calls jax-triton >= 0.4's `triton_call`, which needs Triton >= 3.7 (the H200 image has 3.6)."""
    if implementation != "triton":
        return None
    try:
        version = importlib.metadata.version("jax-triton")
    except importlib.metadata.PackageNotFoundError:
        version = None
    major_minor = re.match(r"(\d+)\.(\d+)", version or "")
    if not major_minor or tuple(map(int, major_minor.groups())) < (0, 4):
        return (f"tokamax's Triton path needs jax-triton >= 0.4 (and Triton >= 3.7); found "
                f"{'jax-triton ' + version if version else 'no jax-triton'}")
    return None


def _tokamax_fns(modules) -> tuple[dict, dict]:
    """({job name: jitted fn(x, gate_up_q, gate_up_scale, down_q, down_scale, ids, weights)} per implementation that
    may run, {job name: why not} for the others)."""
    fns, missing = {}, {}
    for impl in TOKAMAX_IMPLEMENTATIONS:
        why = tokamax_path_missing(impl)
        if why:
            missing[f"tokamax_{impl}"] = why
        else:
            fns[f"tokamax_{impl}"] = jax.jit(functools.partial(tokamax_moe, modules=modules, implementation=impl))
    return fns, missing


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


def _checked_peer_jobs(peers: dict, arg_sets: list, sub: int, ref, errors: dict, failed: dict) -> list:
    """Jobs of the peers that run on arg_sets[0], their first `sub` tokens' error against `ref` into `errors`;
    the others' reasons into `failed`."""
    peer_errors, peer_failed = try_candidates(peers, lambda fn: fn(*arg_sets[0])[:sub].astype(jnp.float32), ref)
    errors.update(peer_errors)
    failed.update(peer_failed)
    return [Job(name, fn, arg_sets) for name, fn in peers.items()]


def routed_by_xla(x, experts: moe.Int4Experts, topk_ids, topk_weights):
    """The routing kernel's peer: int4_moe's default kernels and tiling with the pairs routed by XLA's sort."""
    call = bound_to(moe_triton.LAUNCHER, interpret=False, op="kernels_moe.routed_by_xla",
                    reference="int4_moe.int4_moe_reference")
    return moe_triton.run_kernels(call, x, experts, topk_ids, topk_weights, None, xla_routing=True)


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


def run_moe(ceil: dict, results: list, checks: dict, deadline: float, reps: int, quick: bool,
            sweep_tokens: list[int], save, only_tokens: list[int] = ()) -> None:
    """Time every token count (kernel, the tilings of triton_sweep and mosaic_sweep, the baselines) against the
    ceilings `ceil`; one row per M appended to `results`, printed, then `save()`; no new M past `deadline`
    (time.time()); then the f32 checks into checks["int4_moe_f32_16_tokens"] (the kernel; GPU only). only_tokens:
    the token counts of moe_shapes to run (empty: all); a ValueError names those it does not have."""
    interpret = jax.default_backend() != "gpu"
    shape, token_counts = moe_shapes(quick)
    if set(only_tokens) - set(token_counts):
        raise ValueError(f"int4_moe token counts {sorted(set(only_tokens) - set(token_counts))} are not cases; "
                         f"choose from {list(token_counts)}")
    token_counts = [m for m in token_counts if not only_tokens or m in only_tokens]
    e, d, k = shape["experts"], shape["hidden"], shape["top_k"]
    experts = random_experts(jax.random.key(3), e, d, shape["inter"])
    gate_up_bf16 = down_bf16 = int4_weights = None
    tokamax_modules, tokamax_missing = (None, None) if interpret else load_tokamax()
    for m in token_counts:
        if time.time() > deadline:
            results.append(dict(tokens=m, skipped="time budget"))
            continue
        try:
            sets = []
            for s in range(4):
                ids, w = moe_routing(jax.random.key(100 * m + s), m, e, k)
                sets.append((jax.random.normal(jax.random.key(7 + s), (m, d), BF16), experts, ids, w))
            if interpret:   # the CPU smoke run: the reference in the kernel's place
                backend = "reference (CPU)"
                fns = {"kernel": jax.jit(moe.int4_moe_reference)}
            else:
                backend = ops.int4_moe_backend(*sets[0][:3])
                fns = {"kernel": jax.jit(ops.int4_moe)}   # the op's dispatch; the Triton one's tilings and launchers:
                for cfg in triton_sweep(m, m * k, e, sweep_tokens):
                    fns[f"kernel:{cfg}"] = jax.jit(lambda *a, cfg=cfg: moe_triton.int4_moe(*a, config=cfg))
                for name, launcher in LAUNCH_PEERS.items():
                    fns[name] = jax.jit(functools.partial(moe_triton.int4_moe, launcher=launcher))
                if m * k <= moe_triton.MAX_ROUTED_PAIRS:
                    fns[ROUTING_PEER] = jax.jit(routed_by_xla)
            ref_fn = jax.jit(moe.int4_moe_reference)
            x0, _, ids0, w0 = sets[0]
            sub = min(m, 32)
            ref = ref_fn(x0[:sub], experts, ids0[:sub], w0[:sub]).astype(jnp.float32)
            errors, failed = try_candidates(fns, lambda fn: fn(*sets[0])[:sub].astype(jnp.float32), ref)
            jobs = [Job(name, fn, sets) for name, fn in fns.items()]
            if m <= 256:
                jobs.append(back_to_back_job("kernel:back_to_back", fns["kernel"], sets))
                if "launch:ffi" in fns:
                    jobs.append(back_to_back_job("launch:ffi:back_to_back", fns["launch:ffi"], sets))
            if m <= 64:
                jobs.append(Job("reference_int4", ref_fn, sets))
            if m <= 256 and not interpret:
                if gate_up_bf16 is None:
                    gate_up_bf16, down_bf16 = _bf16_weights(experts)
                bf16_sets = [(x, gate_up_bf16, down_bf16, ids, w) for x, _, ids, w in sets]
                jobs.append(Job("xla_ragged_dot_bf16", jax.jit(ragged_dot_moe), bf16_sets))
                if m <= 64:
                    jobs.append(Job("xla_gather_einsum_bf16", jax.jit(gather_einsum_moe), bf16_sets))
            peers_failed = {"tokamax": tokamax_missing} if (tokamax_missing and m <= 256) else {}
            if m <= 256 and tokamax_modules is not None:
                if int4_weights is None:
                    int4_weights = _int4_weights(experts)
                int4_sets = [(x, *int4_weights, ids, w) for x, _, ids, w in sets]
                peers, missing_peers = _tokamax_fns(tokamax_modules)
                peers_failed.update(missing_peers)
                jobs += _checked_peer_jobs(peers, int4_sets, sub, ref, errors, peers_failed)
            if not interpret:
                other = ({TRITON_PEER: moe_triton.int4_moe} if backend == "mosaic_gpu"
                         else {MOSAIC_PEER: moe_mgpu.int4_moe})
                jobs += _checked_peer_jobs(other, sets, sub, ref, errors, peers_failed)
                mosaic_fns = {}
                for label, kwargs in mosaic_sweep(m, sweep_tokens).items():
                    mosaic_fns[f"{MOSAIC_PEER}:{label}"] = functools.partial(moe_mgpu.int4_moe, **kwargs)
                jobs += _checked_peer_jobs(mosaic_fns, sets, sub, ref, errors, peers_failed)
            t = time_jobs(jobs, reps)
            flops, bytes_, touched = moe_cost(np.asarray(ids0), shape)
            floor = roofline(flops, bytes_, ceil)
            k_us = t["kernel"]["us"]
            b2b_us = t["kernel:back_to_back"]["us"] if "kernel:back_to_back" in t else None
            best = min((n for n in fns if n not in (*LAUNCH_PEERS, ROUTING_PEER)), key=lambda n: t[n]["us"])
            baselines = {n: t[n]["us"] for n in t
                         if n.startswith(("xla_", "reference", "tokamax_", "launch:", "routing:", "mosaic:",
                                          "triton:"))}
            bf16 = [t[n]["us"] for n in t if n.startswith("xla_")]
            gbps, tflops = gb_per_s(bytes_, k_us), tflop_per_s(flops, k_us)
            entry = dict(tokens=m, **shape, kernel=backend, config=str(ops.int4_moe_config(*sets[0][:3])),
                         touched_experts=touched,
                         kernel_us=k_us, baselines_us=baselines,
                         speedup_vs_best_xla_bf16=(min(bf16) / k_us) if bf16 else None,
                         touched_GBps=gbps,
                         bandwidth_fraction=gbps / ceil["bandwidth_GBps"],
                         back_to_back_us=b2b_us,
                         bandwidth_fraction_back_to_back=(gb_per_s(bytes_, b2b_us) / ceil["bandwidth_GBps"]
                                                          if b2b_us else None),
                         TFLOPs=tflops,
                         matmul_fraction=tflops / ceil["matmul_TFLOPs"],
                         roofline_us=floor, roofline_fraction=floor / k_us,
                         rel_err_bf16_first_tokens=errors["kernel"], checked_tokens=sub,
                         best_config=best, best_us=t[best]["us"],
                         sweep={n: dict(us=t[n]["us"], rel_err=errors[n]) for n in fns if n != "kernel"},
                         launch_peers_over_kernel={n: t[n]["us"] / k_us for n in LAUNCH_PEERS if n in t},
                         xla_routing_over_kernel=t[ROUTING_PEER]["us"] / k_us if ROUTING_PEER in t else None,
                         sweep_failed=failed, peers_failed=peers_failed,
                         peers_rel_err={n: errors[n] for n in errors
                                        if n.startswith(("tokamax_", "mosaic:", "triton:"))},
                         timing_method=t["kernel"]["method"], timings=t)
        except Exception as ex:  # noqa: BLE001 - record the failure and go on with the other cases
            entry = dict(tokens=m, error=f"{type(ex).__name__}: {str(ex)[:2000]}")
        results.append(entry)
        _print_moe_row(entry)
        save()
    del gate_up_bf16, down_bf16, int4_weights
    if not interpret:
        try:
            checks["int4_moe_f32_16_tokens"] = _moe_f32_check(moe_triton.int4_moe, experts, shape)
        except Exception as e:  # noqa: BLE001 - a failed check is a result
            checks["int4_moe_f32_16_tokens"] = f"{type(e).__name__}: {str(e)[:2000]}"


def _moe_f32_check(kernel, experts, shape) -> float:
    """f32 activations (IEEE dots): kernel vs reference at the full expert shape, 16 tokens, two ids off-device."""
    ids, w = moe_routing(jax.random.key(11), 16, shape["experts"], shape["top_k"])
    ids = ids.at[0, 0].set(-1).at[1, 1].set(shape["experts"])          # other devices' experts contribute 0
    x = jax.random.normal(jax.random.key(12), (16, shape["hidden"]), jnp.float32)
    return rel_err(kernel(x, experts, ids, w), moe.int4_moe_reference(x, experts, ids, w))


def _print_moe_row(r):
    if "error" in r or "skipped" in r:
        print(f"int4_moe M={r['tokens']}: {r.get('error') or r.get('skipped')}", flush=True)
        return
    base = " ".join(f"{k}={v:.1f}" for k, v in r["baselines_us"].items())
    b2b = (f" (back to back {r['back_to_back_us']:.1f} us, {r['bandwidth_fraction_back_to_back']:5.1%})"
           if r.get("back_to_back_us") else "")
    print(f"int4_moe M={r['tokens']:5d} experts {r['touched_experts']:3d} | kernel {r['kernel_us']:9.1f} us{b2b} | "
          f"{r['touched_GBps']:6.0f} GB/s ({r['bandwidth_fraction']:5.1%}) {r['TFLOPs']:6.1f} TF/s "
          f"({r['matmul_fraction']:5.1%}) | best {r['best_us']:9.1f} | {base} | err "
          f"{r['rel_err_bf16_first_tokens']:.1e}", flush=True)
    for name, why in r.get("peers_failed", {}).items():
        print(f"    {name} did not run: {why[:300]}", flush=True)

