"""Shared test helpers."""
import jax.numpy as jnp

from kdtree_jax.cache import init_cache


def causal_logits(model, tokens, absorbed: bool = True):
    """A causal prefill of tokens [S, T] from an empty cache -> logits [S, T, V] f32."""
    s, t = tokens.shape
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (s, t, t))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
    return model(tokens, positions, init_cache(model.cfg, s, t), visible, absorbed=absorbed).logits


def rel_err(a, b) -> float:
    """|a - b| / |b| in float32 (Frobenius norms)."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
