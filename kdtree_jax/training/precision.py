"""Precision. The optimizer holds float32 master weights (a pure dict shaped like `nnx.state(model, nnx.Param)`); each
step casts them to the model's own dtypes (bf16 weights, f32 router) and runs the model there, so gradients reach the
masters through the cast. `ParamLayout.module` builds the bf16 model that is saved.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """How float32 master params become a module: its graph and each param's own dtype (same tree as the params)."""

    graphdef: Any
    dtypes: Any

    def cast(self, params):
        return jax.tree.map(lambda p, d: p.astype(d), params, self.dtypes)

    def module(self, params):
        """The module with `params` cast to its dtypes (call inside jit, or once to save)."""
        return nnx.merge(self.graphdef, self.cast(params))


def master_params(model: nnx.Module) -> tuple[ParamLayout, dict]:
    """(layout, float32 master copy of the params as a pure dict)."""
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    dtypes = jax.tree.map(lambda p: p.dtype, params)
    return ParamLayout(graphdef, dtypes), jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)


def count_params(params) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))
