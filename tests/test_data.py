"""Corpus split, tokenizer, token stream, batches and eval prompts (kdtree_jax/data.py)."""
import os

import numpy as np
import pytest

from kdtree_jax import data

SHIPPED_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tokenizer.json")


def _relpaths(held_out: bool, count: int, prefix: str = "pkg/m") -> list[str]:
    """The first `count` names pkg/m<i>.py that fall (or do not fall) in the held-out split."""
    names, i = [], 0
    while len(names) < count:
        name = f"{prefix}{i}.py"
        if data.is_held_out(name) == held_out:
            names.append(name)
        i += 1
    return names


def _write(root, relpath: str, content: bytes | str) -> None:
    path = root / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)


def _random_text(rng: np.random.Generator, length: int) -> str:
    """Python-looking text mixing ASCII code, whitespace runs, CRLF, tabs, accents, CJK, emoji, combining marks."""
    pieces = ["def ", "return ", "    ", "\n", "\r\n", "\t", "(", ")", ":", "=", "'", '"', "#", "x", "_y1", "é",
              "漢字", "😀", "e\u0301", "\u200b", "\x00", "\x7f", "<|bos|>", "<|mask|>", " ", "  ", "ß", "Ω"]
    return "".join(pieces[i] for i in rng.integers(0, len(pieces), size=length))


@pytest.fixture(scope="module")
def shipped():
    return data.load_tokenizer(SHIPPED_TOKENIZER)


@pytest.fixture(scope="module")
def stdlib_files():
    return data.find_source_files([data.stdlib_root()])


# ------------------------------------------------------------------------------------------------------------ split


def test_split_is_pinned_and_about_five_percent():
    # Pins the hash definition: changing it would silently move files between the splits.
    assert data.is_held_out("chunk.py") and data.is_held_out("zipfile/__init__.py")
    assert not data.is_held_out("json/decoder.py") and not data.is_held_out("os.py")
    names = [f"pkg{i % 17}/module_{i}.py" for i in range(20000)]
    fraction = np.mean([data.is_held_out(n) for n in names])
    assert abs(fraction - data.HELD_OUT_FRACTION) < 0.006
    held_out = [i for i, n in enumerate(names[:500]) if data.is_held_out(n)]
    assert held_out == [22, 63, 65, 93, 97, 123, 130, 150, 171, 186, 228, 232, 259, 266, 279, 284, 292, 296, 331, 463,
                        482]  # pinned: the split of 500 synthetic paths


def test_stdlib_split(stdlib_files):
    split = data.split_files(stdlib_files)
    train, held_out = split.train, split.held_out
    assert len(train) + len(held_out) + len(split.near_copies) == len(stdlib_files) and held_out
    assert 0.02 < len(held_out) / len(stdlib_files) < 0.10
    assert not {f.relpath for f in train} & {f.relpath for f in held_out}
    assert all(data.is_held_out(f.relpath) for f in held_out)
    assert not any(data.is_held_out(f.relpath) for f in train)
    assert stdlib_files == sorted(stdlib_files)
    assert not any(part in data.SKIP_DIRS for f in stdlib_files for part in f.relpath.split("/")[:-1])


def test_near_copies_of_held_out_files_are_set_aside(tmp_path):
    held_name, copy_name, header_name = _relpaths(held_out=True, count=1) + _relpaths(held_out=False, count=2)
    licence = "".join(f"# licence header line number {i:03d}\n" for i in range(10))
    body = "".join(f"    value_{i} = compute_something({i}, scale={i * 7})\n" for i in range(40))
    _write(tmp_path, held_name, licence + "def held():\n" + body)
    _write(tmp_path, copy_name, "import os\n\ndef vendored():\n" + body[: len(body) * 3 // 4] + "    return None\n")
    _write(tmp_path, header_name, licence + "def unrelated():\n    return 'a different body entirely'\n")
    split = data.split_files(data.find_source_files([str(tmp_path)]))
    assert [f.relpath for f in split.held_out] == [held_name]
    assert [f.relpath for f in split.near_copies] == [copy_name]
    assert [f.relpath for f in split.train] == [header_name]


def test_find_source_files_filters(tmp_path):
    _write(tmp_path, "b.py", "x = 1\n")
    _write(tmp_path, "a/c.py", "y = 'é'\n")
    _write(tmp_path, "a/tests/t.py", "skip = 1\n")
    _write(tmp_path, "test/t.py", "skip = 1\n")
    _write(tmp_path, "__pycache__/p.py", "skip = 1\n")
    _write(tmp_path, "site-packages/pkg/q.py", "skip = 1\n")
    _write(tmp_path, ".hidden/h.py", "skip = 1\n")
    _write(tmp_path, "latin1.py", b"# coding: latin-1\nz = '\xe9'\n")
    _write(tmp_path, "big.py", "#" * 200 + "\n")
    _write(tmp_path, "notes.txt", "not python\n")
    files = data.find_source_files([str(tmp_path), str(tmp_path)], max_bytes=100)
    assert [f.relpath for f in files] == ["a/c.py", "b.py"]
    assert files[0] == data.SourceFile(str(tmp_path), "a/c.py", str(tmp_path / "a" / "c.py"))
    assert files[0].read_text() == "y = 'é'\n"


def test_find_source_files_errors(tmp_path):
    with pytest.raises(ValueError, match="no UTF-8"):
        data.find_source_files([str(tmp_path)])
    with pytest.raises(ValueError, match="not directories"):
        data.find_source_files([str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="no roots"):
        data.find_source_files([])


# -------------------------------------------------------------------------------------------------------- tokenizer


def test_shipped_tokenizer_special_ids(shipped):
    assert shipped.vocab_size == data.DEFAULT_VOCAB_SIZE
    assert (shipped.bos_id, shipped.eos_id, shipped.mask_id, shipped.pad_id) == (0, 1, 2, 3)
    assert (data.BOS_ID, data.EOS_ID, data.MASK_ID, data.PAD_ID) == (0, 1, 2, 3)
    assert shipped.decode([data.BOS_ID, data.EOS_ID, data.MASK_ID, data.PAD_ID]) == "".join(data.SPECIAL_TOKENS)
    # Special-token strings inside source text are plain text, never the special ids.
    ids = shipped.encode("s = '<|bos|><|eos|><|mask|><|pad|>'")
    assert not set(ids) & {0, 1, 2, 3}


def test_shipped_tokenizer_round_trips(shipped, stdlib_files):
    rng = np.random.default_rng(1234)
    for _ in range(50):
        text = _random_text(rng, int(rng.integers(1, 400)))
        ids = shipped.encode(text)
        assert all(0 <= i < shipped.vocab_size for i in ids)
        assert shipped.decode(ids) == text
    for f in (stdlib_files[i] for i in rng.choice(len(stdlib_files), size=10, replace=False)):
        text = f.read_text()
        assert shipped.decode(shipped.encode(text)) == text
    assert shipped.encode("") == [] and shipped.decode([]) == ""
    assert shipped.encode_batch(["a = 1", "漢字"]) == [shipped.encode("a = 1"), shipped.encode("漢字")]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        shipped.decode([shipped.vocab_size])


def test_train_tokenizer_small(tmp_path):
    rng = np.random.default_rng(7)
    for name in _relpaths(held_out=False, count=4):
        _write(tmp_path, name, _random_text(rng, 300))
    files = data.find_source_files([str(tmp_path)])
    tok = data.train_tokenizer(files, vocab_size=300)
    assert tok.vocab_size == 300 and tok.mask_id == data.MASK_ID
    text = _random_text(rng, 200)
    assert tok.decode(tok.encode(text)) == text
    path = str(tmp_path / "out" / "tok.json")
    tok.save(path)
    again = data.load_tokenizer(path)
    assert again.fingerprint() == tok.fingerprint() and again.encode(text) == tok.encode(text)
    with pytest.raises(ValueError, match="leaves no room"):
        data.train_tokenizer(files, vocab_size=100)
    with pytest.raises(ValueError, match="no files"):
        data.train_tokenizer([])


def test_held_out_files_are_refused(tmp_path, shipped):
    for name in _relpaths(held_out=True, count=1) + _relpaths(held_out=False, count=1):
        _write(tmp_path, name, "a = 1\n")
    files = data.find_source_files([str(tmp_path)])
    with pytest.raises(ValueError, match="held-out"):
        data.train_tokenizer(files, vocab_size=300)
    with pytest.raises(ValueError, match="held-out"):
        data.token_stream(files, shipped)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_tokenizer.py"):
        data.load_tokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizers JSON"):
        data.load_tokenizer(str(bad))


# ------------------------------------------------------------------------------------------------ stream and batches


def test_token_stream_and_cache(tmp_path, shipped, stdlib_files):
    files = data.split_files(stdlib_files).train[:20]
    tokens = data.token_stream(files, shipped)
    assert tokens.dtype == np.uint16 and tokens.ndim == 1
    assert tokens[0] == data.BOS_ID and tokens[-1] == data.EOS_ID
    assert np.sum(tokens == data.BOS_ID) == len(files) == np.sum(tokens == data.EOS_ID)
    first_len = len(shipped.encode(files[0].read_text()))
    assert tokens[1:first_len + 1].tolist() == shipped.encode(files[0].read_text())
    cached = data.token_stream(files, shipped, cache_dir=str(tmp_path))
    assert [p.name.startswith("tokens-") for p in tmp_path.iterdir()] == [True]
    np.testing.assert_array_equal(cached, tokens)
    np.testing.assert_array_equal(data.token_stream(files, shipped, cache_dir=str(tmp_path)), tokens)
    with pytest.raises(ValueError, match="no files"):
        data.token_stream([], shipped)


def test_training_batches(shipped, stdlib_files):
    tokens = data.token_stream(data.split_files(stdlib_files).train[:5], shipped)
    seq_len, batch = 32, 6
    batches = list(data.make_training_batches(tokens, seq_len, batch, np.random.default_rng(0), num_batches=3))
    assert len(batches) == 3
    windows = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.int32), seq_len + 1)
    for b in batches:
        assert b.shape == (batch, seq_len + 1) and b.dtype == np.int32
        for row in b:  # every row is a contiguous window of the training stream
            assert np.any(np.all(windows == row, axis=1))
    again = next(data.make_training_batches(tokens, seq_len, batch, np.random.default_rng(0)))
    np.testing.assert_array_equal(again, batches[0])
    # Starts cover the whole stream, the last window included.
    ramp = np.arange(10)
    rows = next(data.make_training_batches(ramp, 3, 2000, np.random.default_rng(1)))
    np.testing.assert_array_equal(rows - rows[:, :1], np.broadcast_to(np.arange(4), rows.shape))
    assert set(rows[:, 0].tolist()) == set(range(7))
    with pytest.raises(ValueError, match="too few"):
        next(data.make_training_batches(ramp, 10, 1, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="at least 1"):
        next(data.make_training_batches(ramp, 0, 1, np.random.default_rng(0)))


# ------------------------------------------------------------------------------------------------------ eval prompts


def test_eval_prompts(shipped, stdlib_files):
    prompts = data.eval_prompts(shipped, n=60, prompt_tokens=48, seed=0)
    assert len(prompts) == 60
    assert prompts == data.eval_prompts(shipped, n=60, prompt_tokens=48, seed=0)
    held_out = {f.relpath: f for f in data.split_files(stdlib_files).held_out}
    assert len({p.relpath for p in prompts}) > 10
    assert len({(p.relpath, p.line) for p in prompts}) == 60
    for p in prompts:
        assert p.relpath in held_out and data.is_held_out(p.relpath)
        assert len(p.ids) == 48 and p.text == shipped.decode(p.ids)
        lines = held_out[p.relpath].read_text().split("\n")
        suffix = "\n".join(lines[p.line - 1:])
        assert lines[p.line - 1].strip()
        assert list(p.ids) == shipped.encode(suffix)[:48]  # cut at a line start, uncut by the slice bound
    other = data.eval_prompts(shipped, n=60, prompt_tokens=48, seed=1)
    assert [p.relpath for p in other] != [p.relpath for p in prompts]


def test_eval_prompts_ignore_edits_elsewhere(shipped, tmp_path):
    name = _relpaths(held_out=True, count=1)[0]
    lines = [f"def function_{i}(argument_{i}):\n    return argument_{i} * {i} + {i * i}\n\n" for i in range(150)]
    _write(tmp_path, name, "".join(lines))
    before = data.eval_prompts(shipped, n=5, prompt_tokens=20, seed=3, roots=[str(tmp_path)])
    _write(tmp_path, name, "".join(lines[:100]) + "# an edit far away\n" + "".join(lines[100:]))
    after = data.eval_prompts(shipped, n=5, prompt_tokens=20, seed=3, roots=[str(tmp_path)])
    # Only prompts cut from text next to the edit can change; the ones after it keep their ids on a new line number.
    kept = {p.ids: p.line for p in before}
    moved = [p for p in after if p.ids in kept and p.line == kept[p.ids] + 1]
    assert len([p for p in after if p.ids in kept]) >= 4 and moved


def test_eval_prompts_errors(shipped, tmp_path):
    with pytest.raises(ValueError, match="empty prompt"):
        data.eval_prompts(shipped, n=1, prompt_tokens=0)
    with pytest.raises(ValueError, match="at least one prompt"):
        data.eval_prompts(shipped, n=0, prompt_tokens=8)
    _write(tmp_path, _relpaths(held_out=True, count=1)[0], "a = 1\nb = 2\n")
    with pytest.raises(ValueError, match="offer only"):
        data.eval_prompts(shipped, n=1, prompt_tokens=64, roots=[str(tmp_path)])
