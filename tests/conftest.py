"""Shared test helpers."""
import itertools

import numpy as np


def causal_logits(model, tokens, absorbed: bool = True):
    """A causal prefill of tokens [S, T] from an empty cache -> logits [S, T, V] f32."""
    return model.causal(tokens, absorbed=absorbed).logits


def rel_err(a, b) -> float:
    """|a - b| / |b| (Frobenius norms), computed in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def random_targets(rng, tree, vocab: int, hit_rate: float):
    """[S, B+1] int32 target tokens: with probability hit_rate the token of a random child of the node (so walks go
    deep), else a random token."""
    tokens, parent = np.asarray(tree.tokens), np.asarray(tree.parent)
    target = rng.integers(0, vocab, size=tokens.shape).astype(np.int32)
    for s, i in itertools.product(range(tokens.shape[0]), range(tokens.shape[1])):
        children = np.flatnonzero(parent[s] == i)
        if children.size and rng.random() < hit_rate:
            target[s, i] = tokens[s, rng.choice(children)]
    return target
