"""Write tests/fixtures/dflash_taps: the target features a DFlash drafter reads, as the published reference takes them
from HF transformers, so the CPU suite pins which hidden state `target_layer_ids` name (tests/test_dflash_taps.py).

Runs where torch and transformers are (not the project's venv), with a checkout of z-lab/dflash:
  python3.12 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch transformers safetensors numpy
  /tmp/torchvenv/bin/python experiments/make_tap_fixture.py --dflash_src=PATH/TO/z-lab/dflash \
      --target=tests/fixtures/hf_deepseek_v3_bf16 --out=tests/fixtures/dflash_taps

The target is the committed HF fixture (a tiny DeepseekV3ForCausalLM, 3 layers, read by HF's from_pretrained in
float32, eager attention). Its forward over random tokens with output_hidden_states=True goes through the reference's
own `extract_context_feature` (dflash/model.py, imported from --dflash_src, not vendored) for target_layer_ids [0, 1]
(the last layer is refused by the engine: kdtree_jax/dflash_format.py). taps.npz holds tokens [2, 12] (seed --seed),
target_layer_ids [2] and features [2, 12, 2 * hidden] float32; taps.json the versions used.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys

import numpy as np
import torch

LAYER_IDS = [0, 1]
BATCH, SEQ_LEN = 2, 12


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dflash_src", required=True, help="a checkout of z-lab/dflash (holds dflash/model.py)")
    parser.add_argument("--target", default="tests/fixtures/hf_deepseek_v3_bf16")
    parser.add_argument("--out", default="tests/fixtures/dflash_taps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.dflash_src))
    from dflash.model import extract_context_feature
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, SEQ_LEN), generator=generator)
    with torch.no_grad():
        output = model(input_ids=tokens, output_hidden_states=True)
    features = extract_context_feature(output.hidden_states, LAYER_IDS)
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, "taps.npz"), tokens=tokens.numpy().astype(np.int32),
             target_layer_ids=np.asarray(LAYER_IDS, np.int32), features=features.float().numpy())
    versions = {"made_by": "experiments/make_tap_fixture.py", "target": os.path.normpath(args.target),
                "seed": args.seed, "hidden_states": len(output.hidden_states),
                **{p: importlib.metadata.version(p) for p in ("torch", "transformers")}}
    with open(os.path.join(args.out, "taps.json"), "w") as f:
        json.dump(versions, f, indent=2)
    print(f"wrote {args.out}: features {tuple(features.shape)} of layers {LAYER_IDS}, "
          f"{len(output.hidden_states)} hidden states")


if __name__ == "__main__":
    main()
