"""`triton_call`: a Triton kernel (`@triton.jit`, pointers and constexprs only) called from JAX on the GPU.

Three launchers, timed side by side in `experiments/kernels/bench_kernels.py` (kernels.md, "Launching Triton kernels"); each
kernel module picks its default by that measurement:
- "xla": Triton 3.6 turns the kernel into Triton IR (TTIR) at lowering time; the IR goes into the
  program as XLA's own Triton custom call (`__gpu$xla.gpu.triton`), which XLA compiles into its executable and
  launches like its own kernels. No jax-triton; no host work per call; but XLA's own Triton pipeline compiles the IR,
  and it made the int4_moe kernels 2-3x slower on the H200.
- "jax_triton": `jax_triton.triton_call` (jax-triton 0.3.1), which launches from a host callback that looks its
  kernel up per call: 20-45 us of idle GPU between calls on the H200; Triton 3.6 itself compiles the kernel.
- "ffi": Triton 3.6 compiles the kernel to a cubin at lowering time; the program launches it through this project's
  XLA FFI handler (`triton_ffi.py`): jax-triton's device code with a typed, command-buffer compatible custom call.

All three are usable inside `jax.shard_map` (check_vma). No primitive types its outputs with varying manual axes; a
kernel fed per-device operands gives per-device outputs, and a later psum over a value typed "the same on every
device" would multiply it by the axis size. So the operands are cast to the union of the axes any of them varies
over and the outputs are stated to vary over it (a type cast, no data moves).

The "xla" and "ffi" launchers use jax internals (`jax._src.interpreters.mlir`, jaxlib's Triton dialect), pinned with
jax==0.11.2; tests/test_triton_call.py lowers every Triton kernel through them on the CPU.

Kernel arguments: every operand, then every output, as 16-byte-aligned pointers (XLA's buffers are), then the
constexprs by keyword. Outputs start uninitialised: a kernel writes every element.
"""
from __future__ import annotations

import functools
import io
import re

import jax
import numpy as np
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax.extend import core as jex_core

from pallas_kernels import triton_ffi, varying_axes, vary_over

LAUNCHERS = ("xla", "jax_triton", "ffi")
XLA_TRITON_TARGET = "__gpu$xla.gpu.triton"
TRITON_POINTER_TYPES = {np.dtype(jax.numpy.bfloat16): "*bf16", np.dtype(np.float16): "*fp16",
                        np.dtype(np.float32): "*fp32", np.dtype(np.int32): "*i32", np.dtype(np.uint32): "*u32",
                        np.dtype(np.int8): "*i8", np.dtype(np.uint8): "*u8", np.dtype(np.bool_): "*i1"}
DEFAULT_COMPUTE_CAPABILITY = 90     # the H200's, for lowering on a machine without a GPU (tests)


def triton_call(*operands, kernel, out_shape, grid, num_warps: int, num_stages: int, launcher: str, **constexprs):
    """kernel(*operands, *outputs, **constexprs) on a grid of programs.

    operands: arrays; out_shape: a ShapeDtypeStruct or a tuple of them; grid: up to three ints; launcher: one of
    LAUNCHERS. Returns the output array(s), shaped like out_shape.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r} is not one of {LAUNCHERS}")
    varying = varying_axes(operands)
    operands = [vary_over(x, varying) for x in operands]
    if launcher == "jax_triton":
        outs = _jax_triton(*operands, kernel=kernel, out_shape=out_shape, grid=grid, num_warps=num_warps,
                           num_stages=num_stages, **constexprs)
    else:
        single = isinstance(out_shape, jax.ShapeDtypeStruct)
        out_avals = tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in ([out_shape] if single else out_shape))
        grid = tuple(grid)
        if not 1 <= len(grid) <= 3:
            raise ValueError(f"grid {grid} must have one to three dimensions")
        grid += (1,) * (3 - len(grid))
        typed = tuple(sorted((name, type(value), value) for name, value in constexprs.items()))   # 1, 1.0, True
        outs = triton_kernel_call_p.bind(*operands, kernel=kernel, out_avals=out_avals, grid=grid,
                                         num_warps=num_warps, num_stages=num_stages, constexprs=typed,
                                         launcher=launcher)
        outs = outs[0] if single else tuple(outs)
    return jax.tree.map(lambda y: vary_over(y, varying), outs)


def jax_triton_missing() -> str | None:
    """None where jax-triton imports (the "jax_triton" launcher can run), else why it does not."""
    try:
        import jax_triton  # noqa: F401, PLC0415 (imports only where jaxlib has CUDA support)
    except ImportError as e:
        return f"jax-triton did not import ({e})"
    return None


def bound_to(launcher: str, *, interpret: bool, op: str, reference: str):
    """`triton_call` bound to `launcher`, for the public function `op` of Triton kernels. Triton has no interpret
    mode, so interpret=True is a ValueError that names `reference`, the function to run on the CPU instead."""
    if interpret:
        raise ValueError(f"{op} has no interpret mode (Triton kernels): on the CPU use {reference}")
    return functools.partial(triton_call, launcher=launcher)


def _jax_triton(*operands, kernel, **kwargs):
    missing = jax_triton_missing()
    if missing:
        raise ImportError(f"{getattr(kernel, '__name__', kernel)} was asked to launch through jax-triton: {missing}. "
                          "Install jax-triton==0.3.1 (on the H200 image carry its wheel: BUILD_NOTES.md, 'One H200'), "
                          "or use launcher='xla'")
    import jax_triton   # noqa: PLC0415 (imports only where jaxlib has CUDA support)
    return jax_triton.triton_call(*operands, kernel=kernel, **kwargs)


triton_kernel_call_p = jex_core.Primitive("kdtree_triton_call")   # "xla" and "ffi" (not jax-triton's primitive)
triton_kernel_call_p.multiple_results = True
triton_kernel_call_p.def_abstract_eval(lambda *avals, out_avals, **_: out_avals)


def pointer_types(avals) -> tuple[str, ...]:
    """Triton's pointer type ('*bf16', ...) of each array."""
    types = []
    for aval in avals:
        if np.dtype(aval.dtype) not in TRITON_POINTER_TYPES:
            raise TypeError(f"a Triton kernel operand or output has dtype {aval.dtype}; triton_call passes "
                            f"{sorted(str(d) for d in TRITON_POINTER_TYPES)}: cast it first")
        types.append(TRITON_POINTER_TYPES[np.dtype(aval.dtype)])
    return tuple(types)


def kernel_source(kernel, pointers: tuple[str, ...], constexprs: tuple):
    """Triton's ASTSource of kernel with these argument types: pointers (its first arguments, 16-byte aligned), then
    constexprs, (name, type, value) triples (the type keeps 1, 1.0 and True apart in the caches)."""
    from triton.compiler import ASTSource   # noqa: PLC0415 (Triton is only needed where a kernel is lowered)

    names = kernel.arg_names
    given = [name for name, _, _ in constexprs]
    if len(pointers) + len(constexprs) != len(names) or set(names[len(pointers):]) != set(given):
        raise TypeError(f"{kernel.__name__} takes {len(names)} arguments {names}; it was given {len(pointers)} "
                        f"arrays and constexprs {given} (the arrays must be its first arguments, the constexprs the "
                        "rest)")
    signature = dict(zip(names, pointers)) | {name: "constexpr" for name in given}
    return ASTSource(fn=kernel, signature=signature, constexprs={name: value for name, _, value in constexprs},
                     attrs={(i,): [["tt.divisibility", 16]] for i in range(len(pointers))})


@functools.lru_cache(maxsize=None)
def kernel_ttir(kernel, pointers: tuple[str, ...], constexprs: tuple, num_warps: int, compute_capability: int) -> str:
    """The kernel as Triton IR text after Triton's own TTIR passes (inlining, canonicalisation), its pointers
    16-byte aligned (`kernel_source`). Runs on any machine: nothing here needs a GPU."""
    from triton._C import libtriton   # noqa: PLC0415 (Triton is only needed where a kernel is lowered)
    from triton.backends.compiler import GPUTarget   # noqa: PLC0415
    from triton.backends.nvidia.compiler import CUDABackend   # noqa: PLC0415

    target = GPUTarget("cuda", compute_capability, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({"num_warps": num_warps})
    source = kernel_source(kernel, pointers, constexprs)
    context = libtriton.ir.context()
    libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                            context)
    return str(backend.make_ttir(module, {}, options, compute_capability))


def _compute_capability() -> int:
    gpus = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() == "gpu" else []
    if not gpus:
        return DEFAULT_COMPUTE_CAPABILITY
    return int(float(gpus[0].compute_capability) * 10)


def _entry_name(text: str) -> str:
    """The name of the Triton IR's public function, which XLA launches."""
    names = re.findall(r"tt\.func public @([\w$.]+)", text)
    if len(names) != 1:
        raise ValueError(f"the Triton IR has {len(names)} public functions {names}; XLA launches exactly one")
    return names[0]


@functools.lru_cache(maxsize=None)
def _ttir_bytecode(text: str) -> bytes:
    """Triton IR text parsed in jaxlib's Triton dialect (XLA's Triton) and written as MLIR bytecode, once per kernel
    variant (each jit of an op lowers its kernels again)."""
    context = mlir.JaxIrContext()
    context.append_dialect_registry(mlir.upstream_dialects)
    tt_dialect.register_dialect(context)
    context.load_all_available_dialects()
    with context:
        module = ir.Module.parse(text)
        buffer = io.BytesIO()
        module.operation.write_bytecode(buffer)
    return buffer.getvalue()


@functools.lru_cache(maxsize=None)
def kernel_cubin(kernel, pointers: tuple[str, ...], constexprs: tuple, num_warps: int, num_stages: int,
                 compute_capability: int) -> triton_ffi.CompiledCubin:
    """The kernel compiled by Triton for sm_<compute_capability> (`kernel_source`'s arguments), as the "ffi" launcher
    loads it. Runs on any machine: Triton's ptxas needs no GPU."""
    return triton_ffi.compile_cubin(kernel_source(kernel, pointers, constexprs), num_warps, num_stages,
                                    compute_capability)


def _triton_kernel_lowering(ctx, *operands, kernel, out_avals, grid, num_warps, num_stages, constexprs, launcher):
    pointers = pointer_types([*ctx.avals_in, *ctx.avals_out])
    grid_attrs = dict(grid_x=mlir.i32_attr(grid[0]), grid_y=mlir.i32_attr(grid[1]), grid_z=mlir.i32_attr(grid[2]))
    if launcher == "ffi":
        compiled = kernel_cubin(kernel, pointers, constexprs, num_warps, num_stages, _compute_capability())
        target = triton_ffi.target_name()
        backend_config = dict(grid_attrs, name=ir.StringAttr.get(compiled.name),
                              num_warps=mlir.i32_attr(compiled.num_warps),
                              cubin=ir.StringAttr.get(compiled.cubin),
                              cubin_hash=ir.IntegerAttr.get(ir.IntegerType.get_signless(64), compiled.cubin_hash),
                              shared_mem=mlir.i32_attr(compiled.shared_mem))
    else:
        text = kernel_ttir(kernel, pointers, constexprs, num_warps, _compute_capability())
        target = XLA_TRITON_TARGET
        backend_config = dict(grid_attrs, name=ir.StringAttr.get(_entry_name(text)),
                              ir=ir.StringAttr.get(_ttir_bytecode(text)), num_stages=mlir.i32_attr(num_stages),
                              num_warps=mlir.i32_attr(num_warps),
                              debug=ir.BoolAttr.get(False))
    result_types = [mlir.aval_to_ir_type(ctx.module_context, a) for a in out_avals]
    return mlir.custom_call(target, result_types=result_types, operands=list(operands),
                            backend_config=backend_config, api_version=4, operand_layouts=_row_major(ctx.avals_in),
                            result_layouts=_row_major(out_avals)).results


def _row_major(avals) -> list[list[int]]:
    return [list(reversed(range(a.ndim))) for a in avals]


mlir.register_lowering(triton_kernel_call_p, _triton_kernel_lowering, platform="cuda")
