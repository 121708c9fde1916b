"""Shared test helpers."""
import jax.numpy as jnp
import numpy as np

from kdtree_jax.cache import init_cache


def causal_logits(model, tokens, absorbed: bool = True):
    """A causal prefill of tokens [S, T] from an empty cache -> logits [S, T, V] f32."""
    s, t = tokens.shape
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (s, t, t))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
    return model(tokens, positions, init_cache(model.cfg, s, t), visible, absorbed=absorbed).logits


def rel_err(a, b) -> float:
    """|a - b| / |b| (Frobenius norms), computed in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
