"""GPU kernels with their pure-JAX references: Triton kernels called through `triton_call` (int4_moe, tree build and
accept; the attention port, a candidate), the Pallas-Triton tree-verify attention, and an experimental Mosaic GPU
attention.

The model calls them through `pallas_kernels.ops`, which picks the kernel or the reference. Helpers shared by the
kernels live here. The package depends on jax and triton, never on the engine (tests/test_imports.py): the contracts
the kernels implement live on this side too, `tree` (tree arrays, the heapq specification, the pure-JAX builder and
accept walk) and `int4_layout` (the compressed-tensors INT4 layout), and the engine (`kdtree_jax`) imports them from
here. `tree_verify_attention_mgpu` is an experimental Mosaic GPU kernel outside `ops` (see its docstring).
"""
import warnings

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import ManualAxisType

# Pallas announces at every Triton lowering that this backend is deprecated. Its last user here is the tree-verify
# attention kernel (its Triton port is the candidate to replace it), so the warning is silenced here, in one place,
# until that kernel goes.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

MIN_DOT_DIM = 16  # Triton's tl.dot needs every dimension >= 16


def dot_nt(a, b):
    """a [m, k] . b [n, k]^T -> [m, n] in f32. HIGHEST keeps f32 operands IEEE: the Triton lowering reads
    Precision.DEFAULT as TF32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def inverse_or_zero(total):
    """1 / total where total > 0, else 0: the normaliser of a softmax row (0 for a row with nothing to attend)."""
    return jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)


def pallas_call(kernel, *, out_shape, **kwargs):
    """`pl.pallas_call` that also runs inside `jax.shard_map` (check_vma=True, the default there).

    There a pallas_call must state how each output varies over the mesh's manual axes, and its operands must agree:
    a kernel's output depends on all its operands, so every operand and output is made to vary over the union of the
    axes any operand varies over (a head-split query under tp, stream-split caches under data; a replicated operand
    is cast to varying, which moves no data). Outside shard_map nothing varies and this is `pl.pallas_call`.
    out_shape: a ShapeDtypeStruct or a pytree of them; kwargs: those of `pl.pallas_call`.
    """
    def call(*operands):
        varying = varying_axes(operands)
        operands = jax.tree.map(lambda x: vary_over(x, varying), operands)
        shapes = jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=ManualAxisType(varying=varying)),
            out_shape)
        return pl.pallas_call(kernel, out_shape=shapes, **kwargs)(*operands)
    return call


def varying_axes(operands) -> frozenset:
    """The manual mesh axes any array of the pytree `operands` varies over (empty outside shard_map)."""
    return frozenset().union(*(jax.typeof(x).mat.varying for x in jax.tree.leaves(operands)))


def vary_over(x, axes: frozenset):
    """x typed as varying over `axes` too (a type cast inside shard_map: no data moves)."""
    missing = tuple(sorted(axes - jax.typeof(x).mat.varying))
    return lax.pcast(x, missing, to="varying") if missing else x
