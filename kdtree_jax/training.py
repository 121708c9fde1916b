"""Training of the project's target and DFlash drafter: objectives, optimizer, jitted steps, loop, logs, train state.

Shared by experiments/train_target.py and experiments/train_drafter.py (DESIGN.md section 7).

Precision. The optimizer holds float32 master weights (a pure dict shaped like `nnx.state(model, nnx.Param)`); each
step casts them to the model's own dtypes (bf16 weights, f32 router) and runs the model there, so gradients reach the
masters through the cast. `ParamLayout.module` builds the bf16 model that is saved.

Attention. Training uses the naive MLA path (`absorbed=False`: plain jnp, differentiable) over a fresh cache of the
window's length with a causal `visible`. Routed experts go through `jax.lax.ragged_dot`; `setup_process` makes
the GPU lower it (and its gradients) to dense dot_generals, exactly as on CPU.

Router. `e_score_correction_bias` is not trained by gradient (it only picks experts); after each optimizer update it
moves by the auxiliary-loss-free rule of DeepSeek-V3: bias += rate * sign(mean load - load), per MoE layer.

Drafter objective (DESIGN.md section 4). The frozen target runs once over a window (hidden states of the drafter's
target layers and its greedy next tokens). At each anchor a (1 <= a <= T - L) the block is [token a, MASK x (L-1)]
at positions a .. a+L-1, attending to the context features of positions < a; the label of block position k (1..L-1)
is the target's greedy token after position a+k-1, weighted exp(-(k-1)/gamma).

Held-out evaluation. `train_loop` evaluates at the start and every `LoopConfig.eval_every` of the budget; `BestParams`
keeps a device copy of the params of the lowest held-out loss, which the scripts save instead of the last params (a
small corpus overfits within a few epochs; `count_epochs` warns beyond MAX_EPOCHS).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import flags, logging
from flax import nnx
from tqdm import tqdm

from kdtree_jax import checkpoint, data, plots
from kdtree_jax.drafter import Drafter, DrafterCache
from kdtree_jax.model.moe import MoE
from kdtree_jax.model.transformer import ForwardOutput, Transformer

ROUTER_BIAS = "e_score_correction_bias"


def setup_process() -> None:
    """For a training script's process: lower `ragged_dot` to dense dot_generals on GPU too (the CPU lowering,
    gradients included), and keep the libraries' INFO logs (orbax's per-save chatter) off the console."""
    jax.config.update("jax_ragged_dot_use_ragged_dot_instruction", False)
    logging.set_verbosity(logging.WARNING)


def say(message: str) -> None:
    """A timestamped progress line on stderr that leaves the progress bar intact."""
    tqdm.write(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr)


# -------------------------------------------------------------------------------------------------------- precision


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """How float32 master params become a module: its graph and each param's own dtype (same tree as the params)."""

    graphdef: Any
    dtypes: Any

    def cast(self, params):
        return jax.tree.map(lambda p, d: p.astype(d), params, self.dtypes)

    def module(self, params):
        """The module with `params` cast to its dtypes (call inside jit, or once to save)."""
        return nnx.merge(self.graphdef, self.cast(params))


def master_params(model: nnx.Module) -> tuple[ParamLayout, dict]:
    """(layout, float32 master copy of the params as a pure dict)."""
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    dtypes = jax.tree.map(lambda p: p.dtype, params)
    return ParamLayout(graphdef, dtypes), jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)


def count_params(params) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))


# -------------------------------------------------------------------------------------------------------- optimizer


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


def _apply(optimizer, grads, opt_state, params, lr):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
    return params, opt_state


# ----------------------------------------------------------------------------------------------------- target model


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


class TrainState(NamedTuple):
    params: dict  # float32 masters
    opt_state: Any


def make_target_step(layout: ParamLayout, optimizer, bias_rate: float):
    """jitted (state, window [S, T+1] int32, lr f32) -> (state, metrics); the state is donated.

    metrics: "loss", and with a nonzero `bias_rate` (router balancing on) "imbalance" (see load_imbalance).
    """
    def step(state: TrainState, window, lr):
        if not bias_rate:
            loss, grads = jax.value_and_grad(lambda p: target_loss(layout.module(p), window))(state.params)
            return TrainState(*_apply(optimizer, grads, state.opt_state, state.params, lr)), {"loss": loss}

        def loss_fn(params):
            return target_loss_and_loads(layout.module(params), window)

        (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        params, opt_state = _apply(optimizer, grads, state.opt_state, state.params, lr)
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


# ---------------------------------------------------------------------------------------------------------- drafter


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
        params, opt_state = _apply(optimizer, grads, state.opt_state, state.params, lr)
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


# ------------------------------------------------------------------------------------------------------------- data


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # [N] tokens of the training files
    held_out: np.ndarray  # [M] tokens of the held-out files (never trained on)
    stats: dict


def load_corpus(roots: Sequence[str], tokenizer: data.Tokenizer, cache_dir: str | None) -> Corpus:
    """Find, split and tokenize the source files under `roots` (training tokens cached in `cache_dir`)."""
    start = time.perf_counter()
    split = data.split_files(data.find_source_files(roots))
    if not split.held_out:
        raise ValueError(f"the roots {list(roots)} hold no held-out file to evaluate on; add roots "
                         f"(e.g. the standard library)")
    train = data.token_stream(split.train, tokenizer, cache_dir=cache_dir)
    held_out = held_out_stream(split.held_out, tokenizer)
    stats = {"roots": list(roots), "files_train": len(split.train), "files_held_out": len(split.held_out),
             "files_near_copies": len(split.near_copies), "tokens_train": int(train.size),
             "tokens_held_out": int(held_out.size), "seconds": round(time.perf_counter() - start, 1)}
    return Corpus(train, held_out, stats)


def held_out_stream(files: Sequence[data.SourceFile], tokenizer: data.Tokenizer) -> np.ndarray:
    """Concatenated [BOS, tokens..., EOS] of held-out files (data.token_stream refuses them by design) -> [M]."""
    stray = [f.relpath for f in files if not data.is_held_out(f.relpath)]
    if stray:
        raise ValueError(f"held_out_stream got {len(stray)} training files (e.g. {stray[0]!r}); "
                         f"pass split_files(...).held_out")
    dtype = data.token_dtype(tokenizer.vocab_size)
    ids = tokenizer.encode_batch([f.read_text() for f in files])
    return np.concatenate([np.asarray([data.BOS_ID, *x, data.EOS_ID], dtype) for x in ids])


def fixed_windows(tokens: np.ndarray, seq_len: int, batch: int, num_batches: int, seed: int) -> list[np.ndarray]:
    """`num_batches` reproducible [batch, seq_len + 1] windows (the held-out evaluation set)."""
    return list(data.make_training_batches(tokens, seq_len, batch, np.random.default_rng(seed), num_batches))


# ------------------------------------------------------------------------------------------------------------- loop


class Budget:
    """When a run stops and how far along its schedule it is: by optimizer steps, by wall clock, or both.

    `seconds` counts from `started` (the process start: start-up and compilation are inside the budget). Progress by
    time runs from `begin()` (just before the first step) to the deadline, continuing from `resumed_progress`.
    """

    def __init__(self, steps: int | None, seconds: float | None, started: float, resumed_progress: float = 0.0):
        if steps is None and seconds is None:
            raise ValueError("the run has no budget; pass --minutes=M (wall clock) and/or --steps=N")
        if (steps is not None and steps < 1) or (seconds is not None and seconds <= 0):
            raise ValueError(f"steps={steps} and seconds={seconds} must be positive when given")
        self.steps, self.resumed, self.loop_start = steps, resumed_progress, None
        self.deadline = None if seconds is None else started + seconds

    def begin(self) -> None:
        self.loop_start = time.monotonic()

    def progress(self, step: int) -> float:
        """Fraction of the schedule done at `step` (optimizer steps so far, resumes included)."""
        by_steps = step / self.steps if self.steps else 0.0
        by_time = 0.0
        if self.deadline is not None:
            span = max(self.deadline - self.loop_start, 1e-9)
            by_time = self.resumed + (1.0 - self.resumed) * (time.monotonic() - self.loop_start) / span
        return min(1.0, max(by_steps, by_time))

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0


@dataclasses.dataclass
class History:
    """Train loss per logged interval and held-out metrics per evaluation, with their step and tokens seen."""

    train: list = dataclasses.field(default_factory=list)  # {"step", "tokens", "loss", ...}
    held_out: list = dataclasses.field(default_factory=list)  # {"step", "tokens", "loss", ...}

    def plot(self, path: str, title: str, metric: str | None = None, saved_step: int | None = None) -> None:
        """Loss curves (train and held out) vs tokens seen; a second panel with a held-out `metric` when given; a
        dotted line at `saved_step` (the params saved as the checkpoint) when given."""
        plt = plots.pyplot()
        panels = 2 if metric else 1
        fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
        ax = axes[0, 0]
        ax.plot([r["tokens"] / 1e6 for r in self.train], [r["loss"] for r in self.train], lw=1, label="train")
        ax.plot([r["tokens"] / 1e6 for r in self.held_out], [r["loss"] for r in self.held_out], "o-", label="held out")
        if saved_step is not None:
            tokens = next(r["tokens"] for r in self.held_out if r["step"] == saved_step)
            ax.axvline(tokens / 1e6, color="gray", ls=":", label=f"saved (step {saved_step})")
        ax.set_xlabel("tokens seen (M)")
        ax.set_ylabel("loss (nats)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        if metric:
            ax = axes[0, 1]
            ax.plot([r["tokens"] / 1e6 for r in self.held_out], [r[metric] for r in self.held_out], "o-")
            ax.set_xlabel("tokens seen (M)")
            ax.set_ylabel(f"held-out {metric}")
            ax.grid(alpha=0.3)
        plots.save(fig, path, dpi=110)


class BestParams:
    """The lowest held-out loss seen so far: its step and metrics and, with `keep`, a device copy of its params (a copy,
    since the train step donates its state: a reference would not survive the next step)."""

    def __init__(self, keep: bool, step: int | None = None, held_out: dict | None = None, params=None):
        self.keep, self.step, self.held_out, self.params = keep, step, held_out, params

    def offer(self, step: int, held_out: dict, params) -> bool:
        """Record the evaluation `held_out` (with "loss") of `params` at `step`; True when it is the new best (the
        first one, or a strictly lower loss; a NaN loss never is)."""
        if self.step is not None and not held_out["loss"] < self.held_out["loss"]:
            return False
        self.step, self.held_out = step, held_out
        if self.keep:
            self.params = jax.tree.map(jnp.copy, params)
        return True

    def summary(self) -> dict:
        return {"step": self.step, "held_out": self.held_out}

    def to_save(self, step: int, params) -> tuple[int, Any]:
        """(step, params) of the checkpoint to ship: the best ones when kept, else the given last ones."""
        if not self.keep:
            return step, params
        if self.params is None:
            raise ValueError("no held-out evaluation was offered, so there are no best params to save; call "
                             "evaluate_final before saving")
        return self.step, self.params


class StateCheckpointer:
    """Resumable train state under `directory` (orbax, latest step only): TrainState, the kept best params + JSON meta.

    `identity` (JSON-able: the config, the target...) is stored with every save; restoring a state saved under another
    identity raises ValueError.
    """

    def __init__(self, directory: str, identity: dict):
        self.directory = os.path.abspath(directory)
        self.identity = json.loads(json.dumps(identity))

    def _manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True, enable_async_checkpointing=False)
        return ocp.CheckpointManager(self.directory, options=options,
                                     item_handlers={"state": ocp.StandardCheckpointHandler(),
                                                    "meta": ocp.JsonCheckpointHandler()})

    def save(self, step: int, state: TrainState, meta: dict, best: BestParams) -> None:
        tree = state._asdict()
        if best.params is not None:
            tree["best_params"] = best.params
        meta = {**meta, "identity": self.identity, "best": best.summary(), "best_params": best.params is not None}
        with self._manager() as mngr:
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)),
                      force=True)
            mngr.wait_until_finished()

    def restore(self, like: TrainState, keep_best: bool) -> tuple[TrainState, dict, BestParams] | None:
        """The latest saved (state, meta, best) in the layout of `like`, or None when nothing is saved. With
        `keep_best`, a state saved without best params starts a fresh BestParams (its best so far is lost)."""
        if not os.path.isdir(self.directory):
            return None
        with self._manager() as mngr:
            step = mngr.latest_step()
            if step is None:
                return None
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            if meta.get("identity") != self.identity:
                raise ValueError(f"the train state in {self.directory} belongs to another run (config or target "
                                 f"differ); drop --resume or use another --state_dir")
            tree = like._asdict()
            if meta["best_params"]:
                tree["best_params"] = like.params
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
            tree = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        best_params = tree.pop("best_params", None)
        if keep_best and best_params is None:
            best = BestParams(keep=True)
        else:
            best = BestParams(keep_best, **meta["best"], params=best_params if keep_best else None)
        return TrainState(**tree), meta, best


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    eval_every: float = 0.05  # held-out evaluation period, as a fraction of the budget (plus one at the start)
    save_every_s: float = 120.0  # train-state checkpoint period (0: only at the end)
    log_every: int = 20  # steps per train-loss record

    def __post_init__(self):
        if not 0 < self.eval_every <= 1:
            raise ValueError(f"eval_every={self.eval_every} is a fraction of the budget; use a value in (0, 1], "
                             f"e.g. 0.05 for 20 held-out evaluations per run")


def train_loop(state: TrainState, step_fn: Callable, next_batch: Callable[[int], tuple], evaluate: Callable,
               budget: Budget, optim: OptimConfig, loop: LoopConfig, history: History, best: BestParams,
               tokens_per_step: int, start_step: int, checkpointer: StateCheckpointer | None,
               meta: Callable[[int, float], dict]):
    """Run `step_fn(state, *next_batch(step), lr)` until the budget ends; evaluate and save periodically.

    `evaluate(params) -> dict` (with "loss") runs at the start (unless `history` has evaluations already) and every
    `loop.eval_every` of the budget's progress; each evaluation is offered to `best`. `meta(step, progress)` is stored
    with each train-state save. At most one step is in flight ahead of the host, so the clock checks are honest.
    Returns (state, step, last metrics).
    """
    step, pending, window = start_step, None, []
    if not history.held_out:
        _evaluate(evaluate, state.params, step, tokens_per_step, history, best)
    last_save = time.monotonic()
    saved_step = start_step  # a resumed state is already saved; a fresh one needs no save before its first step
    budget.begin()
    next_eval = _next_mark(budget.progress(step), loop.eval_every)
    bar = tqdm(total=budget.steps, initial=start_step, mininterval=10.0, file=sys.stderr, unit="step")
    last = {}
    while not budget.done(step):
        progress = budget.progress(step)
        lr = jnp.float32(optim.learning_rate(step, progress))
        state, metrics = step_fn(state, *next_batch(step), lr)
        step += 1
        if pending is not None:
            last = _record(pending, window, history, loop, tokens_per_step, bar)
        pending = (step, metrics, float(lr))
        progress = budget.progress(step)
        if progress >= next_eval:
            _evaluate(evaluate, state.params, step, tokens_per_step, history, best)
            next_eval = _next_mark(progress, loop.eval_every)
        if checkpointer is not None and loop.save_every_s and time.monotonic() - last_save >= loop.save_every_s:
            checkpointer.save(step, state, meta(step, budget.progress(step)), best)
            last_save, saved_step = time.monotonic(), step
    if pending is not None:
        last = _record(pending, window, history, loop, tokens_per_step, bar, flush=True)
    bar.close()
    if checkpointer is not None and saved_step != step:
        checkpointer.save(step, state, meta(step, budget.progress(step)), best)
    return state, step, last


def _next_mark(progress: float, every: float) -> float:
    """The first multiple of `every` above `progress` (the next evaluation's progress)."""
    return (math.floor(progress / every + 1e-9) + 1) * every


def _record(pending, window: list, history: History, loop: LoopConfig, tokens_per_step: int, bar, flush=False):
    step, metrics, lr = pending
    host = {k: np.asarray(v) for k, v in metrics.items()}
    window.append(float(host["loss"]))
    bar.update(1)
    bar.set_postfix(loss=f"{host['loss']:.3f}", lr=f"{lr:.2e}", refresh=False)
    if len(window) >= loop.log_every or flush:
        history.train.append({"step": step, "tokens": step * tokens_per_step, "loss": float(np.mean(window)),
                              "lr": lr})
        window.clear()
    return host


def _evaluate(evaluate: Callable, params, step: int, tokens_per_step: int, history: History,
              best: BestParams) -> dict:
    start = time.perf_counter()
    result = evaluate(params)
    history.held_out.append({"step": step, "tokens": step * tokens_per_step, **result})
    improved = best.offer(step, result, params)
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items() if k not in ("acc", "chain")}
    say(f"step {step}: held-out {shown} ({time.perf_counter() - start:.1f} s){' best so far' if improved else ''}")
    return result


def evaluate_final(evaluate: Callable, params, step: int, tokens_per_step: int, history: History,
                   best: BestParams) -> dict:
    """The end-of-run held-out evaluation, offered to `best` (recorded unless the last periodic one was at this step:
    that one is reused)."""
    if history.held_out and history.held_out[-1]["step"] == step:
        result = {k: v for k, v in history.held_out[-1].items() if k not in ("step", "tokens")}
        best.offer(step, result, params)  # a no-op unless `best` started after that evaluation (a resumed run)
        return result
    return _evaluate(evaluate, params, step, tokens_per_step, history, best)


MAX_EPOCHS = 2.0  # beyond this many passes over its training tokens a run is warned about overfitting


def count_epochs(tokens_seen: int, corpus: Corpus, script: str) -> float:
    """Epochs of `corpus`'s training tokens that `tokens_seen` make; logs a warning beyond MAX_EPOCHS."""
    epochs = tokens_seen / corpus.train.size
    if epochs > MAX_EPOCHS:
        logging.warning(
            "%s saw %.1f epochs of its %.2f M training tokens (roots %s); beyond %g epochs a model this size overfits "
            "(its held-out loss rises again). Train on more tokens: the default roots (drop --roots: the standard "
            "library plus the installed packages), or shorten --steps/--minutes.", script, epochs,
            corpus.train.size / 1e6, corpus.stats["roots"], MAX_EPOCHS)
    return epochs


def sum_over(eval_fn: Callable, batches: Sequence[tuple]) -> dict:
    """Sum a jitted evaluation's dict of arrays over batches (one host transfer at the end)."""
    total = None
    for args in batches:
        out = eval_fn(*args)
        total = out if total is None else jax.tree.map(jnp.add, total, out)
    return jax.device_get(total)


class RunTimes(NamedTuple):
    """Wall-clock facts of a training run (seconds from time.monotonic())."""

    started: float
    compile_s: float
    loop_s: float
    start_step: int  # the step the loop began at (> 0 after --resume)


def run_record(name: str, run: "RunConfig", corpus: "Corpus", history: "History", best: "BestParams", *, step: int,
               final: dict, params, tokens_per_step: int, times: RunTimes, saved_step: int, checkpoint_bytes: int,
               run_extra: dict) -> dict:
    """The results-JSON fields both training scripts share; each script adds its own (config, target, metrics)."""
    tokens_seen = step * tokens_per_step
    return {
        "params": count_params(params),
        "device": device_name(),
        "jax": jax.__version__,
        "run": {"batch": run.batch, "seq_len": run.seq_len, **run_extra, "optimizer": dataclasses.asdict(run.optim),
                "minutes": run.minutes, "max_steps": run.steps, "seed": run.seed, "eval_every": run.loop.eval_every,
                "keep_best": run.keep_best, "precision": "float32 master weights, bf16 compute and checkpoint"},
        "corpus": corpus.stats,
        "steps": step,
        "tokens_seen": tokens_seen,
        "epochs": count_epochs(tokens_seen, corpus, name),
        "final_train_loss": history.train[-1]["loss"] if history.train else None,
        "final": {"step": step, "held_out": final},
        "best": best.summary(),  # the lowest held-out loss of the run's evaluations
        "seconds": {"total": round(time.monotonic() - times.started, 1), "data": corpus.stats["seconds"],
                    "compile": round(times.compile_s, 1), "train_loop": round(times.loop_s, 1)},
        "tokens_per_second": round((step - times.start_step) * tokens_per_step / max(times.loop_s, 1e-9)),
        "checkpoint": {"dir": run.out, "bytes": checkpoint_bytes, "step": saved_step,
                       "params": "best held-out" if run.keep_best else "last"},
    }


def write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def write_results(results_dir: str, name: str, results: dict, history: History, title: str, metric: str,
                  saved_step: int | None) -> None:
    """A run's results as <results_dir>/<name>.json and its curves as <name>_loss.png (the names train_all.sh
    ships back)."""
    write_json(os.path.join(results_dir, f"{name}.json"), results)
    history.plot(os.path.join(results_dir, f"{name}_loss.png"), title, metric=metric, saved_step=saved_step)


def dir_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


# --------------------------------------------------------------------------------------------------------- run setup


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Settings common to both training scripts (their absl flags, see define_run_flags)."""

    out: str  # the final bf16 checkpoint (kdtree_jax.checkpoint)
    state_dir: str  # the resumable train state (orbax)
    results_dir: str = "experiments/results"
    steps: int | None = None
    minutes: float | None = None  # wall clock from process start, start-up and compilation included
    batch: int = 32
    seq_len: int = 512
    optim: OptimConfig = OptimConfig()
    loop: LoopConfig = LoopConfig()
    eval_batches: int = 8
    roots: tuple[str, ...] | None = None  # None: default_roots()
    tokenizer: str = "checkpoints/tokenizer.json"
    token_cache: str | None = "checkpoints"
    resume: bool = False
    seed: int = 0
    keep_best: bool = True  # save the params of the lowest held-out loss (False: the last params)


def define_run_flags(*, out: str, state_dir: str, minutes: float, batch: int, seq_len: int, lr: float) -> None:
    """Define the absl flags of RunConfig with a script's defaults."""
    flags.DEFINE_string("out", out, "directory of the final bf16 checkpoint (replaced when it holds one)")
    flags.DEFINE_string("state_dir", state_dir, "directory of the resumable train state")
    flags.DEFINE_string("results_dir", "experiments/results", "where the results JSON and loss plot go")
    flags.DEFINE_integer("steps", None, "stop after this many optimizer steps (with --minutes: whichever first)")
    flags.DEFINE_float("minutes", minutes, "wall-clock budget from process start, start-up and compilation "
                       "included (the final evaluation and save come after); 0: steps only")
    flags.DEFINE_integer("batch", batch, "sequences per step")
    flags.DEFINE_integer("seq_len", seq_len, "tokens per sequence")
    flags.DEFINE_float("lr", lr, "peak learning rate")
    flags.DEFINE_integer("warmup", OptimConfig.warmup_steps, "linear warmup steps")
    flags.DEFINE_float("weight_decay", OptimConfig.weight_decay, "AdamW decoupled weight decay (matrices only)")
    flags.DEFINE_float("eval_every", LoopConfig.eval_every, "held-out evaluation period as a fraction of the "
                       "budget (of --steps or --minutes, whichever ends the run first)")
    flags.DEFINE_bool("keep_best", RunConfig.keep_best, "save the params of the lowest held-out loss (a device copy "
                      "kept at each improvement) as the checkpoint; --nokeep_best saves the last params")
    flags.DEFINE_float("save_every_minutes", LoopConfig.save_every_s / 60, "train-state save period (0: at end)")
    flags.DEFINE_integer("eval_batches", RunConfig.eval_batches, "held-out batches per evaluation")
    flags.DEFINE_list("roots", None, "source roots (comma-separated); default: the standard library and the "
                      "installed packages")
    flags.DEFINE_string("tokenizer", RunConfig.tokenizer, "tokenizer JSON")
    flags.DEFINE_string("token_cache", RunConfig.token_cache, "directory caching the training token stream")
    flags.DEFINE_bool("resume", False, "continue from the train state in --state_dir when there is one")
    flags.DEFINE_integer("seed", 0, "initialisation and data seed")


def run_config_from_flags() -> RunConfig:
    f = flags.FLAGS
    return RunConfig(
        out=f.out, state_dir=f.state_dir, results_dir=f.results_dir, steps=f.steps, minutes=f.minutes or None,
        batch=f.batch,
        seq_len=f.seq_len, optim=OptimConfig(lr=f.lr, warmup_steps=f.warmup, weight_decay=f.weight_decay),
        loop=LoopConfig(eval_every=f.eval_every, save_every_s=60 * f.save_every_minutes),
        eval_batches=f.eval_batches, roots=tuple(f.roots) if f.roots else None, tokenizer=f.tokenizer,
        token_cache=f.token_cache or None, resume=f.resume, seed=f.seed, keep_best=f.keep_best)


def default_roots() -> list[str]:
    """The standard library and this interpreter's installed packages."""
    return [data.stdlib_root(), *data.package_roots()]


def compile_ahead(fn, *args):
    """(compiled fn, seconds): compile before the clock of the schedule starts."""
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - start


def save_model(directory: str, module: nnx.Module) -> int:
    """Write `module` (as built, e.g. bf16) with kdtree_jax.checkpoint.save, replacing the checkpoint of the same
    kind already in `directory`; returns the checkpoint's size in bytes."""
    if os.path.isdir(directory) and os.listdir(directory):
        try:
            kind = checkpoint.read_meta(directory)["kind"]
        except ValueError as e:
            raise ValueError(f"{directory} exists and holds no checkpoint ({e}); choose another --out") from e
        want = checkpoint.TARGET if isinstance(module, Transformer) else checkpoint.DRAFTER
        if kind != want:
            raise ValueError(f"{directory} holds a {kind} checkpoint; choose another --out for the {want}")
        shutil.rmtree(directory)
    checkpoint.save(directory, module)
    return dir_bytes(directory)


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}"
