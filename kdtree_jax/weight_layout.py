"""The target's dense product weights stored with their reduction axes minor-most on the device (JAX's layout API).

`project` multiplies x [..., K] by a weight [K, *out] kept in that logical shape everywhere (params, checkpoints,
HF import, sharding specs). Row-major, a few-row product reduces over the weight's major axis, which XLA's GPU GEMV
does as a column reduction; stored with K minor-most (the bytes of HF's [out, K] layout) it is a row reduction along
contiguous memory: the tp=8 share's layer of dense products at M = 1 took 37.5 us of busy time on an H100 against
52.4 (experiments/notes/k26.md, "The multiply-add tilings with staged loads: outcome"). Only the physical layout
changes: shapes, values and shardings stay, and the jit that takes the params must be told (`formats` as its
in_shardings), else JAX hands XLA the default layout.

Not for the exact mode: its products are Triton calls that read [K, N] row-major, so XLA would copy each such weight
into that layout on every call.
"""
from __future__ import annotations

import jax
from jax.experimental.layout import Format, Layout

from kdtree_jax.sharding import path_names

LAYOUTS = ("kn", "nk")  # as stored (row-major [K, *out]) | K minor-most

# param name -> how many leading axes of the weight `project` contracts (o_proj [H, V, D]: heads x head dim)
REDUCTION_AXES: dict[str, int] = {
    "q_a_proj": 1, "q_b_proj": 1, "q_proj": 1, "kv_a_proj": 1, "o_proj": 2,
    "gate_proj": 1, "up_proj": 1, "down_proj": 1,        # the dense MLP and the shared experts
    "gate": 1,                                            # the router, [D, E]
    "lm_head": 1,
}


def reduction_minor(ndim: int, reduction_axes: int) -> Layout:
    """The layout of a weight [*K, *out] (reduction_axes leading axes K) with the K axes minor-most, in their order:
    major_to_minor = (out axes..., K axes...)."""
    if not 0 < reduction_axes < ndim:
        raise ValueError(f"reduction_minor: {reduction_axes} reduction axes of a {ndim}-d weight leave no output axis")
    return Layout(major_to_minor=tuple(range(reduction_axes, ndim)) + tuple(range(reduction_axes)))


def formats(params, shardings, layout: str = "kn"):
    """The in_shardings of a jit taking `params` (a target state, same tree as `shardings`): with layout 'nk' each
    dense product weight's sharding as a Format with `reduction_minor`'s layout, every other leaf its sharding; with
    'kn' `shardings` itself."""
    if layout not in LAYOUTS:
        raise ValueError(f"weight layout {layout!r} is not one of {LAYOUTS}")
    if layout == "kn":
        return shardings

    def one(path, leaf, sharding):
        names = path_names(path)
        axes = REDUCTION_AXES.get(names[-1]) if names else None
        if axes is None or leaf.ndim <= axes:
            return sharding
        return Format(reduction_minor(leaf.ndim, axes), sharding)

    return jax.tree_util.tree_map_with_path(one, params, shardings)


def place(params, shardings, layout: str = "kn"):
    """device_put params into `formats(params, shardings, layout)` (on the GPU, the 'nk' weights are transposed in
    memory once, here)."""
    return jax.device_put(params, formats(params, shardings, layout))
