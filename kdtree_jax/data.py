"""Corpus and tokenizer for the project's trained models: Python source files already on every machine.

Corpus. Every `*.py` file under the given roots: the interpreter's standard library everywhere, plus the installed
packages on the GPU training machine. Directories named in SKIP_DIRS are not walked: test suites (Debian and Ubuntu ship
the stdlib's `test/` as a separate package, so skipping it keeps the stdlib corpus alike across machines), the stdlib's
generated codec tables (`encodings/`: a hundred near-identical tables), caches, and installed-package folders nested
inside a stdlib tree (they are a root of their own when wanted). Files over `max_bytes` (generated tables, doc dumps)
and files that are not valid UTF-8 are skipped.

Split. A file is held out when the sha256 of its path relative to its root falls in the lowest HELD_OUT_FRACTION of the
32-bit range. The relative path does not depend on where or which patch version of Python is installed, so the split is
the same on every machine. Held-out files are never trained on (tokenizer included: `train_tokenizer` and
`token_stream` refuse them), nor are near copies of them under another path (a vendored or backported copy, e.g. the
`zipp` package and the stdlib's `zipfile/_path`): `split_files` sets those aside. Evaluation prompts come only from
held-out stdlib files, minus the parts some distributions ship as separate packages (EVAL_EXCLUDED_PREFIXES).

Tokenizer. Byte-level BPE (`tokenizers`): no normalizer, ByteLevel pre-tokenizer and decoder, so any text round-trips
exactly. Special tokens have fixed ids BOS_ID..PAD_ID and are never produced from text: a literal "<|bos|>" in a source
file is encoded as ordinary bytes.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import sysconfig
from typing import Iterable, Iterator, Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

BOS_ID = 0
EOS_ID = 1
MASK_ID = 2  # the drafter's MASK token
PAD_ID = 3
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|mask|>", "<|pad|>")  # SPECIAL_TOKENS[i] has id i

HELD_OUT_FRACTION = 0.05
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "encodings", "__pycache__", "site-packages", "dist-packages"})
# A training file is a near copy of a held-out file when they share at least NEAR_COPY_MIN_LINES distinct stripped
# lines of NEAR_COPY_MIN_LINE_CHARS+ characters, and those are at least NEAR_COPY_FRACTION of the smaller file's lines
# (licence headers and common imports stay below the line count).
NEAR_COPY_MIN_LINE_CHARS = 12
NEAR_COPY_MIN_LINES = 20
NEAR_COPY_FRACTION = 0.5
# Stdlib parts that Debian/Ubuntu ship as separate packages (absent from the GPU machine's Python 3.12.3): no eval
# prompts come from them, so every machine draws the same prompts.
EVAL_EXCLUDED_PREFIXES = ("idlelib/", "lib2to3/", "tkinter/", "turtledemo/", "ctypes/macholib/")
DEFAULT_MAX_FILE_BYTES = 256 * 1024
DEFAULT_VOCAB_SIZE = 4096
PROMPT_SLACK_TOKENS = 16  # eval prompts are encoded from a slice this many tokens longer than needed
_ENCODE_CHUNK_FILES = 256  # files per encode_batch call in token_stream (bounds the memory of Encoding objects)


# ----------------------------------------------------------------------------------------------------------- corpus


@dataclasses.dataclass(frozen=True, order=True)
class SourceFile:
    """One source file: `root` as given, `relpath` relative to it in posix form (the split key), absolute `path`."""

    root: str
    relpath: str
    path: str

    def read_text(self) -> str:
        """The file's exact text (UTF-8, line endings kept)."""
        with open(self.path, "rb") as f:
            return f.read().decode("utf-8")


def stdlib_root() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def package_roots() -> list[str]:
    """The running interpreter's installed-package directories (purelib, then platlib when different) that exist."""
    paths = sysconfig.get_paths()
    roots = []
    for key in ("purelib", "platlib"):
        if os.path.isdir(paths[key]) and paths[key] not in roots:
            roots.append(paths[key])
    return roots


def find_source_files(roots: Iterable[str], max_bytes: int = DEFAULT_MAX_FILE_BYTES,
                      skip_dirs: frozenset[str] = SKIP_DIRS) -> list[SourceFile]:
    """Every readable UTF-8 `*.py` file of at most `max_bytes` under `roots`, not below a directory in `skip_dirs`.

    Sorted by root (in the order given, duplicates dropped), then by relpath. Symlinked directories are not followed.
    """
    roots = list(dict.fromkeys(os.path.abspath(r) for r in roots))
    if not roots:
        raise ValueError("find_source_files got no roots; pass e.g. [kdtree_jax.data.stdlib_root()]")
    missing = [r for r in roots if not os.path.isdir(r)]
    if missing:
        raise ValueError(f"source roots are not directories: {missing}")
    found = []
    for root in roots:
        in_root = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
            for name in filenames:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                if _readable_utf8(path, max_bytes):
                    relpath = os.path.relpath(path, root).replace(os.sep, "/")
                    in_root.append(SourceFile(root, relpath, path))
        found.extend(sorted(in_root))
    if not found:
        raise ValueError(f"no UTF-8 *.py files of at most {max_bytes} bytes under {roots} "
                         f"(directories named {sorted(skip_dirs)} are skipped); check the roots")
    return found


def _readable_utf8(path: str, max_bytes: int) -> bool:
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > max_bytes:
            return False
        with open(path, "rb") as f:
            f.read().decode("utf-8")
        return True
    except (OSError, UnicodeDecodeError):
        return False


def is_held_out(relpath: str) -> bool:
    """Whether a file (by its posix path relative to its root) belongs to the fixed held-out split."""
    bucket = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:4], "big")
    return bucket < HELD_OUT_FRACTION * 2 ** 32


@dataclasses.dataclass(frozen=True)
class CorpusSplit:
    """Files in input order: `train`, `held_out` (by path hash), `near_copies` (of held-out files; in neither use)."""

    train: list[SourceFile]
    held_out: list[SourceFile]
    near_copies: list[SourceFile]


def split_files(files: Iterable[SourceFile]) -> CorpusSplit:
    """Split by path hash, then set aside the would-be training files that nearly copy a held-out file.

    Reads every file. Only held-out files among `files` are guarded: include the stdlib root in the roots of a
    training corpus so the evaluation sources are guarded.
    """
    candidates, held_out = [], []
    for f in files:
        (held_out if is_held_out(f.relpath) else candidates).append(f)
    held_out_lines = [_distinct_lines(f.read_text()) for f in held_out]
    holders = collections.defaultdict(list)  # line -> indices of the held-out files that contain it
    for i, lines in enumerate(held_out_lines):
        for line in lines:
            holders[line].append(i)
    train, near_copies = [], []
    for f in candidates:
        lines = _distinct_lines(f.read_text())
        shared = collections.Counter(i for line in lines for i in holders.get(line, ()))
        is_copy = any(n >= NEAR_COPY_MIN_LINES and n >= NEAR_COPY_FRACTION * min(len(lines), len(held_out_lines[i]))
                      for i, n in shared.items())
        (near_copies if is_copy else train).append(f)
    return CorpusSplit(train, held_out, near_copies)


def _distinct_lines(text: str) -> set[str]:
    return {s for s in (line.strip() for line in text.split("\n")) if len(s) >= NEAR_COPY_MIN_LINE_CHARS}


def _refuse_held_out(files: Sequence[SourceFile], what: str) -> None:
    bad = [f.relpath for f in files if is_held_out(f.relpath)]
    if bad:
        raise ValueError(f"{what} got {len(bad)} held-out files (e.g. {bad[0]!r}); pass only split_files(...).train")


# -------------------------------------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """Thin wrapper over a byte-level BPE `tokenizers.Tokenizer` with the project's special tokens."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    mask_id = MASK_ID
    pad_id = PAD_ID

    def __init__(self, backend: tokenizers.Tokenizer):
        for i, tok in enumerate(SPECIAL_TOKENS):
            if backend.token_to_id(tok) != i:
                raise ValueError(f"tokenizer maps {tok!r} to id {backend.token_to_id(tok)}, the project expects {i}; "
                                 "retrain it with experiments/train_tokenizer.py")
        backend.encode_special_tokens = True  # text is always plain text: "<|bos|>" in a file is not BOS
        self._backend = backend
        self.vocab_size = backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Text -> token ids (no BOS/EOS added)."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts -> token ids each, encoded in parallel."""
        return [e.ids for e in self._backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def token_starts(self, text: str) -> list[int]:
        """The character offset in `text` where each token of encode(text) starts."""
        return [start for start, _ in self._backend.encode(text, add_special_tokens=False).offsets]

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text; special tokens appear as their strings; a cut multi-byte character decodes to U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=False)

    def to_json(self) -> str:
        return self._backend.to_str()

    def fingerprint(self) -> str:
        """sha256 of the serialized tokenizer (keys token caches)."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())


def train_tokenizer(files: Sequence[SourceFile], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE of `vocab_size` tokens (specials and 256 byte tokens included) on training files only."""
    if not files:
        raise ValueError("train_tokenizer got no files; pass split_files(find_source_files(roots)).train")
    _refuse_held_out(files, "train_tokenizer")
    min_size = len(SPECIAL_TOKENS) + 256 + 1
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for merges; use at least {min_size}")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator((f.read_text() for f in files), trainer, length=len(files))
    return Tokenizer(backend)


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer saved by `Tokenizer.save` (e.g. checkpoints/tokenizer.json)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer file at {path!r}; use checkpoints/tokenizer.json or make one with "
                                "experiments/train_tokenizer.py --out=PATH")
    try:
        backend = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the library raises a bare Exception on malformed files
        raise ValueError(f"{path!r} is not a tokenizers JSON file ({e}); "
                         "make one with experiments/train_tokenizer.py") from e
    return Tokenizer(backend)


# ------------------------------------------------------------------------------------------------------ token stream


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding every id."""
    return np.dtype(np.uint16) if vocab_size <= 2 ** 16 else np.dtype(np.uint32)


def token_stream(files: Sequence[SourceFile], tokenizer: Tokenizer, cache_dir: str | None = None) -> np.ndarray:
    """Concatenated tokens of training files, each as [BOS, tokens..., EOS] -> [N] uint16/uint32.

    With `cache_dir` the array is stored there as tokens-<key>.npy, keyed by the tokenizer and the files' paths, sizes
    and modification times, and read back on the next call with the same inputs.
    """
    if not files:
        raise ValueError("token_stream got no files; pass split_files(find_source_files(roots)).train")
    _refuse_held_out(files, "token_stream")
    cache_path = None
    if cache_dir is not None:
        cache_path = os.path.join(cache_dir, f"tokens-{_stream_key(files, tokenizer)}.npy")
        if os.path.isfile(cache_path):
            return np.load(cache_path)
    dtype = token_dtype(tokenizer.vocab_size)
    parts = []
    for start in range(0, len(files), _ENCODE_CHUNK_FILES):
        chunk = files[start:start + _ENCODE_CHUNK_FILES]
        for ids in tokenizer.encode_batch([f.read_text() for f in chunk]):
            parts.append(np.asarray([BOS_ID, *ids, EOS_ID], dtype))
    tokens = np.concatenate(parts)
    if cache_path is not None:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{cache_path}.{os.getpid()}.tmp.npy"
        np.save(tmp, tokens)
        os.replace(tmp, cache_path)
    return tokens


def _stream_key(files: Sequence[SourceFile], tokenizer: Tokenizer) -> str:
    h = hashlib.sha256(tokenizer.fingerprint().encode())
    for f in files:
        st = os.stat(f.path)
        h.update(json.dumps([f.root, f.relpath, st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()[:16]


def make_training_batches(tokens: np.ndarray, seq_len: int, batch_size: int, rng: np.random.Generator,
                          num_batches: int | None = None) -> Iterator[np.ndarray]:
    """Yield [batch_size, seq_len + 1] int32 windows of `tokens` [N] at uniform random starts (forever if no count).

    Inputs are window[:, :-1], next-token targets window[:, 1:].
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D [N], got shape {tokens.shape}")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must both be at least 1")
    if tokens.shape[0] < seq_len + 1:
        raise ValueError(f"{tokens.shape[0]} tokens are too few for windows of seq_len + 1 = {seq_len + 1}; "
                         "lower seq_len or add source roots")
    offsets = np.arange(seq_len + 1)
    produced = 0
    while num_batches is None or produced < num_batches:
        starts = rng.integers(0, tokens.shape[0] - seq_len, size=batch_size)
        yield tokens[starts[:, None] + offsets].astype(np.int32)
        produced += 1


# ------------------------------------------------------------------------------------------------------- evaluation


@dataclasses.dataclass(frozen=True)
class EvalPrompt:
    """A prompt cut from a held-out stdlib file at the start of (1-based) `line`; `text` is `ids` decoded."""

    relpath: str
    line: int
    ids: tuple[int, ...]
    text: str


def eval_prompts(tokenizer: Tokenizer, n: int, prompt_tokens: int, seed: int = 0,
                 roots: Sequence[str] | None = None) -> list[EvalPrompt]:
    """`n` deterministic prompts of exactly `prompt_tokens` ids from held-out files (default roots: the stdlib).

    Each prompt is the tokenization of a file's text from the start of a non-blank line, cut to `prompt_tokens`; no
    BOS is prepended. Files are visited in an order hashed from (seed, relpath), one line per file per pass; a file's
    usable lines in an order hashed from (seed, relpath, the text the prompt is cut from). So the prompts depend on
    no line numbers: a patch release that edits other parts of a file leaves them alone, and machines whose files
    agree draw the same prompts. Files under EVAL_EXCLUDED_PREFIXES are not used, so every machine has the same files.
    """
    if n < 1:
        raise ValueError(f"n={n}: ask for at least one prompt")
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens}: an empty prompt cannot be decoded from; use at least 1")
    held_out = [f for f in find_source_files(roots if roots is not None else [stdlib_root()])
                if is_held_out(f.relpath) and not f.relpath.startswith(EVAL_EXCLUDED_PREFIXES)]
    held_out.sort(key=lambda f: _hash_int(f"{seed}/{f.relpath}"))
    per_file = []
    for f in held_out:
        text = f.read_text()
        starts = _prompt_line_starts(text, tokenizer, prompt_tokens)
        starts.sort(key=lambda s: _hash_int(f"{seed}/{f.relpath}/{text[s[1]:s[2]]}"))
        per_file.append((f, text, starts))
    prompts = []
    for k in range(max((len(s) for _, _, s in per_file), default=0)):
        for f, text, starts in per_file:
            if k < len(starts):
                line, begin, end = starts[k]
                ids = tuple(tokenizer.encode(text[begin:end])[:prompt_tokens])
                if len(ids) == prompt_tokens:
                    prompts.append(EvalPrompt(f.relpath, line, ids, tokenizer.decode(ids)))
                if len(prompts) == n:
                    return prompts
    raise ValueError(f"held-out files offer only {len(prompts)} prompts of {prompt_tokens} tokens, {n} asked; "
                     "ask for fewer or shorter prompts")


def _prompt_line_starts(text: str, tokenizer: Tokenizer, prompt_tokens: int) -> list[tuple[int, int, int]]:
    """(1-based line, begin, end char offsets) of non-blank lines followed by more than `prompt_tokens` tokens.

    text[begin:end] holds PROMPT_SLACK_TOKENS more tokens than the prompt needs, so cutting the text there leaves the
    prompt's tokens as they are (tests/test_data.py checks this).
    """
    offsets = tokenizer.token_starts(text)
    starts, line, offset = [], 1, 0
    token_index = 0
    for raw_line in text.split("\n"):
        while token_index < len(offsets) and offsets[token_index] < offset:
            token_index += 1
        # One token of slack: the token holding the line start may split differently when encoded from there.
        if raw_line.strip() and len(offsets) - token_index > prompt_tokens:
            last = token_index + prompt_tokens + PROMPT_SLACK_TOKENS
            starts.append((line, offset, offsets[last] if last < len(offsets) else len(text)))
        line += 1
        offset += len(raw_line) + 1
    return starts


def _hash_int(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
