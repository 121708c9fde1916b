"""A model's own tokenizer, read from its HF directory, and its chat template.

Two formats, each the way the model's own HF tokenizer code reads it:
  tiktoken.model   Kimi K2.x: a tiktoken BPE rank file (one "base64(token bytes) rank" a line) run by the `tiktoken`
                   package with Kimi's pre-tokenizer pattern; the ids after the ranks are special tokens, named by
                   `added_tokens_decoder` of tokenizer_config.json, the unnamed ones `<|reserved_token_{id}|>`.
                   Special-token strings in text encode as special tokens and nothing is added to a text (as Kimi's
                   TikTokenTokenizer.encode does).
  tokenizer.json   DeepSeek-V3 and others: a `tokenizers` JSON; encode applies its post-processor (DeepSeek-V3: BOS).
The chat template is tokenizer_config.json's `chat_template` or the file chat_template.jinja, rendered with jinja2
as transformers renders it (trim_blocks, lstrip_blocks, a sandbox, `raise_exception`, a non-escaping `tojson`), with
the special-token strings of tokenizer_config.json as variables; the rendered text is encoded with no tokens added.
The project's own tokenizer (checkpoints/tokenizer.json, kdtree_jax.data.Tokenizer) is loaded from a file path.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Iterable, Protocol

TIKTOKEN_FILE = "tiktoken.model"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
TOKENIZERS_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Kimi's TikTokenTokenizer: 256 reserved special ids (+2) after the BPE ranks, and its pre-tokenizer pattern (CJK runs;
# words with case and contractions, the Han script excluded; digits in threes; punctuation; newlines; spaces).
KIMI_RESERVED_SPECIAL_TOKENS = 256 + 2
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


class TextTokenizer(Protocol):
    """What the scripts use of a tokenizer (kdtree_jax.data.Tokenizer and the classes here)."""

    vocab_size: int
    eos_id: int | None  # the token the tokenizer ends a text with (None: it names none)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_starts(self, text: str) -> list[int]: ...


def has_model_tokenizer(directory: str) -> bool:
    """Whether `directory` holds a tokenizer this module reads (tiktoken.model or tokenizer.json)."""
    return os.path.isdir(directory) and any(os.path.isfile(os.path.join(directory, f))
                                            for f in (TIKTOKEN_FILE, TOKENIZERS_FILE))


def load_tokenizer(path: str) -> TextTokenizer:
    """The tokenizer at `path`: a model directory (tiktoken.model preferred, else tokenizer.json) or the project's
    own tokenizers JSON file (checkpoints/tokenizer.json)."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, TIKTOKEN_FILE)):
            return TiktokenTokenizer(path)
        if os.path.isfile(os.path.join(path, TOKENIZERS_FILE)):
            return HFTokenizer(path)
        raise FileNotFoundError(f"{path} holds neither {TIKTOKEN_FILE} (Kimi K2.x) nor {TOKENIZERS_FILE}; pass "
                                f"--tokenizer with the model's tokenizer directory")
    from kdtree_jax.data import load_tokenizer as load_project_tokenizer
    return load_project_tokenizer(path)


def read_tokenizer_config(directory: str) -> dict:
    """tokenizer_config.json of `directory` ({} when there is none); ValueError naming the file and field for one
    that is not JSON, or whose fields read here have the wrong JSON type."""
    path = os.path.join(directory, TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({'empty file' if not text.strip() else e}); re-download the "
                         f"checkpoint") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object; re-download the checkpoint")
    added = config.get("added_tokens_decoder") or {}
    if not (isinstance(added, dict) and all(str(i).isdigit() and isinstance(e, dict)
                                            and isinstance(e.get("content"), str) for i, e in added.items())):
        raise ValueError(f"{path}: field 'added_tokens_decoder' must map token ids to {{\"content\": ...}} objects")
    for key in SPECIAL_TOKEN_KEYS:
        token = config.get(key)
        if not (token is None or isinstance(token, str) or (isinstance(token, dict)
                                                            and isinstance(token.get("content"), str))):
            raise ValueError(f"{path}: field {key!r} = {token!r} must be a string or an {{\"content\": ...}} object")
    template = config.get("chat_template")
    if not (template is None or isinstance(template, str) or (isinstance(template, list) and all(
            isinstance(t, dict) for t in template))):
        raise ValueError(f"{path}: field 'chat_template' must be a string or a list of {{\"name\", \"template\"}}")
    return config


def special_token_text(config: dict, key: str) -> str | None:
    """The text of special token `key` ("eos_token", ...) of a tokenizer_config.json dict, or None."""
    token = config.get(key)
    return None if token is None else _token_text(token)


class TiktokenTokenizer:
    """Kimi K2.x's tokenizer: tiktoken.model + the special tokens of tokenizer_config.json."""

    def __init__(self, directory: str):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = os.path.join(directory, TIKTOKEN_FILE)
        try:
            ranks = load_tiktoken_bpe(path)
        except (ValueError, IndexError) as e:
            raise ValueError(f"{path} is not a tiktoken BPE file ('base64 rank' lines): {e}") from None
        if not ranks:
            raise ValueError(f"{path} holds no 'base64 rank' lines: not a tiktoken BPE file (re-download it)")
        self.config = read_tokenizer_config(directory)
        named = {int(i): entry["content"] for i, entry in (self.config.get("added_tokens_decoder") or {}).items()}
        base = len(ranks)
        specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + KIMI_RESERVED_SPECIAL_TOKENS)}
        self._encoding = tiktoken.Encoding(name=os.path.basename(os.path.abspath(directory)), pat_str=KIMI_PATTERN,
                                           mergeable_ranks=ranks, special_tokens=specials)
        self.special_tokens = specials
        self.vocab_size = self._encoding.n_vocab
        eos = special_token_text(self.config, "eos_token")
        self.eos_id = specials.get(eos) if eos is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids; special-token strings become their ids; nothing is added (`add_special_tokens` has no
        effect, as in Kimi's tokenizer)."""
        del add_special_tokens
        return self._encoding.encode(text, allowed_special="all")

    def decode(self, ids: Iterable[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])

    def token_starts(self, text: str) -> list[int]:
        return self._encoding.decode_with_offsets(self.encode(text))[1]


class HFTokenizer:
    """A `tokenizers` JSON (DeepSeek-V3 and most HF models) with its tokenizer_config.json."""

    def __init__(self, directory: str):
        import tokenizers

        path = os.path.join(directory, TOKENIZERS_FILE)
        try:
            self._backend = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise ValueError(f"{path} is not a tokenizers JSON file ({e})") from None
        self.config = read_tokenizer_config(directory)
        self.vocab_size = self._backend.get_vocab_size()
        eos = special_token_text(self.config, "eos_token")
        self.eos_id = self._backend.token_to_id(eos) if eos is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids, with the tokenizer's post-processor (e.g. BOS) unless add_special_tokens=False."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_starts(self, text: str) -> list[int]:
        return [start for start, _ in self._backend.encode(text, add_special_tokens=False).offsets]


# ----------------------------------------------------------------------------------------------- chat template

def chat_template(directory: str) -> str:
    """The chat template of a model directory: chat_template.jinja, else tokenizer_config.json's `chat_template`
    (a string, or a list of {name, template} whose "default" is taken)."""
    path = os.path.join(directory, CHAT_TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = read_tokenizer_config(directory).get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if not template or not isinstance(template, str):
        raise ValueError(f"{directory} has no chat template: neither {CHAT_TEMPLATE_FILE} nor a 'chat_template' field "
                         f"in {TOKENIZER_CONFIG}; drop --chat to encode the prompt as plain text")
    return template


def render_chat(template: str, messages: list[dict], tokenizer_config: dict, add_generation_prompt: bool = True) -> str:
    """The text of `messages` ([{"role", "content"}]) under a chat template, as transformers renders it."""
    from jinja2 import exceptions
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    specials = {key: _token_text(tokenizer_config.get(key)) for key in SPECIAL_TOKEN_KEYS if tokenizer_config.get(key)}
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **specials)


def encode_chat(tokenizer, directory: str, user_prompt: str) -> list[int]:
    """One user turn under the directory's chat template, with the generation prompt, as token ids. A template that
    does not render (a syntax error, an undefined name, its own raise_exception) is a ValueError naming it."""
    from jinja2 import exceptions

    try:
        text = render_chat(chat_template(directory), [{"role": "user", "content": user_prompt}], tokenizer.config)
    except (exceptions.TemplateError, TypeError, AttributeError, KeyError, IndexError) as e:
        where = (os.path.join(directory, CHAT_TEMPLATE_FILE) if os.path.isfile(os.path.join(directory,
                 CHAT_TEMPLATE_FILE)) else f"the chat_template of {os.path.join(directory, TOKENIZER_CONFIG)}")
        raise ValueError(f"{where} does not render a user turn ({type(e).__name__}: {e}); fix the template, or drop "
                         f"--chat to encode the prompt as plain text") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _token_text(token) -> str:
    """A special token of tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
    return token["content"] if isinstance(token, dict) else str(token)
