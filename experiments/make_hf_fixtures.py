"""Write the HF reference fixtures of tests/test_hf_fixtures.py: a tiny Kimi-like DeepSeek-V3 checkpoint in two layouts,
each with HF transformers' own float32 logits, so the CPU suite compares our model with an outside implementation on
every run without torch.

Run once, where torch, transformers (5.x) and compressed-tensors are installed (the project needs none of them):
  python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers safetensors numpy absl-py \\
      jax==0.11.2 jaxlib==0.11.2 flax==0.12.10 orbax-checkpoint==0.12.4 tqdm optax
  /tmp/hf/bin/pip install --no-deps compressed-tensors && /tmp/hf/bin/pip install pydantic loguru psutil
  PYTHONPATH=. /tmp/hf/bin/python experiments/make_hf_fixtures.py --fixtures_dir=tests/fixtures
(made with torch 2.14.1, transformers 5.24.0, compressed-tensors 0.20.1; versions are in each fixture's
hf_logits.json).

The model: experiments/hf_equivalence.py's random DeepseekV3ForCausalLM (`build_hf_model`, `hf_config_kwargs` with a
vocabulary of 256), its weights rounded to bfloat16. Two directories:
  hf_deepseek_v3_bf16/  DeepSeek-V3 layout: written by HF's `save_pretrained` in bfloat16 (config.json, one
                        model.safetensors with per-expert tensors).
  hf_kimi_k2_6_int4/    Kimi K2.6 layout: config.json with the text model under `text_config` (model_type kimi_k2,
                        rope_theta + rope_scaling, torch_dtype, K2.6's compressed-tensors quantization_config),
                        tensor names under `language_model.`, routed experts packed by compressed-tensors'
                        `PackedQuantizationCompressor` (symmetric INT4, group 32; the scale is max |w| / 7 of each
                        group, in bf16), the router's correction bias in float32 and one vision-tower tensor, as in
                        the released checkpoint; everything else bfloat16.
Each directory also holds hf_logits.npz: `tokens` [2, 24] and `logits` [2, 24, 256] float32 from HF's forward in
float32 over weights HF loaded back from disk (for the INT4 layout: the experts' dequantized values, q * scale
unpacked by compressed-tensors, in float32), and hf_logits.json with the versions used.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile

import numpy as np
from absl import flags

from experiments.hf_equivalence import build_hf_model, hf_config_kwargs
from kdtree_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("fixtures_dir", "tests/fixtures", "directory that receives the two fixture directories")
# --seed (of the HF weights and the tokens) is hf_equivalence.py's flag.

VOCAB, BATCH, SEQ_LEN, GROUP = 256, 2, 24, 32
KIMI_PREFIX = "language_model."
ROUTED = ".mlp.experts."  # per-expert tensors "model.layers.<i>.mlp.experts.<e>.<proj>.weight"


def kimi_text_config(hf: dict) -> dict:
    """The text_config of a Kimi K2.6 config.json from HF's DeepseekV3 config.json (transformers 5 field names)."""
    rope = dict(hf["rope_parameters"])
    text = {k: v for k, v in hf.items() if k not in ("rope_parameters", "dtype", "transformers_version")}
    text.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], torch_dtype="bfloat16",
                rope_theta=rope.pop("rope_theta"),
                rope_scaling={"type": rope.pop("rope_type"), **rope},
                quantization_config={
                    "quant_method": "compressed-tensors", "format": "pack-quantized",
                    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                        "dynamic": False, "actorder": None, "observer": "minmax"}}},
                    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                               r"re:.*mlp\.(gate|up|down)_proj.*"]})
    return text


def compress_expert(weight):
    """An expert Linear [out, in] (bf16) -> (weight_packed, weight_scale, weight_shape) by compressed-tensors, and the
    float32 weight they stand for (unpacked by compressed-tensors, times the scale)."""
    import torch
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = weight.float()
    groups = w.reshape(w.shape[0], -1, GROUP)
    scale = (groups.abs().amax(-1) / 7).clamp_min(1e-8).to(torch.bfloat16)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP))
    out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    q = unpack_from_int32(out["weight_packed"], 4, w.shape)
    dequantized = q.float() * scale.float().repeat_interleave(GROUP, dim=-1)
    return out["weight_packed"], out["weight_scale"], out["weight_shape"], dequantized


def hf_logits(directory: str, tokens: np.ndarray) -> np.ndarray:
    """HF's float32 logits of the checkpoint in `directory` (loaded by HF's from_pretrained) on tokens [B, T]."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


def write_reference(directory: str, tokens: np.ndarray, logits: np.ndarray) -> None:
    np.savez(os.path.join(directory, "hf_logits.npz"), tokens=tokens, logits=logits)
    versions = {p: importlib.metadata.version(p) for p in ("torch", "transformers", "compressed-tensors")}
    with open(os.path.join(directory, "hf_logits.json"), "w") as f:
        json.dump({"made_by": "experiments/make_hf_fixtures.py", "seed": FLAGS.seed, **versions}, f, indent=2)


def main(argv):
    del argv
    import torch
    from safetensors.torch import load_file, save_file

    tokens = np.random.default_rng(FLAGS.seed).integers(0, VOCAB, (BATCH, SEQ_LEN))
    model = build_hf_model(FLAGS.seed, **hf_config_kwargs(vocab_size=VOCAB)).to(torch.bfloat16)

    deepseek = os.path.join(FLAGS.fixtures_dir, "hf_deepseek_v3_bf16")
    shutil.rmtree(deepseek, ignore_errors=True)
    model.save_pretrained(deepseek)
    write_reference(deepseek, tokens, hf_logits(deepseek, tokens))

    with open(os.path.join(deepseek, "config.json")) as f:
        hf_config = json.load(f)
    tensors = load_file(os.path.join(deepseek, "model.safetensors"))
    kimi = os.path.join(FLAGS.fixtures_dir, "hf_kimi_k2_6_int4")
    shutil.rmtree(kimi, ignore_errors=True)
    os.makedirs(kimi)
    packed = {"vision_tower.patch_embed.weight": torch.ones(4, 4, dtype=torch.bfloat16)}
    dequantized = dict(tensors)
    for name, t in tensors.items():
        if ROUTED in name:
            w_packed, w_scale, w_shape, dequantized[name] = compress_expert(t)
            packed.update({KIMI_PREFIX + name + "_packed": w_packed, KIMI_PREFIX + name + "_scale": w_scale,
                           KIMI_PREFIX + name + "_shape": w_shape})
        else:
            packed[KIMI_PREFIX + name] = t.float() if name.endswith("e_score_correction_bias") else t
    save_file(packed, os.path.join(kimi, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(kimi, "config.json"), "w") as f:
        json.dump({"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                   "text_config": kimi_text_config(hf_config), "media_placeholder_token_id": VOCAB - 1}, f, indent=2)
    with tempfile.TemporaryDirectory() as tmp:  # the dequantized model in HF's own layout, for HF's forward
        shutil.copy(os.path.join(deepseek, "config.json"), tmp)
        save_file(dequantized, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        write_reference(kimi, tokens, hf_logits(tmp, tokens))
    for d in (deepseek, kimi):
        print(d, {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))})


if __name__ == "__main__":
    cli.run(main)
