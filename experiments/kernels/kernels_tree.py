"""bench_kernels section `tree`: tree_build and tree_accept at S = 16 streams, D = 15, V = 163840, B = 16..512: the
Triton kernels (pallas_kernels/tree_triton.py, launched through XLA's Triton custom call as `ops` does), the jnp
reference, and the CPU heap per request that the paper's code uses (timed by wall clock since it crosses the host);
on the GPU also the same kernels launched by jax-triton (`jax_triton_*`). On the CPU (--quick) the references stand
in for the kernels: a smoke run of the script. The Pallas-Triton kernels were timed beside them up to
results/kernels/kernels.json of the seventh session, then removed. Every tree is checked
bit-identical to the heapq specification and every accept walk to the python loop (`identical_detail`,
`accept_identical_detail` name each candidate).

    cases      budgets B over one shape (tree_shapes): draft logits [S,D,V] f32 N(0, 4^2), root tokens [S]
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.timing import Job, rotation_sets, time_jobs, wall_us
from pallas_kernels import ops
from pallas_kernels import tree_triton
from pallas_kernels.triton_call import jax_triton_missing
from pallas_kernels.tree import (TreeArrays, accept_tree, accept_tree_python, build_tree_from_topk,
                                 build_tree_heapq_from_topk, draft_topk, resolve_topk)

TREE_BLOCK = 16             # L: the root plus D = L - 1 drafted depths
DRAFT_LOGIT_SCALE = 4.0     # random draft logits N(0, 4^2): a few tokens carry most of each depth's mass
ACCEPT_FOLLOW = 0.8         # chance that the target's token at a node is one of the node's children's


def tree_shapes(quick: bool) -> tuple[dict, tuple[int, ...]]:
    """(streams, depth, vocab) and the budgets B; `quick`: small ones, for a CPU smoke run."""
    if quick:
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


def tree_case(shape: dict, budget: int, logit_sets, rng: np.random.Generator, interpret: bool, reps: int) -> dict:
    """Build (kernel, reference, heap peer) and accept (kernel, reference) at one budget; bit-identity checks."""
    depth, vocab = shape["depth"], shape["vocab"]
    k = resolve_topk(budget, vocab)
    topk_fn = jax.jit(lambda logits: draft_topk(logits, k))
    topk_sets = [(*topk_fn(logits), root) for logits, root in logit_sets]
    peer, specs = time_heap_peer(topk_fn, logit_sets, budget, reps)
    # The kernels: Triton through XLA's launcher (ops' choice); on the CPU smoke run the references stand in (a
    # Triton kernel has no interpret mode); on the GPU also the same kernels launched by jax-triton.
    peers = not interpret and jax_triton_missing() is None
    kernel_build = build_tree_from_topk if interpret else tree_triton.tree_build_from_topk
    builds = {"kernel_from_topk": jax.jit(functools.partial(kernel_build, budget=budget)),
              "reference_from_topk": jax.jit(functools.partial(build_tree_from_topk, budget=budget)),
              "kernel_from_logits": _ops_tree_build("kernel", budget, logit_sets[0]),
              "reference_from_logits": _ops_tree_build("reference", budget, logit_sets[0])}
    if peers:
        builds["jax_triton_from_topk"] = jax.jit(functools.partial(tree_triton.tree_build_from_topk, budget=budget,
                                                                   launcher="jax_triton"))
    identical = {name: all(same_arrays(fn(*args), spec)
                           for args, spec in zip(topk_sets if name.endswith("topk") else logit_sets, specs))
                 for name, fn in builds.items()}
    accept_sets = [(TreeArrays(*map(jnp.asarray, spec)), jnp.asarray(walk_targets(rng, spec, vocab))) for spec in specs]
    walks = [accept_tree_python(spec, target, depth) for spec, (_, target) in zip(specs, accept_sets)]
    kernel_accept = accept_tree if interpret else tree_triton.tree_accept
    accepts = {"accept_kernel": jax.jit(functools.partial(kernel_accept, max_depth=depth)),
               "accept_reference": jax.jit(functools.partial(accept_tree, max_depth=depth))}
    if peers:
        accepts["accept_jax_triton"] = jax.jit(functools.partial(tree_triton.tree_accept, max_depth=depth,
                                                                 launcher="jax_triton"))
    accept_identical = {name: all(same_arrays(fn(*args), walk) for args, walk in zip(accept_sets, walks))
                        for name, fn in accepts.items()}   # every candidate; the headline is the ops kernel's
    jobs = [Job(name, fn, topk_sets if name.endswith("topk") else logit_sets) for name, fn in builds.items()]
    full_sort_fn = jax.jit(lambda logits: draft_topk(logits, k, chunk=0))
    topk_identical = all(same_arrays(topk_fn(logits), full_sort_fn(logits)) for logits, _ in logit_sets)
    jobs += [Job("topk", topk_fn, [(logits,) for logits, _ in logit_sets]),
             Job("topk_full_sort", full_sort_fn, [(logits,) for logits, _ in logit_sets])]
    jobs += [Job(name, fn, accept_sets) for name, fn in accepts.items()]
    t = time_jobs(jobs, reps)
    kernel_us, end_to_end_wall = t["kernel_from_topk"]["us"], wall_us(builds["kernel_from_logits"], logit_sets, reps)
    peer_after_topk = peer["d2h"] + peer["heap"] + peer["h2d"]
    build_kernel = [us for name, us in t["kernel_from_topk"].get("kernels_us", {}).items() if "_build_kernel" in name]
    return dict(shape, budget=budget, topk=k, input_sets=len(logit_sets),
                identical=identical["kernel_from_topk"] and identical["kernel_from_logits"],
                identical_detail=identical,
                accept_identical=accept_identical["accept_kernel"] and accept_identical["accept_reference"],
                accept_identical_detail=accept_identical,
                mean_accepted=float(np.mean([w.num_accepted for w in walks])),
                kernel_from_topk_us=kernel_us, build_kernel_us=build_kernel[0] if build_kernel else None,
                reference_from_topk_us=t["reference_from_topk"]["us"],
                kernel_from_logits_us=t["kernel_from_logits"]["us"],
                reference_from_logits_us=t["reference_from_logits"]["us"], topk_us=t["topk"]["us"],
                topk_full_sort_us=t["topk_full_sort"]["us"], topk_identical_to_full_sort=topk_identical,
                accept_kernel_us=t["accept_kernel"]["us"], accept_reference_us=t["accept_reference"]["us"],
                jax_triton_from_topk_us=t.get("jax_triton_from_topk", {}).get("us"),
                accept_jax_triton_us=t.get("accept_jax_triton", {}).get("us"),
                peer_us=peer["total"], peer_stages_us=peer, peer_after_topk_us=peer_after_topk,
                peer_over_kernel=peer_after_topk / kernel_us, meets_50x=peer_after_topk / kernel_us >= 50,
                kernel_from_logits_wall_us=end_to_end_wall, peer_over_kernel_end_to_end=peer["total"] / end_to_end_wall,
                reference_over_kernel=t["reference_from_topk"]["us"] / kernel_us,
                timing_method=t["kernel_from_topk"]["method"], timings=t)


def run_tree(results: list, checks: dict, deadline: float, reps: int, quick: bool, save) -> None:
    """One row per budget (tree_case) appended to `results`, printed, then `save()`; no new budget past `deadline`
    (time.time()); checks["tree_identical"]: every tree, accept walk and top-K identical to its specification."""
    interpret = jax.default_backend() != "gpu"
    shape, budgets = tree_shapes(quick)
    s, d, v = shape["streams"], shape["depth"], shape["vocab"]
    n_sets = rotation_sets(4.0 * s * d * v, 8)
    rng = np.random.default_rng(5)
    logit_sets = [(jax.random.normal(jax.random.key(500 + i), (s, d, v)) * DRAFT_LOGIT_SCALE,
                   jnp.asarray(rng.integers(0, v, s), jnp.int32)) for i in range(n_sets)]
    for budget in budgets:
        if time.time() > deadline:
            results.append(dict(shape, budget=budget, skipped="time budget"))
            continue
        try:
            entry = tree_case(shape, budget, logit_sets, rng, interpret, reps)
        except Exception as e:  # noqa: BLE001 - record the failure and go on with the other cases
            entry = dict(shape, budget=budget, error=f"{type(e).__name__}: {str(e)[:2000]}")
        results.append(entry)
        _print_tree_row(entry)
        save()
    done = [r for r in results if "identical" in r]
    checks["tree_identical"] = bool(done) and all(r["identical"] and r["accept_identical"]
                                                  and r["topk_identical_to_full_sort"] for r in done)



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
          f"{r['accept_kernel_us']:.1f} (ref {r['accept_reference_us']:.1f}) | launched by jax-triton: build "
          f"{r['jax_triton_from_topk_us']} accept {r['accept_jax_triton_us']} | identical {r['identical']} "
          f"accept {r['accept_identical']}", flush=True)

