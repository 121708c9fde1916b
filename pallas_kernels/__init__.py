"""GPU kernels with their pure-JAX references: Triton kernels called through `triton_call` (int4_moe, tree build and
accept, tree-verify attention for few query rows) and a Mosaic GPU tree-verify attention (from 64 query rows per
stream). No kernel uses the deprecated Pallas-Triton backend.

The model calls them through `pallas_kernels.ops`, which picks the kernel or the reference. Helpers shared by the
kernels live here. The package depends on jax and triton, never on the engine (tests/test_imports.py): the contracts
the kernels implement live on this side too, `tree` (tree arrays, the heapq specification, the pure-JAX builder and
accept walk) and `int4_layout` (the compressed-tensors INT4 layout), and the engine (`kdtree_jax`) imports them from
here.
"""
import jax
from jax import lax
import jax.numpy as jnp

MIN_DOT_DIM = 16  # Triton's tl.dot needs every dimension >= 16
SHARED_BYTES = 227 * 1024  # the H200's shared memory per block (the most a kernel may ask for)


def inverse_or_zero(total):
    """1 / total where total > 0, else 0: the normaliser of a softmax row (0 for a row with nothing to attend)."""
    return jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)


def varying_axes(operands) -> frozenset:
    """The manual mesh axes any array of the pytree `operands` varies over (empty outside shard_map)."""
    return frozenset().union(*(jax.typeof(x).mat.varying for x in jax.tree.leaves(operands)))


def vary_over(x, axes: frozenset):
    """x typed as varying over `axes` too (a type cast inside shard_map: no data moves)."""
    missing = tuple(sorted(axes - jax.typeof(x).mat.varying))
    return lax.pcast(x, missing, to="varying") if missing else x
