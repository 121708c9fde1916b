"""INT4 W4A16 weights in the compressed-tensors `pack-quantized` layout (symmetric, group 32 along the input dim).

Layout of one linear weight W [out, in]:
  weight_packed int32 [out, in/8]: value k = 8*j + i lives in word j, bits [4i, 4i+4), stored as q + 8 (q in [-8, 7]);
  weight_scale  bf16  [out, in/group];  W[o, k] = q[o, k] * weight_scale[o, k // group].
Leading batch dims (experts) are allowed on every function.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

NIBBLES_PER_WORD = 8


def quantize_int4(w, group: int = 32):
    """W [..., out, in] float -> (q int8 [..., out, in] in [-8, 7], scale float32 [..., out, in/group])."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % group:
        raise ValueError(f"input dim {w.shape[-1]} is not a multiple of the quantization group {group}")
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group, group)
    scale = np.abs(g).max(-1) / 7.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    scale = np.asarray(jnp.asarray(scale, jnp.bfloat16).astype(jnp.float32))  # scales are stored in bf16
    q = np.clip(np.round(g / scale[..., None]), -8, 7).astype(np.int8)
    return q.reshape(w.shape), scale


def pack_int4(q) -> np.ndarray:
    """q int [..., out, in] in [-8, 7] -> weight_packed int32 [..., out, in/8]."""
    q = np.asarray(q)
    if q.shape[-1] % NIBBLES_PER_WORD:
        raise ValueError(f"input dim {q.shape[-1]} is not a multiple of {NIBBLES_PER_WORD}")
    u = (q.astype(np.int64) + 8).astype(np.uint32).reshape(*q.shape[:-1], q.shape[-1] // NIBBLES_PER_WORD,
                                                           NIBBLES_PER_WORD)
    shifts = (4 * np.arange(NIBBLES_PER_WORD, dtype=np.uint32))
    return np.bitwise_or.reduce(u << shifts, axis=-1).view(np.int32)


def unpack_int4(packed):
    """weight_packed int32 [..., out, in/8] -> q int32 [..., out, in] in [-8, 7] (jnp; jit-able)."""
    packed = jnp.asarray(packed)
    shifts = 4 * jnp.arange(NIBBLES_PER_WORD, dtype=jnp.int32)
    nib = (packed[..., None] >> shifts) & 0xF
    return nib.reshape(*packed.shape[:-1], packed.shape[-1] * NIBBLES_PER_WORD) - 8


def dequantize_int4(packed, scale, group: int = 32, dtype=jnp.bfloat16):
    """(weight_packed [..., out, in/8], weight_scale [..., out, in/group]) -> W [..., out, in] in `dtype`."""
    q = unpack_int4(packed).astype(jnp.float32)
    s = jnp.repeat(jnp.asarray(scale, jnp.float32), group, axis=-1)
    if s.shape != q.shape:
        raise ValueError(f"weight_scale {tuple(scale.shape)} does not match weight_packed {tuple(packed.shape)} "
                         f"with group size {group}")
    return (q * s).astype(dtype)
