"""Sizes refused before anything is allocated: lower bounds on the bytes a model or a decode loop needs, computed
from shapes alone, against the memory of the devices that would hold them.

A bound counts only what must exist at one time (the params, the caches, and the largest single array of a step), so
a refusal is always right; passing is no promise that a run fits (XLA's temporaries come on top). The devices'
memory is the sum over the devices of the allocator's limit (`memory_stats()["bytes_limit"]`), or the host's RAM for
CPU devices, which share it (fake CPU devices included). experiments/memory_plan.py is the per-device budget of a
sharded deployment; this module is the guard every entry point runs.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

GB = 1e9


def tree_bytes(tree) -> int:
    """Bytes of every array (or jax.ShapeDtypeStruct) in a pytree."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def module_bytes(build: Callable[[], nnx.Module]) -> int:
    """Bytes of the state of the module `build()` makes, computed abstractly (nothing is allocated)."""
    return tree_bytes(nnx.state(nnx.eval_shape(build)))


def devices_memory(devices: Sequence[jax.Device]) -> tuple[int, str] | None:
    """(bytes the devices hold together, a description of them), or None when a device does not say."""
    platforms = sorted({d.platform for d in devices})
    if platforms == ["cpu"]:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's RAM"
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    if not all(limits):
        return None
    return sum(limits), f"the {len(devices)} {'/'.join(platforms)} device(s)"


def check_fits(needs: dict[str, int], devices: Sequence[jax.Device], fix: str) -> None:
    """Raise ValueError naming the bytes when `needs` ({what: bytes}) exceed what `devices` hold; `fix` says how to
    need less."""
    available = devices_memory(devices)
    total = sum(needs.values())
    if available is None or total <= available[0]:
        return
    parts = ", ".join(f"{what} {n / GB:.3g} GB" for what, n in needs.items() if n)
    raise ValueError(f"this needs at least {total / GB:.3g} GB ({parts}), more than the {available[0] / GB:.3g} GB "
                     f"of {available[1]}; {fix}")


def check_model_fits(build: Callable[[], nnx.Module], what: str, devices: Sequence[jax.Device] | None = None) -> None:
    """Refuse to make (or load) the module `build()` describes when its params alone exceed the devices' memory."""
    check_fits({f"{what} params": module_bytes(build)}, devices or jax.devices(),
               "use a smaller model or config, more devices (--mesh), or a machine with more memory")
