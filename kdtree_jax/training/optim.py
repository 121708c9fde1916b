"""The optimizer: AdamW with linear warmup then cosine decay over the run's progress, weight decay on matrices only;
the router's correction bias is frozen (it is not trained by gradient: target_objective.balance_router_bias moves it).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import optax

ROUTER_BIAS = "e_score_correction_bias"  # the MoE router's selection bias (kdtree_jax.model.moe)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup (steps) then cosine decay (over the run's progress) to final_lr_fraction * lr."""

    lr: float = 2e-3
    warmup_steps: int = 100
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1  # on matrices only (ndim >= 2), never on norms or the router bias
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0

    def learning_rate(self, step: int, progress: float) -> float:
        """lr at `step` (0-based) with `progress` in [0, 1] of the run."""
        warm = min(1.0, (step + 1) / max(self.warmup_steps, 1))
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
        return self.lr * warm * (self.final_lr_fraction + (1.0 - self.final_lr_fraction) * cosine)


def make_optimizer(params, cfg: OptimConfig) -> optax.GradientTransformation:
    """Gradient clipping + Adam + decoupled weight decay; the router bias is frozen. Unit step size: the train step
    multiplies the updates by -lr (the schedule follows wall-clock progress, so it is an argument of the step)."""
    def label(path, p):
        if _key_names(path)[-1] == ROUTER_BIAS:
            return "frozen"
        return "decay" if p.ndim >= 2 else "no_decay"

    labels = jax.tree_util.tree_map_with_path(label, params)
    adam = optax.scale_by_adam(cfg.b1, cfg.b2)
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.multi_transform({"decay": optax.chain(adam, optax.add_decayed_weights(cfg.weight_decay)),
                               "no_decay": adam,
                               "frozen": optax.set_to_zero()}, labels))


def _key_names(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def apply_updates(optimizer, grads, opt_state, params, lr):
    """One optimizer update scaled by -lr -> (params, opt_state)."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
    return params, opt_state
