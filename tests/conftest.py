"""Shared test helpers."""
import numpy as np


def causal_logits(model, tokens, absorbed: bool = True):
    """A causal prefill of tokens [S, T] from an empty cache -> logits [S, T, V] f32."""
    return model.causal(tokens, absorbed=absorbed).logits


def rel_err(a, b) -> float:
    """|a - b| / |b| (Frobenius norms), computed in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
