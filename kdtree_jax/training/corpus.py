"""The training data: the token streams of the training and held-out splits of the source files (kdtree_jax.data),
the fixed held-out windows, and the epochs a run makes of its training tokens.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np
from absl import logging

from kdtree_jax import data


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


def default_roots() -> list[str]:
    """The standard library and this interpreter's installed packages."""
    return [data.stdlib_root(), *data.package_roots()]


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
