"""Train the project's byte-level BPE tokenizer on the training split of Python source files and save it.

The shipped checkpoints/tokenizer.json is trained on the standard library only (the default roots), so every machine
can reproduce it:
  .venv/bin/python experiments/train_tokenizer.py --vocab_size=4096 --out=checkpoints/tokenizer.json
Prints the split's file counts (near copies of held-out files set aside too) and bytes and the tokens per byte on the training and held-out files.
"""
from __future__ import annotations

import json
import os
import sys
import time

from absl import flags

from kdtree_jax import cli, data

FLAGS = flags.FLAGS
flags.DEFINE_integer("vocab_size", data.DEFAULT_VOCAB_SIZE, "vocabulary size, special and byte tokens included")
flags.DEFINE_string("out", "checkpoints/tokenizer.json", "where to write the tokenizer")
flags.DEFINE_list("roots", None, "source roots (comma-separated); default: this interpreter's standard library")
flags.DEFINE_integer("max_file_bytes", data.DEFAULT_MAX_FILE_BYTES, "skip source files larger than this")


def _count_tokens(tokenizer: data.Tokenizer, files) -> int:
    return sum(len(ids) for ids in tokenizer.encode_batch([f.read_text() for f in files]))


def _count_bytes(files) -> int:
    return sum(os.path.getsize(f.path) for f in files)


def main(argv):
    del argv
    roots = FLAGS.roots or [data.stdlib_root()]
    files = data.find_source_files(roots, max_bytes=FLAGS.max_file_bytes)
    split = data.split_files(files)
    train, held_out = split.train, split.held_out
    start = time.perf_counter()
    tokenizer = data.train_tokenizer(train, vocab_size=FLAGS.vocab_size)
    train_s = time.perf_counter() - start
    tokenizer.save(FLAGS.out)
    train_bytes, held_out_bytes = _count_bytes(train), _count_bytes(held_out)
    stats = {
        "python": sys.version.split()[0],
        "roots": roots,
        "vocab_size": tokenizer.vocab_size,
        "files_train": len(train),
        "files_held_out": len(held_out),
        "files_near_copies_set_aside": len(split.near_copies),
        "bytes_train": train_bytes,
        "bytes_held_out": held_out_bytes,
        "tokens_per_byte_train": _count_tokens(tokenizer, train) / train_bytes,
        "tokens_per_byte_held_out": _count_tokens(tokenizer, held_out) / held_out_bytes,
        "train_seconds": round(train_s, 1),
        "out": FLAGS.out,
        "out_bytes": os.path.getsize(FLAGS.out),
        "sha256": tokenizer.fingerprint(),
    }
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    cli.run(main)
