"""A model's own tokenizer from its directory: the tiny Kimi-style tiktoken fixture (tests/fixtures/make_kimi_fixture.py),
a `tokenizers` JSON directory, chat templates, and the project's own tokenizer file as before."""
import json
import os
import shutil

import pytest

from kdtree_jax import data
from kdtree_jax import tokenizer as tokenizer_lib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
KIMI_DIR = os.path.join(ROOT, "tests", "fixtures", "kimi_k26_tiny")
PROJECT_TOKENIZER = os.path.join(ROOT, "checkpoints", "tokenizer.json")
TEXT = 'def greet(name):\n    return f"Grüße, {name}! 你好"\n\n\n'


@pytest.fixture(scope="module")
def kimi():
    return tokenizer_lib.load_tokenizer(KIMI_DIR)


def test_tiktoken_round_trip_and_specials(kimi):
    assert isinstance(kimi, tokenizer_lib.TiktokenTokenizer)
    assert kimi.vocab_size == 510 + tokenizer_lib.KIMI_RESERVED_SPECIAL_TOKENS == 768
    ids = kimi.encode(TEXT)
    assert kimi.decode(ids) == TEXT and max(ids) < 510 and len(ids) < len(TEXT.encode())  # merges apply
    assert kimi.encode("[BOS]x[EOS]<|im_end|>") == [510, *kimi.encode("x"), 511, 512]  # special strings are specials
    assert kimi.decode([700]) == "<|reserved_token_700|>"  # an unnamed special id decodes by Kimi's placeholder
    starts = kimi.token_starts(TEXT)
    assert starts[0] == 0 and starts == sorted(starts) and len(starts) == len(ids)


def test_chat_template_renders_a_user_turn(kimi):
    ids = tokenizer_lib.encode_chat(kimi, KIMI_DIR, "Write a haiku.")
    assert kimi.decode(ids) == "<|im_user|>user<|im_middle|>Write a haiku.<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert ids[0] == 513 and ids[-1] == 527  # <|im_user|> ... <|im_middle|>


def test_chat_template_file_wins_over_the_config_field(tmp_path, kimi):
    directory = tmp_path / "model"
    shutil.copytree(KIMI_DIR, directory)
    (directory / tokenizer_lib.CHAT_TEMPLATE_FILE).write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] | tojson }}{% endfor %}")
    ids = tokenizer_lib.encode_chat(kimi, str(directory), "é<b>")
    assert kimi.decode(ids) == '[BOS]USER: "é<b>"'  # tojson as transformers has it: no ASCII or HTML escaping


def test_missing_chat_template_is_named(tmp_path, kimi):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / tokenizer_lib.TOKENIZER_CONFIG).write_text("{}")
    with pytest.raises(ValueError, match="has no chat template"):
        tokenizer_lib.encode_chat(kimi, str(directory), "hi")


def test_tokenizers_json_directory(tmp_path):
    """A DeepSeek-V3-style directory: tokenizer.json (here the project's BPE) + tokenizer_config.json with its
    chat template; encode applies the post-processor, chat encoding adds nothing."""
    directory = tmp_path / "model"
    directory.mkdir()
    shutil.copy(PROJECT_TOKENIZER, directory / "tokenizer.json")
    config = {"bos_token": {"content": "<|bos|>"}, "eos_token": "<|eos|>",
              "chat_template": "{{ bos_token }}{% for m in messages %}<|user|>{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = tokenizer_lib.load_tokenizer(str(directory))
    assert isinstance(tok, tokenizer_lib.HFTokenizer) and tok.vocab_size == 4096
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and tok.token_starts(TEXT)[0] == 0
    chat = tokenizer_lib.encode_chat(tok, str(directory), "x = 1")
    assert chat[0] == data.BOS_ID and tok.decode(chat) == "<|bos|><|user|>x = 1<|assistant|>"


def test_project_tokenizer_file_as_before():
    tok = tokenizer_lib.load_tokenizer(PROJECT_TOKENIZER)
    assert isinstance(tok, data.Tokenizer) and tok.encode("<|bos|>") != [data.BOS_ID]  # plain text, as today


def test_directory_without_a_tokenizer_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither tiktoken.model .* nor tokenizer.json"):
        tokenizer_lib.load_tokenizer(str(tmp_path))
