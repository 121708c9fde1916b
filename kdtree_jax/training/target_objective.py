"""The target's objective: next-token cross-entropy over training windows, and the router-bias balancing.

Attention. Training uses the naive MLA path (`absorbed=False`: plain jnp, differentiable) over a fresh cache of the
window's length with a causal `visible`. Routed experts go through `jax.lax.ragged_dot`; `run.setup_process` makes
the GPU lower it (and its gradients) to dense dot_generals, exactly as on CPU.

Router. `e_score_correction_bias` is not trained by gradient (it only picks experts); after each optimizer update it
moves by the auxiliary-loss-free rule of DeepSeek-V3: bias += rate * sign(mean load - load), per MoE layer.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from kdtree_jax.model.moe import MoE
from kdtree_jax.model.transformer import ForwardOutput, Transformer
from kdtree_jax.training.optim import ROUTER_BIAS, apply_updates
from kdtree_jax.training.precision import ParamLayout
from kdtree_jax.training.train_state import TrainState


def causal_forward(model: Transformer, tokens, hidden_layers: tuple = ()) -> ForwardOutput:
    """Naive-MLA (differentiable) causal forward of tokens [S, T] from an empty cache of capacity T."""
    return model.causal(tokens, absorbed=False, hidden_layers=hidden_layers)


def token_nll(logits, labels):
    """logits [..., V] f32, labels [...] -> negative log-likelihood [...] f32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def target_loss(model: Transformer, window):
    """window [S, T+1] -> mean next-token loss of window[:, 1:] given window[:, :-1]."""
    return jnp.mean(token_nll(causal_forward(model, window[:, :-1]).logits, window[:, 1:]))


def target_loss_and_loads(model: Transformer, window):
    """window [S, T+1] -> (mean next-token loss, loads [num MoE layers, E] tokens routed to each expert)."""
    run = nnx.capture(target_loss, nnx.Intermediate, method_outputs=nnx.Intermediate)
    loss, intermediates = run(model, window)
    return loss, expert_loads(model, nnx.to_pure_dict(intermediates))


def expert_loads(model: Transformer, intermediates: dict):
    """Tokens per routed expert of each MoE layer [num MoE layers, E] (f32), from the routing each MoE layer's
    `route` returned in the captured forward (`method_outputs=nnx.Intermediate`); [0, E] for a model without MoE
    layers."""
    loads = []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoE):
            ids, _ = intermediates["layers"][i]["mlp"]["route"][0]
            loads.append(jnp.zeros(layer.mlp.cfg.num_experts, jnp.float32).at[ids.reshape(-1)].add(1.0))
    return jnp.stack(loads) if loads else jnp.zeros((0, model.cfg.num_experts), jnp.float32)


def balance_router_bias(params: dict, loads, rate: float) -> dict:
    """bias += rate * sign(mean load - load) for each MoE layer (loads [num MoE layers, E], in layer order)."""
    if rate == 0.0 or loads.shape[0] == 0:
        return params
    layers = dict(params["layers"])
    moe_ids = [i for i in sorted(layers) if ROUTER_BIAS in layers[i]["mlp"]]
    for row, i in enumerate(moe_ids):
        mlp = dict(layers[i]["mlp"])
        mlp[ROUTER_BIAS] = mlp[ROUTER_BIAS] + rate * jnp.sign(jnp.mean(loads[row]) - loads[row])
        layers[i] = {**layers[i], "mlp": mlp}
    return {**params, "layers": layers}


def load_imbalance(loads) -> jax.Array:
    """Max over layers of (busiest expert's load / mean load); 1.0 is perfect balance."""
    if loads.shape[0] == 0:
        return jnp.float32(1.0)
    return jnp.max(jnp.max(loads, axis=-1) / jnp.maximum(jnp.mean(loads, axis=-1), 1e-9))


def make_target_step(layout: ParamLayout, optimizer, bias_rate: float):
    """jitted (state, window [S, T+1] int32, lr f32) -> (state, metrics); the state is donated.

    metrics: "loss", and with a nonzero `bias_rate` (router balancing on) "imbalance" (see load_imbalance).
    """
    def step(state: TrainState, window, lr):
        if not bias_rate:
            loss, grads = jax.value_and_grad(lambda p: target_loss(layout.module(p), window))(state.params)
            return TrainState(*apply_updates(optimizer, grads, state.opt_state, state.params, lr)), {"loss": loss}

        def loss_fn(params):
            return target_loss_and_loads(layout.module(params), window)

        (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        params, opt_state = apply_updates(optimizer, grads, state.opt_state, state.params, lr)
        params = balance_router_bias(params, loads, bias_rate)
        return TrainState(params, opt_state), {"loss": loss, "imbalance": load_imbalance(loads)}

    return jax.jit(step, donate_argnums=0)


def make_target_eval(layout: ParamLayout):
    """jitted (params, window [S, T+1]) -> {"nll": summed nll, "tokens": count}."""
    def evaluate(params, window):
        loss = target_loss(layout.module(params), window)
        return {"nll": loss * window[:, 1:].size, "tokens": jnp.float32(window[:, 1:].size)}

    return jax.jit(evaluate)


def target_summary(sums: dict) -> dict:
    loss = float(sums["nll"] / sums["tokens"])
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}
