"""The train loop: the budget (steps and/or wall clock), periodic held-out evaluations and train-state saves, the
loss history.

Held-out evaluation. `train_loop` evaluates at the start and every `LoopConfig.eval_every` of the budget;
`train_state.BestParams` keeps a device copy of the params of the lowest held-out loss, which the scripts save instead
of the last params (a small corpus overfits within a few epochs; `corpus.count_epochs` warns beyond MAX_EPOCHS).
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kdtree_jax import plots
from kdtree_jax.training.optim import OptimConfig
from kdtree_jax.training.train_state import BestParams, StateCheckpointer, TrainState


def say(message: str) -> None:
    """A timestamped progress line on stderr that leaves the progress bar intact."""
    tqdm.write(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr)


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


def sum_over(eval_fn: Callable, batches: Sequence[tuple]) -> dict:
    """Sum a jitted evaluation's dict of arrays over batches (one host transfer at the end)."""
    total = None
    for args in batches:
        out = eval_fn(*args)
        total = out if total is None else jax.tree.map(jnp.add, total, out)
    return jax.device_get(total)


def compile_ahead(fn, *args):
    """(compiled fn, seconds): compile before the clock of the schedule starts."""
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - start
