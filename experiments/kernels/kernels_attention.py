"""bench_kernels section `attention`: `ops.tree_verify_attention` (the kernel `ops.attention_backend` picks per
call) against its XLA reference at K2.6 MLA shapes (latent 512, rope 64), with an f32 check, optional split-K counts
(of the Triton kernel and of the Mosaic GPU op) and tilings of the Triton kernel, FLOPs and bytes per case. On the GPU
each of its kernels is also timed alone (the Triton kernel at its default tiling, the Mosaic GPU one where it fits
the case).

    cases      S streams x H heads x N prefix rows x T tree nodes (attention_cases)
    inputs     q_lat [S,T,H,512], q_rope [S,T,H,64], c_kv [S,N',512], k_rope [S,N',64] with N' = N + T rounded up to
               whole 64-row blocks (as the decoder allocates its cache), prefix_len [S], visible [S,T,T] of a random
               tree (attention_inputs), bf16
    cost       useful FLOPs, fewest HBM bytes (attention_cost) -> roofline fraction
    times      device span of one call after an idle device (`kernel_us`, `reference_us`: the host's launch time
               counts wherever a short kernel runs before a long one), and per call of timing.BACK_TO_BACK calls in one
               jitted function (`back_to_back_us`: one dispatch, the kernels enqueued one after another, as in a step)
    plan       the op is timed with its `ops.tree_verify_plan` made beforehand (`kernel_us`, `back_to_back_us`), as the
               model makes it once per forward for all its layers; `plan_us` times the plan alone, and the peer
               `op_plan_in_call` the op making it in the call
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.timing import (BF16, Job, back_to_back_job, gb_per_s, rel_err, roofline, rotation_sets, tflop_per_s,
                                time_jobs, try_candidates)
from pallas_kernels import ops
from pallas_kernels import tree_verify_attention as attn
from pallas_kernels import tree_verify_attention_mgpu as attn_mgpu
from pallas_kernels import tree_verify_attention_triton as attn_triton
from pallas_kernels.tree import random_tree_visible
from pallas_kernels.triton_call import LAUNCHERS

K26_LAT, K26_ROPE = 512, 64
K26_SCALE = 192 ** -0.5  # 1 / sqrt(qk_nope 128 + qk_rope 64), the benchmark's softmax scale
CACHE_BLOCK = 64         # cache rows are allocated in whole blocks of this many (kdtree_jax.decode's cache_len)
# The Triton kernel at its default tiling through `triton_call`'s other launchers, peers `triton:launch:NAME`: "ffi"
# and "jax_triton" run Triton 3.6's own compile of it, "xla" XLA's Triton pipeline (which made int4_moe's kernels
# 2-3x slower; on the H200 it compiles the attention decode tile 4-5% faster than Triton 3.6 does, the 64-row tile
# ~11% slower: kernels.md, "Twenty-eighth session").
TRITON_LAUNCH_PEERS = tuple(name for name in LAUNCHERS if name != attn_triton.LAUNCHER)


def attention_cases(quick: bool) -> list[dict]:
    """The cases: dicts of streams, heads, prefix, nodes; `quick`: small ones, for a CPU smoke run."""
    if quick:
        return [dict(streams=1, heads=8, prefix=256, nodes=t) for t in (1, 16)] + [
            dict(streams=2, heads=4, prefix=128, nodes=5)]
    cases = [dict(streams=1, heads=h, prefix=p, nodes=t) for h in (8, 64) for p in (4096, 32768)
             for t in (1, 16, 64, 256)]
    return cases + [dict(streams=8, heads=8, prefix=32768, nodes=64)]


def case_name(case: dict) -> str:
    """'S/H/N/T' of a case (the --attention_cases form)."""
    return f"{case['streams']}/{case['heads']}/{case['prefix']}/{case['nodes']}"


def parse_case(text: str) -> dict:
    """A case from its 'S/H/N/T' form (streams, heads, prefix, nodes); a ValueError names a malformed one."""
    parts = text.split("/")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts[:3]) or not parts[3].isdigit():
        raise ValueError(f"case {text!r} is not S/H/N/T (positive streams, heads, prefix; nodes >= 0), "
                         "e.g. 1/8/32768/16")
    s, h, n, t = (int(p) for p in parts)
    return dict(streams=s, heads=h, prefix=n, nodes=t)


def attention_sweep(case: dict, quick: bool, tilings: bool, splits: list[int]) -> list[attn.AttentionConfig]:
    """Alternative configs of the Triton kernel timed beside the op: the split-K counts `splits` on every case (those
    it admits: at most N' / (2 block_k), at most 4 waves of programs), and with `tilings` other tilings on five
    prefix-32768 cases."""
    rows = case["nodes"] * case["heads"]
    base = attn.default_config(case["streams"], rows, cache_rows(case))
    split_configs = [dataclasses.replace(base, num_splits=s) for s in sorted(set(splits))
                     if s != base.num_splits and s <= attn.max_splits(cache_rows(case), base.block_k)
                     and attn.query_tiles(case["streams"], rows, base.block_q) * s <= 4 * attn.wave_slots(base.block_q)]
    if (not tilings or quick or case["prefix"] != 32768 or case["streams"] > 1
            or (case["heads"], case["nodes"]) not in ((8, 1), (8, 16), (64, 1), (64, 16), (64, 256))):
        return split_configs
    fewer, more = dict(num_splits=max(1, base.num_splits // 2)), dict(num_splits=2 * base.num_splits)
    if rows <= 16:
        variants = [dict(num_stages=3), dict(num_stages=5), dict(num_stages=6),
                    dict(block_k=64, num_stages=2, num_splits=2 * attn.NUM_SMS), more]
    else:
        variants = [dict(block_k=32), dict(block_q=32, num_warps=4), dict(block_q=32, block_k=32, num_stages=3), fewer,
                    dict(block_k=32, num_stages=4), dict(block_k=16, num_stages=6)]    # more cache rows in flight
    return split_configs + [dataclasses.replace(base, **v) for v in variants]


def cache_rows(case) -> int:
    """N': the case's cache rows, prefix + tree block rounded up to whole CACHE_BLOCK blocks."""
    return -(-(case["prefix"] + case["nodes"]) // CACHE_BLOCK) * CACHE_BLOCK


def cache_bytes(case) -> float:
    """Bytes of a case's cache (c_kv and k_rope of every stream, bf16): one input set's bulk."""
    return 2.0 * case["streams"] * cache_rows(case) * (K26_LAT + K26_ROPE)


def attention_inputs(key, case, rng):
    s, t, h, p = case["streams"], case["nodes"], case["heads"], case["prefix"]
    n = cache_rows(case)
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


def attention_peers(args, interpret: bool, splits: list[int] = (), launch_peers: bool = False) -> dict:
    """The op's kernels, each alone at its default tiling (the Triton kernel, with `launch_peers` also through
    TRITON_LAUNCH_PEERS, whose Triton 3.6 compiles double a case's time in the section; Mosaic
    GPU wherever it `supports` the call, also below 64 rows, and joining its split-K partials in the kernel where it
    splits, and with C = 1 or 2 query tiles a cluster sharing the cache's loads, the one of the two that is not its
    default (`default_multicast_tiles`) where C divides the stream's tiles, `mosaic_gpu:multicast_tiles=C`; and the
    Mosaic GPU op at the split-K counts `splits` other than its default, up to one cache block a
    split, as `mosaic_gpu:num_splits=N`), for inputs `args` (GPU only: {} when `interpret`)."""
    if interpret:
        return {}
    peers = {"op_plan_in_call": jax.jit(lambda *a: ops.tree_verify_attention(*a, scale=K26_SCALE)),
             "triton": jax.jit(lambda *a: attn_triton.tree_verify_attention(*a, scale=K26_SCALE))}
    for launcher in TRITON_LAUNCH_PEERS if launch_peers else ():
        peers[f"triton:launch:{launcher}"] = jax.jit(functools.partial(attn_triton.tree_verify_attention,
                                                                       scale=K26_SCALE, launcher=launcher))
    if attn_mgpu.supports(*args[:4]):
        peers["mosaic_gpu"] = jax.jit(lambda *a: attn_mgpu.tree_verify_attention(*a, scale=K26_SCALE))
        rows = args[0].shape[1] * args[0].shape[2]
        default = attn_mgpu.default_num_splits(args[0].shape[0], rows, args[2].shape[1])
        if default > 1:
            peers["mosaic_gpu_combine_in_kernel"] = jax.jit(
                lambda *a: attn_mgpu.tree_verify_attention(*a, scale=K26_SCALE, combine_in_kernel=True))
        tiles = attn_mgpu.query_tiles(rows)
        own = attn_mgpu.default_multicast_tiles(rows, args[2].shape[1], default)
        for size in sorted({1, 2} - {own}):
            if tiles % size == 0 and tiles > 1:
                peers[f"mosaic_gpu:multicast_tiles={size}"] = jax.jit(functools.partial(
                    attn_mgpu.tree_verify_attention, scale=K26_SCALE, multicast_tiles=size))
        for count in sorted(set(splits) - {default}):
            if count <= attn.max_splits(args[2].shape[1], attn_mgpu.BLOCK_KV, attn_mgpu.MIN_BLOCKS_PER_SPLIT):
                peers[f"mosaic_gpu:num_splits={count}"] = jax.jit(functools.partial(
                    attn_mgpu.tree_verify_attention, scale=K26_SCALE, num_splits=count))
    return peers


def run_attention(ceil: dict, results: list, deadline: float, reps: int, quick: bool, tilings: bool,
                  splits: list[int], save, only_cases: list[str] = (),
                  sweep_launcher: str = attn_triton.LAUNCHER, launch_peers: bool = False) -> None:
    """Time every case (the op, the Triton kernel at the configs of attention_sweep through `sweep_launcher`, each
    kernel alone, the XLA reference) against the ceilings `ceil`; one row per case appended to `results`, printed,
    then `save()`; no new case past `deadline` (time.time()). launch_peers: as `attention_peers`. only_cases: the
    cases to run as 'S/H/N/T' (empty: all); a ValueError names those that are not cases."""
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(0)
    cases = attention_cases(quick)
    names = [case_name(case) for case in cases]
    if set(only_cases) - set(names):
        raise ValueError(f"attention cases {sorted(set(only_cases) - set(names))} are not cases; choose from {names}")
    for ci, case in enumerate(cases):
        if only_cases and names[ci] not in only_cases:
            continue
        if time.time() > deadline:
            results.append(dict(case, skipped="time budget"))
            continue
        try:
            n_sets = rotation_sets(cache_bytes(case), 32)
            sets = [attention_inputs(jax.random.key(1000 * ci + i), case, rng) for i in range(n_sets)]
            planned = [(*a, ops.tree_verify_plan(a[4], a[5], num_heads=case["heads"])) for a in sets]
            op = jax.jit(lambda *a: ops.tree_verify_attention(*a, scale=K26_SCALE))
            fns = {"kernel": op}
            if not interpret:
                for cfg in attention_sweep(case, quick, tilings, splits):
                    fns[f"triton:{cfg}"] = jax.jit(functools.partial(
                        attn_triton.tree_verify_attention, scale=K26_SCALE, config=cfg, launcher=sweep_launcher))
            ref_fn = jax.jit(lambda *a: attn.tree_verify_attention_reference(*a, scale=K26_SCALE))
            ref = ref_fn(*sets[0]).astype(jnp.float32)
            errors, failed = try_candidates(fns, lambda fn: fn(*(planned if fn is op else sets)[0]).astype(jnp.float32),
                                            ref)
            peers = attention_peers(sets[0], interpret, splits, launch_peers)
            peer_errors, peers_failed = try_candidates(peers, lambda fn: fn(*sets[0]).astype(jnp.float32), ref)
            jobs = [Job(name, fn, planned if fn is op else sets) for name, fn in {**fns, **peers}.items()]
            plan_fn = jax.jit(lambda p, v, h=case["heads"]: ops.tree_verify_plan(p, v, num_heads=h))
            jobs += [Job("plan", plan_fn, [a[4:6] for a in sets]),
                     Job("reference", ref_fn, sets), back_to_back_job("kernel:back_to_back", op, planned),
                     back_to_back_job("reference:back_to_back", ref_fn, sets)]
            t = time_jobs(jobs, reps)
            flops, bytes_ = attention_cost(case)
            floor = roofline(flops, bytes_, ceil)
            best = min(fns, key=lambda k: t[k]["us"])
            k_us, r_us = t["kernel"]["us"], t["reference"]["us"]
            rows = case["nodes"] * case["heads"]
            entry = dict(case, cache_rows=cache_rows(case),
                         backend=ops.attention_backend(*sets[0][:4]) if not interpret else "reference",
                         config=(f"num_splits={attn_mgpu.default_num_splits(case['streams'], rows, cache_rows(case))}"
                                 if attn_mgpu.fits(*sets[0][:4]) else
                                 str(attn.default_config(case["streams"], rows, cache_rows(case)))),
                         kernel_us=k_us, plan_us=t["plan"]["us"], reference_us=r_us, speedup_vs_reference=r_us / k_us,
                         back_to_back_us={name: t[f"{name}:back_to_back"]["us"] for name in ("kernel", "reference")},
                         speedup_vs_reference_back_to_back=(t["reference:back_to_back"]["us"]
                                                            / t["kernel:back_to_back"]["us"]),
                         GBps=gb_per_s(bytes_, k_us), TFLOPs=tflop_per_s(flops, k_us),
                         roofline_us=floor, roofline_fraction=floor / k_us, rel_err_bf16=errors["kernel"],
                         best_config=best, best_us=t[best]["us"], best_roofline_fraction=floor / t[best]["us"],
                         timing_method=t["kernel"]["method"], input_sets=n_sets,
                         sweep={k: dict(us=t[k]["us"], rel_err=errors[k]) for k in fns if k != "kernel"},
                         sweep_failed=failed, timings=t,
                         peers_us={name: t[name]["us"] for name in peers if name in t},
                         peers_rel_err_bf16=peer_errors, peers_failed=peers_failed)
        except Exception as e:  # noqa: BLE001 - record the failure and go on with the other cases
            entry = dict(case, error=f"{type(e).__name__}: {str(e)[:2000]}")
        results.append(entry)
        _print_attention_row(entry)
        save()


def attention_f32_check(quick: bool) -> dict:
    """f32 inputs (IEEE dots in the Triton kernel) on a ragged batch with random trees: the op, and the Triton kernel
    with small tiles, split-K on and off -> {name: relative error against the reference} (on the CPU the op runs
    its reference)."""
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(1)
    s, t, h, n = 4, 16, 8, (1024 if not quick else 96)
    key = jax.random.split(jax.random.key(7), 4)
    args = (jax.random.normal(key[0], (s, t, h, K26_LAT)), jax.random.normal(key[1], (s, t, h, K26_ROPE)),
            jax.random.normal(key[2], (s, n, K26_LAT)), jax.random.normal(key[3], (s, n, K26_ROPE)),
            jnp.asarray([0, n - t, 37, n // 2], jnp.int32), jnp.asarray(random_tree_visible(rng, s, t)))
    ref = attn.tree_verify_attention_reference(*args, scale=0.05)
    out = {"op": rel_err(ops.tree_verify_attention(*args, scale=0.05), ref)}
    for splits in ((1, 4) if not interpret else ()):
        cfg = attn.AttentionConfig(block_q=16, block_k=16, num_splits=splits)
        try:
            out[f"triton splits={splits}"] = rel_err(attn_triton.tree_verify_attention(*args, scale=0.05,
                                                                                      config=cfg), ref)
        except Exception as e:  # noqa: BLE001 - a failure is a result beside the others
            out[f"triton splits={splits}"] = f"{type(e).__name__}: {str(e)[:500]}"
    return out


def _print_attention_row(r):
    if "error" in r or "skipped" in r:
        print(f"attention S={r['streams']} H={r['heads']} N={r['prefix']} T={r['nodes']}: "
              f"{r.get('error') or r.get('skipped')}", flush=True)
        return
    peers = " ".join(f"{name} {us:.1f}" for name, us in r["peers_us"].items())
    print(f"attention S={r['streams']:2d} H={r['heads']:2d} N={r['prefix']:6d} T={r['nodes']:3d} | {r['backend']:10s} "
          f"{r['kernel_us']:9.1f} us  ref {r['reference_us']:9.1f} us  x{r['speedup_vs_reference']:5.2f} "
          f"(back to back x{r['speedup_vs_reference_back_to_back']:5.2f}) | "
          f"{r['GBps']:6.0f} GB/s {r['TFLOPs']:6.1f} TF/s roof {r['roofline_fraction']:5.1%} | best "
          f"{r['best_us']:9.1f} ({r['best_roofline_fraction']:5.1%}) | err {r['rel_err_bf16']:.1e} | alone (us): "
          f"{peers} {r['peers_failed'] or ''}", flush=True)
