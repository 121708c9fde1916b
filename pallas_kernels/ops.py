"""Dispatch of each op to its GPU kernel (Triton through `triton_call`, or Mosaic GPU) or its pure-JAX reference.

    set_implementation("auto" | "kernel" | "reference", interpret=None)
    with implementation("kernel", interpret=True): ...   # tests: the kernels in interpret mode on the CPU

"auto" runs the kernels when JAX's default backend is the GPU and the references elsewhere. `interpret=None` runs a
kernel in interpret mode exactly when the default backend is not the GPU. The choice is read when a function is
traced: a jitted caller keeps the implementation it was traced with. The Triton kernels (int4_moe's, tree_build,
tree_accept, the attention where Mosaic GPU does not take it) and the Mosaic GPU int4_moe have no interpret mode
here: in interpret mode those ops run their references (int4_moe and the tree ops also off the GPU); their CPU tests
run them in Triton's interpreter and Mosaic GPU's. tree_verify_attention and int4_moe have two kernels each, chosen
per call by `attention_backend` and `int4_moe_backend`.

A kernel is added with one `_register` line and a thin public function calling `_call`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import jax

from pallas_kernels import int4_moe as _int4_moe
from pallas_kernels import int4_moe_mgpu as _int4_moe_mgpu
from pallas_kernels import int4_moe_triton as _int4_moe_triton
from pallas_kernels import router_topk as _router_topk
from pallas_kernels import skinny_matmul as _skinny_matmul
from pallas_kernels import tree_accept as _tree_accept
from pallas_kernels import tree_build as _tree_build
from pallas_kernels import tree_triton as _tree_triton
from pallas_kernels import tree_verify_attention as _attention
from pallas_kernels import tree_verify_attention_mgpu as _attention_mgpu
from pallas_kernels import tree_verify_attention_triton as _attention_triton
from pallas_kernels.tree_verify_attention import TreeVerifyPlan

IMPLEMENTATIONS = ("auto", "kernel", "reference")

_settings = {"implementation": "auto", "interpret": None}
_tiling = {"int4_moe": {}}  # a benchmark's fields of the Triton int4_moe's tiling, over its default_config's
_dense = {"kernel": False}  # the dense products through skinny_matmul (`set_dense_kernel`; off until measured)
_router = {"kernel": False}  # the router's top-k through router_topk (`set_router_kernel`; off until measured)
_registry: dict[str, tuple[Callable, Callable, bool]] = {}


def _register(name: str, kernel: Callable, reference: Callable, *, interpretable: bool = True) -> None:
    """kernel(*args, interpret=bool, **kwargs) and reference(*args, **kwargs) compute the same function. A kernel
    that is not `interpretable` (Triton: no interpret mode; jax-triton needs a CUDA jaxlib) runs
    only on the GPU backend; in interpret mode or on another backend its reference runs."""
    _registry[name] = (kernel, reference, interpretable)


def attention_backend(q_lat, q_rope, c_kv, k_rope) -> str:
    """The kernel `tree_verify_attention` runs for these operands: "mosaic_gpu" where its 64-row tile fits
    (`tree_verify_attention_mgpu.fits`), else "triton". Measured: kernels.md, "Eighth session"."""
    return "mosaic_gpu" if _attention_mgpu.fits(q_lat, q_rope, c_kv, k_rope) else "triton"


def _attention_kernel(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, plan, *, scale: float, interpret: bool):
    """tree_verify_attention's kernel (`attention_backend`); the Triton one has no interpret mode (the reference
    runs there)."""
    args = (q_lat, q_rope, c_kv, k_rope, prefix_len, visible)
    if attention_backend(q_lat, q_rope, c_kv, k_rope) == "mosaic_gpu":
        bias = None if plan is None else plan.frame_bias
        return _attention_mgpu.tree_verify_attention(*args, scale=scale, bias=bias, interpret=interpret)
    if interpret:
        return _attention.tree_verify_attention_reference(*args, scale=scale)
    return _attention_triton.tree_verify_attention(*args, scale=scale)


def _attention_reference(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, plan, *, scale: float):
    """tree_verify_attention's reference (it needs no plan)."""
    del plan
    return _attention.tree_verify_attention_reference(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, scale=scale)


# Measured against the Pallas-Triton kernel they replace: kernels.md, "Eighth session".
_register("tree_verify_attention", _attention_kernel, _attention_reference)


def int4_moe_backend(x, experts: _int4_moe.Int4Experts, topk_ids, routed_experts: int | None = None) -> str:
    """The kernel `int4_moe` runs for these operands: "mosaic_gpu" where the Mosaic GPU op takes them and the GEMMs
    are dense (`int4_moe_mgpu.fits` and `prefers`: M >= 1920 at K2.6), else "triton". routed_experts: the experts
    the ids are drawn from (all devices' under expert parallelism, where `experts` holds a slice and most pairs are
    another device's); default experts.num_experts. Measured: kernels.md, "Sixteenth session"."""
    dense = _int4_moe_mgpu.prefers(topk_ids.size, _routed(experts, routed_experts))
    return "mosaic_gpu" if dense and _int4_moe_mgpu.fits(x, experts) else "triton"


def _routed(experts: _int4_moe.Int4Experts, routed_experts: int | None) -> int:
    """The experts the ids are drawn from: routed_experts, never fewer than this device's (a smaller count would
    undercount the routed blocks the kernels' grids are sized for)."""
    return max(routed_experts or 0, experts.num_experts)


def int4_moe_config(x, experts: _int4_moe.Int4Experts, topk_ids, routed_experts: int | None = None):
    """The tiling `int4_moe_backend`'s kernel runs with: that kernel's `default_config` by the pairs per routed
    expert (`int4_moe_mgpu.MgpuMatmulConfig` or `int4_moe_triton.TritonMoeConfig`)."""
    pairs, routed = topk_ids.size, _routed(experts, routed_experts)
    if int4_moe_backend(x, experts, topk_ids, routed_experts) == "mosaic_gpu":
        return _int4_moe_mgpu.default_config(pairs, routed)
    return dataclasses.replace(_int4_moe_triton.default_config(pairs, routed), **_tiling["int4_moe"])


def set_int4_moe_tiling(**fields) -> None:
    """Override fields of the Triton int4_moe's tiling (`TritonMoeConfig`, e.g. gate_up_splits=2, or fma=True,
    block_m=1, block_n=32) over its default_config's, for calls traced from now on, to measure them in a whole step
    (bench_k26 --moe_tiling); no fields restore the default tiling. Refuses fields the kernel does not take."""
    check_int4_moe_tiling(**fields)
    _tiling["int4_moe"] = fields


def check_int4_moe_tiling(**fields) -> None:
    """Raise (TypeError / ValueError, naming the field) where `set_int4_moe_tiling` would refuse these fields."""
    dataclasses.replace(_int4_moe_triton.default_config(1, 1), **fields)


def _int4_moe_kernel(x, experts, topk_ids, topk_weights, *, interpret: bool, routed_experts: int | None):
    """int4_moe's kernel (`int4_moe_backend`) at `int4_moe_config`; neither has an interpret mode here (the
    reference runs there)."""
    config = int4_moe_config(x, experts, topk_ids, routed_experts)
    if int4_moe_backend(x, experts, topk_ids, routed_experts) == "mosaic_gpu":
        return _int4_moe_mgpu.int4_moe(x, experts, topk_ids, topk_weights, config=config)
    return _int4_moe_triton.int4_moe(x, experts, topk_ids, topk_weights, interpret=interpret, config=config)


def _int4_moe_reference(x, experts, topk_ids, topk_weights, *, routed_experts: int | None):
    del routed_experts                                  # the kernels' choice only
    return _int4_moe.int4_moe_reference(x, experts, topk_ids, topk_weights)


# Measured: experiments/notes/kernels.md, "int4_moe in Triton" and "Sixteenth session"; the CPU tests compile the
# Triton kernels for sm_90 and interpret them, and run the Mosaic GPU op in its interpret mode.
_register("int4_moe", _int4_moe_kernel, _int4_moe_reference, interpretable=False)
# Measured against the Pallas-Triton kernels they replace: kernels.md, "Launching Triton kernels".
_register("tree_build", _tree_triton.tree_build, _tree_build.tree_build_reference, interpretable=False)
_register("tree_accept", _tree_triton.tree_accept, _tree_accept.tree_accept_reference, interpretable=False)


def set_implementation(implementation: str = "auto", interpret: bool | None = None) -> None:
    """Choose kernels or references for every op (see the module docstring)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    _settings.update(implementation=implementation, interpret=interpret)


@contextlib.contextmanager
def implementation(name: str, interpret: bool | None = None):
    """Context manager form of `set_implementation`; restores the previous choice on exit."""
    saved = dict(_settings)
    set_implementation(name, interpret)
    try:
        yield
    finally:
        _settings.update(saved)


def uses_kernel() -> bool:
    """Whether an op traced now runs its kernel."""
    choice = _settings["implementation"]
    return choice == "kernel" or (choice == "auto" and jax.default_backend() == "gpu")


def _compiled_on_gpu() -> bool:
    """Whether a Triton kernel traced now runs compiled on the GPU (kernels chosen, not interpreted, the GPU
    backend): the condition of the opt-in kernels (`dense_takes`, `exact_dense_takes`, `router_takes`)."""
    return uses_kernel() and not interprets() and jax.default_backend() == "gpu"


def interprets() -> bool:
    """Whether an op traced now runs its kernel in interpret mode (on the CPU, in tests)."""
    interpret = _settings["interpret"]
    return uses_kernel() and (jax.default_backend() != "gpu" if interpret is None else interpret)


def _call(name: str, *args, **kwargs):
    kernel, reference, interpretable = _registry[name]
    if not uses_kernel() or (not interpretable and (interprets() or jax.default_backend() != "gpu")):
        return reference(*args, **kwargs)
    return kernel(*args, interpret=interprets(), **kwargs)


def tree_verify_attention(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, plan: TreeVerifyPlan | None = None, *,
                          scale: float):
    """q_lat [S, T, H, C], q_rope [S, T, H, R], c_kv [S, N, C], k_rope [S, N, R], prefix_len [S], visible [S, T, T]
    -> [S, T, H, C]. plan: `tree_verify_plan(prefix_len, visible, num_heads=H)`, made once for all the calls of a
    forward (None: each call makes its own). See pallas_kernels/tree_verify_attention.py (the op) and its kernels
    tree_verify_attention_mgpu.py / tree_verify_attention_triton.py (`attention_backend` picks)."""
    if plan is not None:
        if not isinstance(plan, TreeVerifyPlan):
            raise TypeError(f"tree_verify_attention: plan must be a TreeVerifyPlan (`tree_verify_plan`) or None, got "
                            f"{type(plan).__name__}")
        _, t, h, _ = q_lat.shape
        if (plan.num_heads, plan.num_nodes) != (h, t):
            raise ValueError(f"tree_verify_attention: the plan was built for num_heads={plan.num_heads} and "
                             f"T={plan.num_nodes} tree nodes, the call has H={h} heads and T={t} nodes; build it "
                             f"from the call's visible with the call's heads (each device's under head parallelism)")
    return _call("tree_verify_attention", q_lat, q_rope, c_kv, k_rope, prefix_len, visible, plan, scale=scale)


def tree_verify_plan(prefix_len, visible, *, num_heads: int) -> TreeVerifyPlan:
    """prefix_len [S], visible [S, T, T] -> the `TreeVerifyPlan` of the forward's `tree_verify_attention` calls with
    num_heads heads each: the Mosaic GPU kernel's frame bias where kernels run and its tile takes T x num_heads rows,
    else nothing. The plan does not see the calls' cache or dtypes: a call that then picks the Triton kernel (another
    latent width, f32, a cache not in whole 64-row blocks) leaves the bias unused, which XLA drops under jit and
    which an eager caller has computed for nothing. Read, like the calls' choice of kernel, when traced."""
    t = visible.shape[1]
    bias = None
    if uses_kernel() and _attention_mgpu.takes_rows(t * num_heads):
        bias = _attention_mgpu.frame_bias(prefix_len, visible, num_heads, _attention_mgpu.padded_rows(t * num_heads))
    return TreeVerifyPlan(num_heads, t, bias)


def int4_moe(x, experts: _int4_moe.Int4Experts, topk_ids, topk_weights, *, routed_experts: int | None = None):
    """x [M, D], topk_ids [M, K], topk_weights [M, K] -> [M, D]. See pallas_kernels/int4_moe.py (the op, its layout,
    reference and routing) and its kernels int4_moe_triton.py / int4_moe_mgpu.py (`int4_moe_backend` picks, with
    routed_experts the experts the ids are drawn from under expert parallelism)."""
    return _call("int4_moe", x, experts, topk_ids, topk_weights, routed_experts=routed_experts)


def set_dense_kernel(on: bool = False) -> None:
    """Run the model's dense products of few rows through `skinny_matmul` (on) or XLA (off, the default: faster in
    the step so far, bench_k26 --dense_kernel), for calls traced from now on."""
    _dense["kernel"] = bool(on)


def dense_takes(x, w) -> bool:
    """Whether `dense` runs the kernel for x [..., K] @ w^T, w [N, K]: set_dense_kernel(True), kernels running on the
    GPU, one dtype, and the shapes the kernel is built for (`bench_kernels --sections=skinny`, the tp=8 share's
    products): at most MAX_DENSE_ROWS rows and K >= MIN_DENSE_K. (A Triton call has no GSPMD partitioning: the
    caller keeps sharded products on XLA.)"""
    rows = x.size // x.shape[-1]
    return (_dense["kernel"] and _compiled_on_gpu() and 0 < rows <= MAX_DENSE_ROWS and x.shape[-1] >= MIN_DENSE_K
            and x.shape[-1] % 64 == 0 and x.dtype == w.dtype)


def exact_dense_takes(x, w) -> bool:
    """Whether the exact mode's products (`batch_invariant.matmul`, x [M, K] @ w^T, w [N, K]) run as one skinny_matmul:
    kernels running compiled on the GPU, one dtype (bf16 or f32), K a multiple of 64, nothing partitioned (a Triton
    call has no GSPMD partitioning: `unpartitioned`). Any M: the kernel's order along K does not depend on it. Not
    behind `set_dense_kernel`: the exact mode's other path is a loop of 64-row tiles (decode.md, "Exact mode")."""
    return exact_kernels_take(x, w) and x.shape[0] > 0 and x.shape[-1] % 64 == 0


def exact_kernels_take(*operands) -> bool:
    """Whether the exact mode's norms, head products, attention and routed experts run their Triton kernels
    (`batch_invariant_triton`):
    kernels running compiled on the GPU, operands of one dtype (bf16 or f32), nothing partitioned (a Triton call has
    no GSPMD partitioning: `unpartitioned`)."""
    dtypes = {x.dtype for x in operands}
    return (_compiled_on_gpu() and len(dtypes) == 1 and dtypes.pop() in _skinny_matmul.FLOATS
            and unpartitioned())


def unpartitioned() -> bool:
    """No mesh, or every axis GSPMD could partition a Triton call over (those not manual: outside a shard_map, all;
    inside one, the others) of size 1: a one-device mesh, a shard_map over every axis of size > 1. (bench_k26 runs
    tp=1 under a one-device mesh: with `empty` alone as the test, its exact forward ran the XLA references, 5.7-22x
    the default step at K2.6's shapes; k26.md, "Exact mode at K2.6's shapes")."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or math.prod(size for axis, size in mesh.shape.items() if axis not in mesh.manual_axes) == 1


# One 16-row tile: each further tile re-reads the weight (busy time of the layer's products on an H100: 95 us at
# M = 1 and 8, 146 at 33, 155 at 64), and products with K < 512 (the shared expert's down, K = 256) leave too few K
# steps to split. Off by default: in device time XLA's fusions were faster (54 and 42 us at M = 1 and 8), and the
# share at 61 layers 2.3 ms slower with the kernel (experiments/notes/k26.md, "skinny_matmul in the step").
MAX_DENSE_ROWS = 16
MIN_DENSE_K = 512


def dense(x, w, *, norm_weight=None, eps: float = 1e-6, residual=None, out_dtype=None):
    """x [..., K] @ w^T, w [N, K] -> [..., N] as one `skinny_matmul` (call where `dense_takes`): the RMSNorm of x by
    norm_weight [K] fused, residual [..., N] added in the epilogue, out_dtype default x's."""
    lead, k, n = x.shape[:-1], x.shape[-1], w.shape[0]
    residual = None if residual is None else residual.reshape(-1, n)
    y = _skinny_matmul.skinny_matmul(x.reshape(-1, k), w, norm_weight=norm_weight, eps=eps, residual=residual,
                                     out_dtype=out_dtype)
    return y.reshape(*lead, n)


def set_router_kernel(on: bool = False) -> None:
    """Run the MoE router's sigmoid, top-k and weights as one `router_topk` kernel (on) or XLA's ops (off, the default
    until the kernel is measured in the step: bench_k26 --router_kernel), for calls traced from now on."""
    _router["kernel"] = bool(on)


def router_takes() -> bool:
    """Whether the router runs `router_topk`: set_router_kernel(True) and kernels running on the GPU. (A Triton call
    has no GSPMD partitioning: the caller keeps a tp-sharded router on XLA.)"""
    return _router["kernel"] and _compiled_on_gpu()


def router_topk(logits, bias, k: int, *, normalize: bool, scale: float):
    """logits [M, E] f32 (the router's product), bias [E] f32 -> (ids [M, k] int32, weights [M, k] f32) as one
    Triton kernel (call where `router_takes`). See pallas_kernels/router_topk.py."""
    return _router_topk.router_topk(logits, bias, k, normalize=normalize, scale=scale)


def tree_build(draft_logits, root, budget: int, topk: int | None = None):
    """draft_logits [S, D, V], root [S] -> TreeArrays with B + 1 slots. See pallas_kernels/tree_build.py (the op)
    and pallas_kernels/tree_triton.py (the GPU kernel)."""
    return _call("tree_build", draft_logits, root, budget, topk)


def tree_accept(tree, target_tokens, max_depth: int):
    """TreeArrays, target_tokens [S, B+1] -> AcceptResult. See pallas_kernels/tree_accept.py (the op) and
    pallas_kernels/tree_triton.py (the GPU kernel)."""
    return _call("tree_accept", tree, target_tokens, max_depth)


Int4Experts = _int4_moe.Int4Experts
