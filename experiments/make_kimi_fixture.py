"""Write tests/fixtures/kimi_k26_tiny: a tiny target in the Kimi K2.6 HF layout, with a tiny Kimi-style tokenizer.

  PYTHONPATH=. .venv/bin/python experiments/make_kimi_fixture.py --out=tests/fixtures/kimi_k26_tiny

What the directory holds, each file in the layout of the released Kimi K2.6 directory:
  config.json                      KimiK25ForConditionalGeneration: the text model under `text_config` (kimi_k2,
                                   DeepSeek-V3 architecture, YaRN, compressed-tensors INT4 quantization_config) and a
                                   vision_config
  model-0000N-of-0000M.safetensors the weights, names under `language_model.`; routed experts as compressed-tensors
  model.safetensors.index.json     pack-quantized INT4 (weight_packed / weight_scale / weight_shape), everything else
                                   bf16; one vision-tower tensor (which the engine ignores)
  tiktoken.model                   a byte-level BPE of TOKENIZER_MERGES merges in tiktoken's rank format, trained here
                                   on a few stdlib files (the Kimi pre-tokenizer does not apply while training: chunks
                                   are words with their leading space)
  tokenizer_config.json            the special tokens at Kimi's offsets after the ranks ([BOS], [EOS], <|im_end|>, ...)
                                   and a chat template in Kimi's turn format, written for this fixture
The weights are random (seed --seed), sized so the vocabulary is the tokenizer's (ranks + 258 special ids).
"""
from __future__ import annotations

import base64
import collections
import json
import os
import re

from absl import flags
from flax import nnx

from kdtree_jax import cli, config, data, hf_import
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.tokenizer import KIMI_RESERVED_SPECIAL_TOKENS

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "tests/fixtures/kimi_k26_tiny", "directory to write")
flags.DEFINE_integer("seed", 0, "seed of the random weights")

TOKENIZER_MERGES = 254  # 256 byte tokens + 254 merges = 510 ranks; + 258 special ids = a vocabulary of 768
CORPUS_FILES = ("textwrap.py", "string.py", "shlex.py")  # stdlib files the BPE is trained on
# Special tokens at their offsets after the ranks in Kimi K2's tokenizer_config.json.
SPECIAL_OFFSETS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                   6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                   17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
SHARD_BYTES = 120_000  # several shards and an index, as the released checkpoint has


def train_ranks(text: str, merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then `merges` merged byte strings, most frequent pair first (ties: the
    larger pair)."""
    words = collections.Counter(re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
    pieces = {w: [bytes([b]) for b in w.encode("utf-8")] for w in words}
    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < 256 + merges:
        pairs = collections.Counter()
        for w, n in words.items():
            for a, b in zip(pieces[w], pieces[w][1:]):
                pairs[a, b] += n
        if not pairs:
            raise ValueError(f"the corpus allows only {len(ranks) - 256} merges, {merges} asked")
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        for w, seq in pieces.items():
            merged, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            pieces[w] = merged
    return ranks


def tokenizer_config(num_ranks: int) -> dict:
    added = {str(num_ranks + off): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                                    "single_word": False, "special": True} for off, tok in SPECIAL_OFFSETS.items()}
    return {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
            "unk_token": "[UNK]", "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                                                "<|im_system|>", "<|im_middle|>"],
            "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "model_max_length": 1024,
            "tokenizer_class": "TikTokenTokenizer",
            "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}


def target_config(vocab_size: int, bos: int, eos: int) -> config.ModelConfig:
    """The tiny preset's shapes with the Kimi K2.6 vocabulary scheme and INT4 experts (random init in bf16)."""
    return config.tiny().replace(name="kimi_k26_tiny", vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos,
                                 dtype="bfloat16")


def main(argv):
    del argv
    out = os.path.abspath(FLAGS.out)
    os.makedirs(out, exist_ok=True)
    text = "".join(open(os.path.join(data.stdlib_root(), f), encoding="utf-8").read() for f in CORPUS_FILES)
    ranks = train_ranks(text, TOKENIZER_MERGES)
    with open(os.path.join(out, "tiktoken.model"), "w") as f:
        f.writelines(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items())
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(len(ranks)), f, indent=2)

    cfg = target_config(len(ranks) + KIMI_RESERVED_SPECIAL_TOKENS, bos=len(ranks), eos=len(ranks) + 1)
    model = Transformer(cfg, nnx.Rngs(FLAGS.seed))
    hf_import.export_hf_checkpoint(model, out, int4=True, prefix=hf_import.NESTED_PREFIX,
                                   max_shard_bytes=SHARD_BYTES)
    add_vision_tower(out)
    print(f"wrote {out}: vocab {cfg.vocab_size} ({len(ranks)} ranks), "
          f"{len(os.listdir(out))} files, {sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))} bytes")


def add_vision_tower(directory: str) -> None:
    """A vision_config and one vision-tower tensor in a shard of its own (named in the index), as K2.6 has."""
    import numpy as np
    from safetensors.numpy import save_file

    path = os.path.join(directory, "config.json")
    with open(path) as f:
        hf = json.load(f)
    hf["vision_config"] = {"hidden_size": 16, "num_hidden_layers": 1}
    hf["media_placeholder_token_id"] = hf["text_config"]["eos_token_id"] + 21
    with open(path, "w") as f:
        json.dump(hf, f, indent=2)
    index_path = os.path.join(directory, hf_import.INDEX_FILE)
    with open(index_path) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    name = f"model-{len(shards) + 1:05d}-of-{len(shards) + 1:05d}.safetensors"
    renamed = {old: f"model-{i + 1:05d}-of-{len(shards) + 1:05d}.safetensors" for i, old in enumerate(shards)}
    for old, new in renamed.items():
        os.replace(os.path.join(directory, old), os.path.join(directory, new))
    save_file({"vision_tower.patch_embed.proj.weight": np.zeros((16, 3, 2, 2), np.float32)},
              os.path.join(directory, name), metadata={"format": "pt"})
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    index["weight_map"]["vision_tower.patch_embed.proj.weight"] = name
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


if __name__ == "__main__":
    cli.run(main)
