"""Drafter objective (DESIGN.md section 4). The frozen target runs once over a window (hidden states of the drafter's
target layers and its greedy next tokens). At each anchor a (1 <= a <= T - L) the block is [token a, MASK x (L-1)]
at positions a .. a+L-1, attending to the context features of positions < a; the label of block position k (1..L-1)
is the target's greedy token after position a+k-1, weighted exp(-(k-1)/gamma).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax.drafter import Drafter, DrafterCache
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.training.optim import apply_updates
from kdtree_jax.training.precision import ParamLayout
from kdtree_jax.training.target_objective import causal_forward, token_nll
from kdtree_jax.training.train_state import TrainState


def draw_anchors(rng: np.random.Generator, batch: int, seq_len: int, num_anchors: int, block_size: int) -> np.ndarray:
    """[batch, num_anchors] int32 distinct anchors per row in [1, seq_len - block_size] (sorted): every block has
    L-1 following positions inside the window and at least one context token."""
    choices = seq_len - block_size
    if choices < 1:
        raise ValueError(f"seq_len={seq_len} leaves no anchor for block_size={block_size}; use seq_len >= "
                         f"block_size + 1")
    if not 1 <= num_anchors <= choices:
        raise ValueError(f"num_anchors={num_anchors} must lie in [1, seq_len - block_size = {choices}]")
    order = np.argsort(rng.random((batch, choices)), axis=1)[:, :num_anchors]
    return (np.sort(order, axis=1) + 1).astype(np.int32)


class DraftBlocks(NamedTuple):
    """N = S * A blocks in sequence-major order: block n is anchor n % A of sequence n // A."""

    block: jax.Array  # [N, L] token at the anchor, then MASK
    positions: jax.Array  # [N, L] anchor .. anchor + L - 1
    labels: jax.Array  # [N, L-1] target's greedy token after position anchor + k - 1, k = 1..L-1
    ctx_len: jax.Array  # [N] = anchor: context rows < anchor are visible


def draft_blocks(tokens, greedy, anchors, block_size: int, mask_id: int) -> DraftBlocks:
    """tokens, greedy [S, T] (greedy[s, t] = the target's argmax after position t); anchors [S, A] -> DraftBlocks."""
    flat = anchors.reshape(-1)  # [N]
    seq = jnp.repeat(jnp.arange(tokens.shape[0]), anchors.shape[1])  # [N]
    offsets = jnp.arange(block_size)
    block = jnp.full((flat.shape[0], block_size), mask_id, jnp.int32).at[:, 0].set(tokens[seq, flat])
    labels = greedy[seq[:, None], flat[:, None] + offsets[None, :-1]]
    return DraftBlocks(block, flat[:, None] + offsets[None, :], labels.astype(jnp.int32), flat)


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """[L-1] loss weights exp(-(k-1)/gamma) of block positions k = 1..L-1."""
    if gamma <= 0:
        raise ValueError(f"gamma={gamma} must be positive (about 7 for block size 16)")
    return np.exp(-np.arange(block_size - 1) / gamma).astype(np.float32)


def drafter_logits(drafter: Drafter, target: Transformer, tokens, anchors):
    """Run the frozen target over tokens [S, T] and the drafter on every anchor's block.

    Returns (logits [N, L-1, V] f32 for block positions 1..L-1, labels [N, L-1]). The context K/V of the whole
    window is computed once and shared by the A blocks of a sequence (ctx_len = anchor hides rows >= anchor).
    """
    fwd = causal_forward(target, tokens, hidden_layers=drafter.cfg.target_layer_ids)
    hidden = jax.lax.stop_gradient(fwd.hidden)
    greedy = jnp.argmax(fwd.logits, axis=-1)
    s, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
    ctx_k, ctx_v = drafter.context_kv(hidden, positions)
    per_anchor = lambda x: jnp.repeat(x, anchors.shape[1], axis=0)  # [S, T, H, hd] -> [N, T, H, hd]
    cache = DrafterCache(tuple(map(per_anchor, ctx_k)), tuple(map(per_anchor, ctx_v)))
    blocks = draft_blocks(tokens, greedy, anchors, drafter.cfg.block_size, drafter.cfg.mask_token_id)
    logits = drafter.block_logits(target.embed, target.logits, blocks.block, blocks.positions, cache,
                                  blocks.ctx_len)
    return logits[:, 1:], blocks.labels


def drafter_metrics(logits, labels, weights):
    """Weighted loss and per-position sums: correct [L-1] (top-1 right at k) and chain [L-1] (first k all right)."""
    nll = token_nll(logits, labels)  # [N, L-1]
    loss = jnp.sum(nll * weights) / (nll.shape[0] * jnp.sum(weights))
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return loss, {"correct": jnp.sum(correct, 0), "chain": jnp.sum(jnp.cumprod(correct, axis=1), 0),
                  "blocks": jnp.float32(correct.shape[0])}


def make_drafter_step(layout: ParamLayout, target_graphdef, optimizer, weights: np.ndarray):
    """jitted (state, target_params, tokens [S, T], anchors [S, A], lr) -> (state, metrics); the state is donated."""
    weights = jnp.asarray(weights)

    def step(state: TrainState, target_params, tokens, anchors, lr):
        target = nnx.merge(target_graphdef, target_params)

        def loss_fn(params):
            logits, labels = drafter_logits(layout.module(params), target, tokens, anchors)
            return drafter_metrics(logits, labels, weights)

        (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        params, opt_state = apply_updates(optimizer, grads, state.opt_state, state.params, lr)
        return TrainState(params, opt_state), {"loss": loss, **sums}

    return jax.jit(step, donate_argnums=0)


def make_drafter_eval(layout: ParamLayout, target_graphdef, weights: np.ndarray):
    """jitted (params, target_params, tokens, anchors) -> {"loss_sum", "correct", "chain", "blocks"} sums."""
    weights = jnp.asarray(weights)

    def evaluate(params, target_params, tokens, anchors):
        logits, labels = drafter_logits(layout.module(params), nnx.merge(target_graphdef, target_params), tokens,
                                        anchors)
        loss, sums = drafter_metrics(logits, labels, weights)
        return {"loss_sum": loss * sums["blocks"], **sums}

    return jax.jit(evaluate)


def drafter_summary(sums: dict) -> dict:
    """Per-position accuracy, chain acceptance P(first k right) and expected tau = 1 + sum_k P(first k right)."""
    blocks = float(sums["blocks"])
    chain = np.asarray(sums["chain"]) / blocks
    return {"loss": float(sums["loss_sum"]) / blocks, "tau": 1.0 + float(chain.sum()),
            "acc": [round(float(a), 4) for a in np.asarray(sums["correct"]) / blocks],
            "chain": [round(float(c), 4) for c in chain]}
