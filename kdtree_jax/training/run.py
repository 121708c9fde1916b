"""What both training scripts share around the loop: their flags (RunConfig), the process setup, the results record
(JSON and loss plot) and the saved bf16 model.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import NamedTuple

import jax
from absl import flags, logging
from flax import nnx

from kdtree_jax import checkpoint
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.training.corpus import Corpus, count_epochs
from kdtree_jax.training.loop import History, LoopConfig
from kdtree_jax.training.optim import OptimConfig
from kdtree_jax.training.precision import count_params
from kdtree_jax.training.train_state import BestParams


def setup_process() -> None:
    """For a training script's process: lower `ragged_dot` to dense dot_generals on GPU too (the CPU lowering,
    gradients included), and keep the libraries' INFO logs (orbax's per-save chatter) off the console."""
    jax.config.update("jax_ragged_dot_use_ragged_dot_instruction", False)
    logging.set_verbosity(logging.WARNING)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Settings common to both training scripts (their absl flags, see define_run_flags)."""

    out: str  # the final bf16 checkpoint (kdtree_jax.checkpoint)
    state_dir: str  # the resumable train state (orbax)
    results_dir: str = "experiments/results/training"
    steps: int | None = None
    minutes: float | None = None  # wall clock from process start, start-up and compilation included
    batch: int = 32
    seq_len: int = 512
    optim: OptimConfig = OptimConfig()
    loop: LoopConfig = LoopConfig()
    eval_batches: int = 8
    roots: tuple[str, ...] | None = None  # None: corpus.default_roots()
    tokenizer: str = "checkpoints/tokenizer.json"
    token_cache: str | None = "checkpoints"
    resume: bool = False
    seed: int = 0
    keep_best: bool = True  # save the params of the lowest held-out loss (False: the last params)


def define_run_flags(*, out: str, state_dir: str, minutes: float, batch: int, seq_len: int, lr: float) -> None:
    """Define the absl flags of RunConfig with a script's defaults."""
    flags.DEFINE_string("out", out, "directory of the final bf16 checkpoint (replaced when it holds one)")
    flags.DEFINE_string("state_dir", state_dir, "directory of the resumable train state")
    flags.DEFINE_string("results_dir", "experiments/results/training", "where the results JSON and loss plot go")
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


class RunTimes(NamedTuple):
    """Wall-clock facts of a training run (seconds from time.monotonic())."""

    started: float
    compile_s: float
    loop_s: float
    start_step: int  # the step the loop began at (> 0 after --resume)


def run_record(name: str, run: RunConfig, corpus: Corpus, history: History, best: BestParams, *, step: int,
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


def save_model(directory: str, module: nnx.Module) -> int:
    """Write `module` (as built, e.g. bf16) with kdtree_jax.checkpoint.save, replacing the checkpoint of the same
    kind already in `directory`; returns the checkpoint's size in bytes."""
    if os.path.isdir(directory) and os.listdir(directory):
        try:
            kind = checkpoint.read_meta(directory, any_layout=True)["kind"]
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
