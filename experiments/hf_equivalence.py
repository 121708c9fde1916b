"""Our Transformer against HF transformers' DeepseekV3ForCausalLM on a tiny random Kimi-like model, in float32.

The HF model gets random weights of unit-scale activations (and a random non-zero e_score_correction_bias), is saved
with save_pretrained, loaded back with kdtree_jax.hf_import, and both run a causal forward over the same random
tokens. Our side runs the absorbed MLA path (pure-JAX references; the Pallas kernel too on a GPU, reported apart) and
the naive path, with float32 matmuls at full precision. Reports per path:
  max_rel   max |ours - hf| / max |hf|          rel_norm  ||ours - hf|| / ||hf||

  PYTHONPATH=. python3 experiments/hf_equivalence.py --out=$OUT/hf_equivalence.json
Needs torch and transformers (5.x), which the project does not install.
"""
from __future__ import annotations

import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from kdtree_jax import cli, hf_import
from pallas_kernels import ops

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "where to write the JSON result (printed as well)")
flags.DEFINE_integer("seed", 0, "seed of the HF weights and the tokens")
flags.DEFINE_integer("seq_len", 40, "tokens per sequence")
flags.DEFINE_integer("batch", 2, "sequences")
flags.DEFINE_float("rms_norm_eps", 1e-6, "config rms_norm_eps (HF's q_a/kv_a layernorms always use 1e-6)")
flags.DEFINE_float("tolerance", 1e-4, "fail (exit 1) when a reference path's max_rel exceeds this")


def hf_config_kwargs(q_lora_rank: int | None = 32, rms_norm_eps: float = 1e-6, vocab_size: int = 512) -> dict:
    """A tiny DeepseekV3Config with Kimi K2 routing and YaRN (factor 4 over 64 original positions)."""
    return dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.827,
        norm_topk_prob=True, rms_norm_eps=rms_norm_eps, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0})


def build_hf_model(seed: int, **config_kwargs):
    """A DeepseekV3ForCausalLM (float32, eval mode) with random weights: linears ~ N(0, 1/fan_in), norms ~ 1 + N(0,
    0.1^2), embedding ~ N(0, 1), correction bias ~ N(0, 0.1^2)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**config_kwargs)).float().eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                t.copy_(1.0 + 0.1 * torch.randn_like(t))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn_like(t))
            elif name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn_like(t))
            else:  # Linear [out, in] and fused experts [E, out, in]: fan_in is the last dim
                t.copy_(torch.randn_like(t) * t.shape[-1] ** -0.5)
    return model


def causal_logits(model, tokens, absorbed: bool):
    """Our causal prefill of tokens [S, T] from an empty cache -> logits [S, T, V] f32."""
    return model.causal(tokens, absorbed=absorbed).logits


def errors(ours, ref) -> dict:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return {"max_rel": float(np.abs(ours - ref).max() / np.abs(ref).max()),
            "rel_norm": float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))}


def compare(directory: str, seed: int = 0, seq_len: int = 40, batch: int = 2, **config_kwargs) -> dict:
    """Build, save (to `directory`) and load the HF model, run both sides; returns the errors per path."""
    import torch

    hf_model = build_hf_model(seed, **config_kwargs)
    hf_model.save_pretrained(directory)
    ours = hf_import.load_hf_checkpoint(directory, dtype="float32", progress=False)
    tokens = np.random.default_rng(seed).integers(0, ours.cfg.vocab_size, (batch, seq_len))
    with torch.no_grad():
        ref = hf_model(torch.as_tensor(tokens)).logits.float().numpy()
    result = {"config": dict(config_kwargs), "seed": seed, "tokens": list(tokens.shape),
              "rope_scaling_factor": ours.cfg.rope_scaling_factor, "softmax_scale": ours.cfg.softmax_scale}
    with jax.default_matmul_precision("highest"):
        with ops.implementation("reference"):
            result["absorbed"] = errors(causal_logits(ours, jnp.asarray(tokens), absorbed=True), ref)
            result["naive"] = errors(causal_logits(ours, jnp.asarray(tokens), absorbed=False), ref)
        if jax.default_backend() == "gpu":
            with ops.implementation("kernel"):
                result["absorbed_pallas_kernel"] = errors(causal_logits(ours, jnp.asarray(tokens), True), ref)
    return result


def main(argv):
    del argv
    results = []
    for q_lora_rank in (32, None):
        kwargs = hf_config_kwargs(q_lora_rank, FLAGS.rms_norm_eps)
        with tempfile.TemporaryDirectory() as tmp:
            results.append(compare(tmp, FLAGS.seed, FLAGS.seq_len, FLAGS.batch, **kwargs))
    worst = max(r[path]["max_rel"] for r in results for path in ("absorbed", "naive"))
    report = {"max_rel_logit_error": worst, "tolerance": FLAGS.tolerance, "runs": results,
              "jax": jax.__version__, "backend": jax.default_backend(), "transformers": _version("transformers"),
              "torch": _version("torch")}
    text = json.dumps(report, indent=2)
    print(text)
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            f.write(text)
    if worst > FLAGS.tolerance:
        raise SystemExit(f"max relative logit error {worst:.3g} exceeds {FLAGS.tolerance:g}")


def _version(package: str) -> str:
    import importlib.metadata
    return importlib.metadata.version(package)


if __name__ == "__main__":
    cli.run(main)
