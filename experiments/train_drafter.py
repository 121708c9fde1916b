"""Train the DFlash drafter (preset code_drafter) of a trained target, which stays frozen.

Per batch the target runs once over training windows (naive MLA path) for the hidden states of the drafter's target
layers and its greedy next tokens; --anchors random anchors per window each make a block [token, MASK x (L-1)] that
sees the context features of the positions before it, labelled with the target's greedy tokens and weighted
exp(-(k-1)/gamma) by block position k (kdtree_jax.training.drafter_objective). Held-out metrics on fixed windows and
anchors: the weighted loss, per-position accuracy, the chain acceptance P(first k drafts right) and the expected tokens
per round of chain decoding, tau = 1 + sum_k P(first k right), every --eval_every of the budget and at the end. The
bf16 checkpoint (--out) holds the params of the lowest held-out loss (--nokeep_best: the last ones). Also writes the
resumable train state, results/training/train_drafter.json (with the epochs of the corpus seen: beyond 2 a warning) and
results/training/train_drafter_loss.png.

  H200, inside one call:  PYTHONPATH=. python3 experiments/train_drafter.py --minutes=2.5
  CPU smoke run:          .venv/bin/python experiments/train_drafter.py --steps=5 --batch=2 --seq_len=64 \\
                            --anchors=4 --roots=<stdlib> --target=tmp/target --out=tmp/drafter \\
                            --state_dir=tmp/drafter_state --results_dir=tmp/results
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

_STARTED = time.monotonic()  # --minutes counts from here

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from flax import nnx  # noqa: E402

from kdtree_jax import checkpoint, cli, config, data  # noqa: E402
from kdtree_jax.drafter import Drafter  # noqa: E402
from kdtree_jax.training.corpus import default_roots, fixed_windows, load_corpus  # noqa: E402
from kdtree_jax.training.drafter_objective import (drafter_summary, draw_anchors, make_drafter_eval,  # noqa: E402
                                                   make_drafter_step, position_weights)
from kdtree_jax.training.loop import (Budget, History, compile_ahead, evaluate_final, say, sum_over,  # noqa: E402
                                      train_loop)
from kdtree_jax.training.optim import make_optimizer  # noqa: E402
from kdtree_jax.training.precision import count_params, master_params  # noqa: E402
from kdtree_jax.training.run import (RunConfig, RunTimes, define_run_flags, run_config_from_flags,  # noqa: E402
                                     run_record, save_model, setup_process, write_results)
from kdtree_jax.training.train_state import BestParams, StateCheckpointer, TrainState  # noqa: E402

NAME = "train_drafter"


def train(run: RunConfig, target_dir: str, num_anchors: int, gamma: float, started: float,
          drafter_config: Callable[[config.ModelConfig], config.DrafterConfig] = config.code_drafter) -> dict:
    """Train a drafter (`drafter_config(target config)`) against the frozen target in `target_dir`; save it and the
    results; returns the results dict."""
    tokenizer = data.load_tokenizer(run.tokenizer)
    target = checkpoint.restore_target(target_dir)
    if tokenizer.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"the target in {target_dir} has vocab_size={target.cfg.vocab_size} but the tokenizer "
                         f"{run.tokenizer} has {tokenizer.vocab_size}; use the tokenizer it was trained with")
    dcfg = drafter_config(target.cfg)
    size = dcfg.block_size
    weights = position_weights(size, gamma)
    corpus = load_corpus(run.roots or default_roots(), tokenizer, run.token_cache)
    say(f"corpus: {corpus.stats}")

    target_graphdef, target_params = nnx.split(target)
    layout, params = master_params(Drafter(dcfg, target.cfg, nnx.Rngs(run.seed)))
    optimizer = make_optimizer(params, run.optim)
    state = TrainState(params, optimizer.init(params))
    checkpointer = StateCheckpointer(run.state_dir, {"config": dataclasses.asdict(dcfg),
                                                     "target": os.path.abspath(target_dir)})
    step, progress, history, best = 0, 0.0, History(), BestParams(run.keep_best)
    if run.resume and (got := checkpointer.restore(state, run.keep_best)) is not None:
        state, meta, best = got
        step, progress, history = meta["step"], meta["progress"], History(**meta["history"])
        say(f"resumed at step {step} (progress {progress:.3f})")

    # Windows of seq_len tokens: the target's greedy labels come from its own logits, not from a shifted window.
    rng = np.random.default_rng([run.seed, step])
    windows = data.make_training_batches(corpus.train, run.seq_len - 1, run.batch, rng)
    eval_rng = np.random.default_rng(run.seed + 1)
    held_out = [(w, draw_anchors(eval_rng, run.batch, run.seq_len, num_anchors, size))
                for w in fixed_windows(corpus.held_out, run.seq_len - 1, run.batch, run.eval_batches,
                                       seed=run.seed)]

    def next_batch(_):
        return target_params, next(windows), draw_anchors(rng, run.batch, run.seq_len, num_anchors, size)

    step_fn, step_s = compile_ahead(make_drafter_step(layout, target_graphdef, optimizer, weights),
                                    state, *next_batch(0), np.float32(run.optim.lr))
    eval_fn, eval_s = compile_ahead(make_drafter_eval(layout, target_graphdef, weights),
                                    state.params, target_params, *held_out[0])
    say(f"compiled the train step in {step_s:.1f} s and the evaluation in {eval_s:.1f} s")

    def evaluate(p):
        return drafter_summary(sum_over(eval_fn, [(p, target_params, *b) for b in held_out]))

    def meta(at_step, at_progress):
        return {"step": at_step, "progress": at_progress, "history": dataclasses.asdict(history)}

    tokens_per_step = run.batch * run.seq_len
    budget = Budget(run.steps, run.minutes and 60 * run.minutes, started, progress)
    loop_start, start_step = time.monotonic(), step
    state, step, last = train_loop(state, step_fn, next_batch, evaluate, budget, run.optim, run.loop,
                                   history, best, tokens_per_step, step, checkpointer, meta)
    loop_s = time.monotonic() - loop_start
    final = evaluate_final(evaluate, state.params, step, tokens_per_step, history, best)
    saved_step, params = best.to_save(step, state.params)
    params = jax.device_get(params)
    checkpoint_bytes = save_model(run.out, layout.module(params))

    train_metrics = drafter_summary({**last, "loss_sum": last["loss"] * last["blocks"]}) if last else {}
    times = RunTimes(started, step_s + eval_s, loop_s, start_step)
    results = {"config": dataclasses.asdict(dcfg),
               "target": {"dir": target_dir, "config": target.cfg.name,
                          "params": count_params(target_params)},
               **run_record(NAME, run, corpus, history, best, step=step, final=final, params=params,
                            tokens_per_step=tokens_per_step, times=times, saved_step=saved_step,
                            checkpoint_bytes=checkpoint_bytes,
                            run_extra={"anchors": num_anchors, "gamma": gamma}),
               "blocks_seen": step * run.batch * num_anchors,
               "final_train_batch": train_metrics}  # loss, tau, per-position acc and chain of the last step's batch
    write_results(run.results_dir, NAME, results, history,
                  f"drafter of {target.cfg.name}: {results['params'] / 1e6:.1f}M params, {step} steps",
                  metric="tau", saved_step=saved_step)
    return results


def define_flags() -> None:
    """The script's flags (defined only when run as a script, so tests can import `train`)."""
    define_run_flags(out="checkpoints/drafter", state_dir="tmp/train_state/drafter", minutes=2.5, batch=32,
                     seq_len=512, lr=1e-3)
    flags.DEFINE_string("target", "checkpoints/target", "the trained target's checkpoint directory")
    flags.DEFINE_integer("anchors", 32, "anchor positions (blocks) per training window")
    flags.DEFINE_float("gamma", 7.0, "loss weight decay over block positions: exp(-(k-1)/gamma)")


def main(argv):
    del argv
    setup_process()
    f = flags.FLAGS
    results = train(run_config_from_flags(), f.target, f.anchors, f.gamma, _STARTED)
    print(json.dumps({k: results[k] for k in ("params", "steps", "tokens_seen", "epochs", "final_train_loss", "final",
                                              "best", "seconds", "tokens_per_second", "checkpoint")}, indent=1))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
