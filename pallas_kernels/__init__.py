"""Pallas kernels (Triton lowering on the GPU, interpret mode on the CPU) with their pure-JAX references.

The model calls them through `pallas_kernels.ops`, which picks the kernel or the reference. Helpers shared by the
kernels live here. The package depends on jax alone (tests/test_imports.py): the contracts the kernels implement live on
this side too, `tree` (tree arrays, the heapq specification, the pure-JAX builder and accept walk) and `int4_layout`
(the compressed-tensors INT4 layout), and the engine (`kdtree_jax`) imports them from here. `prefix_attention_mgpu` is an experimental Mosaic GPU kernel outside `ops` (see its docstring).
"""
import warnings

from jax import lax
import jax.numpy as jnp

# Pallas announces at every Triton lowering that this backend is deprecated. It is the project's chosen GPU baseline
# (DESIGN.md section 6), so the warning is silenced here, in one place, for the whole package.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

MIN_DOT_DIM = 16  # Triton's tl.dot needs every dimension >= 16


def dot_nt(a, b):
    """a [m, k] . b [n, k]^T -> [m, n] in f32. HIGHEST keeps f32 operands IEEE: the Triton lowering reads
    Precision.DEFAULT as TF32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
