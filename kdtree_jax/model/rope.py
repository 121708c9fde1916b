"""Rotary position embedding with YaRN frequency interpolation (DeepSeek-V3 / Kimi K2 form).

The rotary half of each q/k head is rotated in interleaved pairs (x[2i], x[2i+1]) by angle position * inv_freq[i],
which is what the released checkpoints expect. YaRN's attention factor multiplies cos and sin; the extra mscale^2
of the softmax lives in `ModelConfig.softmax_scale`.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from kdtree_jax.config import ModelConfig, yarn_get_mscale


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[R/2] float64 inverse frequencies after YaRN blending (plain RoPE when the factor is 1)."""
    dim, base, factor = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling_factor
    extrapolated = plain_inv_frequencies(dim, base)
    if factor <= 1.0:
        return extrapolated
    interpolated = extrapolated / factor
    low = max(math.floor(_correction_dim(cfg.rope_beta_fast, dim, base, cfg.rope_original_max_position)), 0)
    high = min(math.ceil(_correction_dim(cfg.rope_beta_slow, dim, base, cfg.rope_original_max_position)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep_extrapolated = 1.0 - ramp
    return interpolated * (1.0 - keep_extrapolated) + extrapolated * keep_extrapolated


def attention_factor(cfg: ModelConfig) -> float:
    """YaRN's multiplier on cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    return (yarn_get_mscale(cfg.rope_scaling_factor, cfg.rope_mscale)
            / yarn_get_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim))


def apply_rope(x, positions, cfg: ModelConfig):
    """The target's rotary embedding: x [..., T, (H,) R] rotated by positions [..., T] with YaRN frequencies."""
    return rotate_pairs(x, positions, inv_frequencies(cfg), attention_factor(cfg))


def plain_inv_frequencies(dim: int, theta: float) -> np.ndarray:
    """[dim/2] inverse frequencies of plain RoPE."""
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def rotate_pairs(x, positions, inv_freq, factor: float = 1.0):
    """Rotate x [..., T, (H,) R] by positions [..., T]; pairs (x[2i], x[2i+1]) turn by position * inv_freq[i].

    Computed in f32, returned in x.dtype; cos and sin are scaled by `factor` (YaRN's attention factor).
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., T, R/2]
    if x.ndim == positions.ndim + 2:  # a heads axis sits between T and R
        angles = angles[..., None, :]
    cos, sin = jnp.cos(angles) * factor, jnp.sin(angles) * factor
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)
