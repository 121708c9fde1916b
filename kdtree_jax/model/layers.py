"""Small building blocks shared by the target model and the drafter."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kdtree_jax.model.parallel import STREAMS, mlp_parallel, per_device
from pallas_kernels import batch_invariant, ops


def dtype_of(name: str):
    return {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[name]


def init_weight(rngs: nnx.Rngs, shape, fan_in: int, dtype) -> nnx.Param:
    """A weight with the truncated-normal(0, fan_in^-0.5) init. The model's dense weights are stored [*out, in]
    (HF's Linear layout; `project`)."""
    w = jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32) * fan_in ** -0.5
    return nnx.Param(w.astype(dtype))


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, computed in f32."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x, *, exact: bool = False):
        """exact: the mean of squares in one order per row (`batch_invariant.rms_norm`; on each device's streams
        under a mesh: `parallel.per_device`)."""
        if exact:
            norm = functools.partial(batch_invariant.rms_norm, eps=self.eps)
            return per_device(norm, (x, self.weight[...]), (P(STREAMS), P()), P(STREAMS))
        x32 = x.astype(jnp.float32)
        mean_sq = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        x32 = x32 * jax.lax.rsqrt(mean_sq + self.eps)
        return (x32 * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def fused_norm(norm: RMSNorm | None) -> dict:
    """The keywords (norm_weight, eps) that fuse `norm` into a product's prologue (`ops.dense`,
    `batch_invariant.matmul`); none for no norm."""
    return {} if norm is None else dict(norm_weight=norm.weight[...], eps=norm.eps)


def project(x, w, *, norm: RMSNorm | None = None, out_dtype=None):
    """[norm](x) . w^T: x [..., K], w [*out, K] (a dense weight as stored: its input axis last) -> [..., *out] (f32
    accumulation; out_dtype default x's). One `skinny_matmul` kernel with the norm fused where `ops.dense_takes` the
    rows (`ops.set_dense_kernel`) and no mesh shards the product (`ops.unpartitioned`: a Triton call has no GSPMD
    partitioning), else XLA's dot over both last axes (at one row a reduction along each weight row's contiguous
    memory: 28% less time than over a [K, N] weight's columns on an H100, experiments/notes/k26.md)."""
    w2 = w.reshape(-1, w.shape[-1])
    if ops.unpartitioned() and ops.dense_takes(x, w2):
        y = ops.dense(x, w2, out_dtype=out_dtype, **fused_norm(norm))
        return y.reshape(*x.shape[:-1], *w.shape[:-1])
    x = x if norm is None else norm(x)
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (w.ndim - 1,)), ((), ())), preferred_element_type=out_dtype)


class GatedMLP(nnx.Module):
    """down(silu(gate x) * (up x)): the dense MLP and the shared expert. Weights [I, D], [I, D], [D, I] ([out, in])."""

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = init_weight(rngs, (intermediate, hidden), hidden, dtype)
        self.up_proj = init_weight(rngs, (intermediate, hidden), hidden, dtype)
        self.down_proj = init_weight(rngs, (hidden, intermediate), intermediate, dtype)

    def weights(self) -> tuple:
        """(gate [I, D], up [I, D], down [D, I]): `gated_mlp`'s weights."""
        return self.gate_proj[...], self.up_proj[...], self.down_proj[...]

    def __call__(self, x, *, exact: bool = False):
        """x [S, T, D] -> [S, T, D]. exact: `batch_invariant.gated_mlp`, under tp its partials added in device order
        (`parallel.mlp_parallel`)."""
        if exact:
            return mlp_parallel(batch_invariant.gated_mlp, x, *self.weights())
        return gated_mlp(x, *self.weights())


def gated_mlp(x, gate, up, down):
    """x [..., D], gate / up [I, D], down [D, I] -> down(silu(gate x) * (up x)) [..., D] (`project`'s products)."""
    return project(jax.nn.silu(project(x, gate)) * project(x, up), down)
