"""The MoE router after its product, as one Triton kernel: sigmoid scores, the top-k experts by score + bias, their
unbiased scores as weights, normalised and scaled (DeepSeek-V3's `noaux_tc` with n_group = 1, `moe.route`).

Why: XLA runs this as a few kernels a layer (the sigmoid, a sort of each row for the top-k, the gather and the
normalisation; the sorts alone 5.6 us a MoE layer in the tp=8 share's profile, experiments/notes/k26.md, "Kernels
per layer of the share"). Here one program takes one row: the scores as a vector over the experts (a power of two
of lanes, the ones past E at -inf), k rounds of argmax-and-mask, and the weights added in slot order.

The same function as `router_topk_reference` up to the sigmoid's rounding (Triton's exp against XLA's logistic; the
normalising division is correctly rounded, `div_rn`): ties in score + bias go to the lower expert id, as `lax.top_k`
does, and every id is picked once, also when fewer than k experts have a finite score; the normalising sum runs
left to right over the k slots (`slot_sum`). Each row is its own program, so a row's result does not depend on M or
on the other rows (the exact mode's property).

On the CPU the kernel runs in Triton's interpreter (tests/test_router_topk_interpreter.py) and lowers for sm_90
(tests/test_triton_call.py); the GPU test is in tests/test_kernels_gpu.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.triton_call import bound_to

LAUNCHER = "xla"  # XLA's own Triton custom call: no wheel, no host work per call (the tree kernels' choice)


def slot_sum(x):
    """x [..., k] -> [...]: the k entries added left to right, whatever the leading shape (few: top-k slots)."""
    out = x[..., 0]
    for j in range(1, x.shape[-1]):
        out = out + x[..., j]
    return out


def router_topk_reference(logits, bias, k: int, *, normalize: bool = True, scale: float = 1.0):
    """logits [M, E] (the router's product, f32), bias [E] (selection only) -> (ids [M, k] int32, weights [M, k]
    f32): scores = sigmoid(logits); ids = top-k of scores + bias (descending, ties to the lower id); weights = the
    ids' scores, divided by their sum (+ 1e-20; the k slots added left to right, whatever M) with `normalize`, times
    `scale`. The model's router after its product (`moe.route`)."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    _, ids = jax.lax.top_k(scores + bias.astype(jnp.float32), k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (slot_sum(weights)[..., None] + 1e-20)
    return ids.astype(jnp.int32), weights * scale


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, E: tl.constexpr, LANES: tl.constexpr,
                   K: tl.constexpr, SLOTS: tl.constexpr, NORMALIZE: tl.constexpr, SCALE: tl.constexpr):
    """Row r: logits [M, E] f32, bias [E] f32 -> ids [M, K] int32, weights [M, K] f32 (LANES >= E and SLOTS >= K:
    powers of two)."""
    r = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, LANES)
    ok = lane < E
    x = tl.load(logits_ptr + r * E + lane, mask=ok, other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-x))
    choice = tl.where(ok, scores + tl.load(bias_ptr + lane, mask=ok, other=0.0), float("-inf"))
    free = ok                                                              # experts not yet picked
    slot = tl.arange(0, SLOTS)
    ids = tl.zeros((SLOTS,), tl.int32)
    weights = tl.zeros((SLOTS,), tl.float32)
    for j in tl.static_range(K):
        best = tl.max(tl.where(free, choice, float("-inf")), axis=0)
        pick = tl.min(tl.where(free & (choice >= best), lane, LANES), axis=0)   # the lowest free id among ties
        pick = tl.where(pick < LANES, pick, tl.min(tl.where(free, lane, LANES), axis=0))  # NaN rows: the first free
        ids = tl.where(slot == j, pick, ids)
        weights = tl.where(slot == j, tl.sum(tl.where(lane == pick, scores, 0.0), axis=0), weights)
        free = free & (lane != pick)
    if NORMALIZE:
        total = tl.sum(tl.where(slot == 0, weights, 0.0), axis=0)
        for j in tl.static_range(1, K):
            total += tl.sum(tl.where(slot == j, weights, 0.0), axis=0)
        weights = tl.math.div_rn(weights, tl.full((SLOTS,), 1.0, tl.float32) * (total + 1e-20))
    tl.store(ids_ptr + r * K + slot, ids, mask=slot < K)
    tl.store(weights_ptr + r * K + slot, weights * SCALE, mask=slot < K)


def check_inputs(logits, bias, k: int) -> None:
    """Raises ValueError naming the mismatch and the fix."""
    if logits.ndim != 2 or bias.shape != (logits.shape[1],):
        raise ValueError(f"router_topk takes logits [M, E] and bias [E]; got {logits.shape} and {bias.shape}")
    if logits.dtype != jnp.float32 or bias.dtype != jnp.float32:
        raise ValueError(f"router_topk takes float32 logits and bias (the router runs in f32); got {logits.dtype}, "
                         f"{bias.dtype}: cast them first")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"router_topk: k = {k} experts a token must lie in [1, E = {logits.shape[1]}]")
    if logits.shape[0] == 0:
        raise ValueError("router_topk: logits have no rows; skip the call")


def run_kernel(call, logits, bias, k: int, *, normalize: bool = True, scale: float = 1.0):
    """The host side: check, then one launch of one program per row through `call(*operands, kernel=, out_shape=,
    grid=, num_warps=, num_stages=, **constexprs)` (`triton_call` on the GPU; Triton's interpreter in the tests).
    Shapes as `router_topk_reference`."""
    check_inputs(logits, bias, k)
    m, e = logits.shape
    return call(logits, bias, kernel=_router_kernel,
                out_shape=(jax.ShapeDtypeStruct((m, k), jnp.int32), jax.ShapeDtypeStruct((m, k), jnp.float32)),
                grid=(m,), num_warps=4, num_stages=1, E=e, LANES=triton.next_power_of_2(e), K=k,
                SLOTS=triton.next_power_of_2(k),
                NORMALIZE=bool(normalize), SCALE=float(scale))


def router_topk(logits, bias, k: int, *, normalize: bool = True, scale: float = 1.0, launcher: str = LAUNCHER):
    """`router_topk_reference` as one Triton kernel on the GPU."""
    return _router_topk(logits, bias, k=int(k), normalize=bool(normalize), scale=float(scale), launcher=launcher)


@functools.partial(jax.jit, static_argnames=("k", "normalize", "scale", "launcher"))
def _router_topk(logits, bias, *, k, normalize, scale, launcher):
    call = bound_to(launcher, interpret=False, op="router_topk.router_topk",
                    reference="router_topk.router_topk_reference")
    return run_kernel(call, logits, bias, k, normalize=normalize, scale=scale)
