"""Train the project's K2-architecture target (preset code_target) on Python source: next-token cross-entropy.

Training windows come from the training split only (kdtree_jax.data: held-out files and their near copies never);
the held-out loss and perplexity are measured on fixed windows of the held-out files. AdamW (warmup, then cosine over
the run's progress) on float32 master weights, bf16 compute; the router's correction bias follows the aux-free
balancing rule (--router_bias_rate, 0 leaves it at zero). The held-out set is evaluated every --eval_every of the
budget and at the end; the bf16 checkpoint (--out, kdtree_jax.checkpoint) holds the params of the lowest held-out loss
(--nokeep_best: the last ones). Also writes the resumable train state (--state_dir), results/training/train_target.json (with
the epochs of the corpus seen: beyond 2 a warning, the fix being the default --roots) and
results/training/train_target_loss.png.

  H200, inside one call:  PYTHONPATH=. python3 experiments/train_target.py --minutes=5.5
  CPU smoke run:          .venv/bin/python experiments/train_target.py --steps=5 --batch=2 --seq_len=64 \\
                            --roots=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])') \\
                            --out=tmp/target --state_dir=tmp/target_state --results_dir=tmp/results
"""
from __future__ import annotations

import dataclasses
import json
import time

_STARTED = time.monotonic()  # --minutes counts from here

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from flax import nnx  # noqa: E402

from kdtree_jax import cli, config, data  # noqa: E402
from kdtree_jax.model.transformer import Transformer  # noqa: E402
from kdtree_jax.training.corpus import default_roots, fixed_windows, load_corpus  # noqa: E402
from kdtree_jax.training.loop import (Budget, History, compile_ahead, evaluate_final, say, sum_over,  # noqa: E402
                                      train_loop)
from kdtree_jax.training.optim import make_optimizer  # noqa: E402
from kdtree_jax.training.precision import master_params  # noqa: E402
from kdtree_jax.training.run import (RunConfig, RunTimes, define_run_flags, run_config_from_flags,  # noqa: E402
                                     run_record, save_model, setup_process, write_results)
from kdtree_jax.training.target_objective import make_target_eval, make_target_step, target_summary  # noqa: E402
from kdtree_jax.training.train_state import BestParams, StateCheckpointer, TrainState  # noqa: E402

NAME = "train_target"


def train(cfg: config.ModelConfig, run: RunConfig, router_bias_rate: float, started: float) -> dict:
    """Train `cfg` from scratch (or resume), save the bf16 checkpoint and the results; returns the results dict."""
    tokenizer = data.load_tokenizer(run.tokenizer)
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ValueError(f"config {cfg.name!r} has vocab_size={cfg.vocab_size} but the tokenizer {run.tokenizer} "
                         f"has {tokenizer.vocab_size}; use a config made for this tokenizer (code_target)")
    if run.seq_len > cfg.max_position_embeddings:
        raise ValueError(f"seq_len={run.seq_len} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    corpus = load_corpus(run.roots or default_roots(), tokenizer, run.token_cache)
    say(f"corpus: {corpus.stats}")

    layout, params = master_params(Transformer(cfg, nnx.Rngs(run.seed)))
    optimizer = make_optimizer(params, run.optim)
    state = TrainState(params, optimizer.init(params))
    checkpointer = StateCheckpointer(run.state_dir, {"config": dataclasses.asdict(cfg)})
    step, progress, history, best = 0, 0.0, History(), BestParams(run.keep_best)
    if run.resume and (got := checkpointer.restore(state, run.keep_best)) is not None:
        state, meta, best = got
        step, progress, history = meta["step"], meta["progress"], History(**meta["history"])
        say(f"resumed at step {step} (progress {progress:.3f})")

    batches = data.make_training_batches(corpus.train, run.seq_len, run.batch, np.random.default_rng([run.seed, step]))
    held_out = fixed_windows(corpus.held_out, run.seq_len, run.batch, run.eval_batches, seed=run.seed)
    lr0 = np.float32(run.optim.lr)
    step_fn, step_s = compile_ahead(make_target_step(layout, optimizer, router_bias_rate),
                                    state, held_out[0], lr0)
    eval_fn, eval_s = compile_ahead(make_target_eval(layout), state.params, held_out[0])
    say(f"compiled the train step in {step_s:.1f} s and the evaluation in {eval_s:.1f} s")

    def evaluate(p):
        return target_summary(sum_over(eval_fn, [(p, w) for w in held_out]))

    def meta(at_step, at_progress):
        return {"step": at_step, "progress": at_progress, "history": dataclasses.asdict(history)}

    tokens_per_step = run.batch * run.seq_len
    budget = Budget(run.steps, run.minutes and 60 * run.minutes, started, progress)
    loop_start, start_step = time.monotonic(), step
    state, step, last = train_loop(state, step_fn, lambda _: (next(batches),), evaluate, budget, run.optim,
                                   run.loop, history, best, tokens_per_step, step, checkpointer, meta)
    loop_s = time.monotonic() - loop_start
    final = evaluate_final(evaluate, state.params, step, tokens_per_step, history, best)
    saved_step, params = best.to_save(step, state.params)
    params = jax.device_get(params)
    checkpoint_bytes = save_model(run.out, layout.module(params))

    times = RunTimes(started, step_s + eval_s, loop_s, start_step)
    results = {"config": dataclasses.asdict(cfg),
               **run_record(NAME, run, corpus, history, best, step=step, final=final, params=params,
                            tokens_per_step=tokens_per_step, times=times, saved_step=saved_step,
                            checkpoint_bytes=checkpoint_bytes,
                            run_extra={"router_bias_rate": router_bias_rate}),
               "router_load_imbalance": float(last["imbalance"]) if "imbalance" in last else None}
    write_results(run.results_dir, NAME, results, history,
                  f"{cfg.name}: {results['params'] / 1e6:.1f}M params, {step} steps", metric="ppl",
                  saved_step=saved_step)
    return results


def define_flags() -> None:
    """The script's flags (defined only when run as a script, so tests can import `train`)."""
    define_run_flags(out="checkpoints/target", state_dir="tmp/train_state/target", minutes=5.5, batch=32,
                     seq_len=512, lr=2e-3)
    flags.DEFINE_string("config", "code_target", f"target preset, one of {sorted(config.PRESETS)}")
    flags.DEFINE_float("router_bias_rate", 1e-3, "aux-free balancing: per-step change of the router correction "
                       "bias toward balanced expert loads (0: the bias stays at zero)")


def main(argv):
    del argv
    setup_process()
    f = flags.FLAGS
    results = train(config.preset(f.config), run_config_from_flags(), f.router_bias_rate, _STARTED)
    print(json.dumps({k: results[k] for k in ("params", "steps", "tokens_seen", "epochs", "final_train_loss", "final",
                                              "best", "router_load_imbalance", "seconds", "tokens_per_second",
                                              "checkpoint")}, indent=1))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
