"""`triton_call`: a Triton kernel called from JAX through jax-triton, usable inside `jax.shard_map` (check_vma).

jax-triton's primitive types its outputs without varying manual axes. Inside a shard_map that type says "the same on
every device", which is false for a kernel fed per-device operands, and a later psum over such a value would
multiply it by the axis size instead of adding the devices' values. So, like `pallas_kernels.pallas_call`, the
operands are cast to the union of the axes any of them varies over and the outputs are stated to vary over it (a
type cast, no data moves). Outside shard_map nothing varies and this is `jax_triton.triton_call`.

jax-triton imports only where jaxlib has CUDA support, so it is imported at the first call, not with this module.
"""
from __future__ import annotations

import jax

from pallas_kernels import varying_axes, vary_over


def triton_call(*operands, kernel, out_shape, **kwargs):
    """`jax_triton.triton_call(*operands, kernel=kernel, out_shape=out_shape, **kwargs)` with varying axes stated.

    operands: arrays (pointers in the kernel, in order, followed by the outputs); out_shape: a ShapeDtypeStruct or a
    pytree of them; kwargs: grid, num_warps, num_stages and the kernel's constexpr parameters.
    """
    try:
        import jax_triton   # noqa: PLC0415 (CUDA-only import, see the module docstring)
    except ImportError as e:
        raise ImportError(f"{getattr(kernel, '__name__', kernel)} is a Triton kernel called through jax-triton, which "
                          f"did not import ({e}). Install jax-triton==0.3.1 (on the H200 image carry its wheel: "
                          "BUILD_NOTES.md, 'One H200'), or run the pure-JAX references: "
                          "pallas_kernels.ops.set_implementation('reference')") from e

    varying = varying_axes(operands)
    operands = [vary_over(x, varying) for x in operands]
    outs = jax_triton.triton_call(*operands, kernel=kernel, out_shape=out_shape, **kwargs)
    return jax.tree.map(lambda y: vary_over(y, varying), outs)
