"""Write tests/fixtures/dflash_tiny: a tiny DFlash drafter made and saved by the published reference code, with the
reference's block logits for a fixed input.

Runs where torch and transformers 4.57 are (not the project's venv), with a checkout of z-lab/dflash:
  python3.11 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch transformers==4.57.1 safetensors numpy
  /tmp/tvenv/bin/python experiments/make_dflash_fixture.py --dflash_src=PATH/TO/z-lab/dflash \
      --target=tests/fixtures/kimi_k26_tiny --out=tests/fixtures/dflash_tiny

The drafter is the reference's DFlashDraftModel (dflash/model.py, imported from --dflash_src, not vendored) over a
Qwen3Config for the target in --target: 2 layers, 4 query heads over 2 K/V heads of 16 dims, MLP 96, block 4,
target_layer_ids [0, 1], mask_token_id a reserved special id of the target's tokenizer. Every weight is random
(seed --seed; norms 1 + noise, so a misplaced norm weight shows), rounded to bf16 and saved by save_pretrained in
bf16. The reference then runs in float32 (eager attention) on 2 streams: a random context feature [2, 6, 2 * D] at
positions 0..5 and the block [bonus, MASK x 3] at positions 6..9, embedded and projected by the target's own
embed_tokens and lm_head (read from --target). reference.npz holds target_hidden [2, 6, 2D], block [2, 4],
positions [2, 10], logits [2, 4, V] (float32).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np
import torch
from safetensors import safe_open

NESTED_PREFIX = "language_model."
CONTEXT, BLOCK = 6, 4


def target_tensor(directory: str, name: str) -> torch.Tensor:
    """One tensor of the target checkpoint (with or without the `language_model.` prefix), as float32."""
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for candidate in (NESTED_PREFIX + name, name):
                if candidate in f.keys():
                    return f.get_tensor(candidate).float()
    raise KeyError(f"{name} is not in {directory}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dflash_src", required=True, help="a checkout of z-lab/dflash (holds dflash/model.py)")
    parser.add_argument("--target", default="tests/fixtures/kimi_k26_tiny")
    parser.add_argument("--out", default="tests/fixtures/dflash_tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.dflash_src))
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    with open(os.path.join(args.target, "config.json")) as f:
        target = json.load(f)
    target = target.get("text_config", target)
    vocab, hidden = target["vocab_size"], target["hidden_size"]
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=target["max_position_embeddings"], attention_bias=False, tie_word_embeddings=False)
    config.block_size = BLOCK
    config.num_target_layers = target["num_hidden_layers"]
    # MASK: a reserved special id (200 after the BPE ranks, which end where [BOS] sits)
    config.dflash_config = {"target_layer_ids": [0, 1], "mask_token_id": target["bos_token_id"] + 200}
    config._attn_implementation = "eager"

    torch.manual_seed(args.seed)
    model = DFlashDraftModel(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
            p.copy_(p.to(torch.bfloat16).float())

    embed = target_tensor(args.target, "model.embed_tokens.weight")  # [V, D]
    lm_head = target_tensor(args.target, "lm_head.weight")  # [V, D]
    generator = torch.Generator().manual_seed(args.seed + 1)
    target_hidden = torch.randn(2, CONTEXT, 2 * hidden, generator=generator)
    bonus = torch.randint(0, config.dflash_config["mask_token_id"], (2,), generator=generator)
    block = torch.full((2, BLOCK), config.dflash_config["mask_token_id"], dtype=torch.long)
    block[:, 0] = bonus
    positions = torch.arange(CONTEXT + BLOCK)[None].repeat(2, 1)
    with torch.no_grad():
        normed = model(position_ids=positions, noise_embedding=embed[block], target_hidden=target_hidden,
                       use_cache=False)
        logits = normed @ lm_head.T

    os.makedirs(args.out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    np.savez(os.path.join(args.out, "reference.npz"), target_hidden=target_hidden.numpy(), block=block.numpy(),
             positions=positions.numpy(), logits=logits.numpy())
    print(f"wrote {args.out}: logits {tuple(logits.shape)}, |logits| max {logits.abs().max():.3f}")


if __name__ == "__main__":
    main()
