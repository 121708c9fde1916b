"""Our model against HF transformers' DeepseekV3ForCausalLM on every run, without torch: committed checkpoints of a
tiny Kimi-like model with HF's own float32 logits (tests/fixtures/hf_*, written by tests/fixtures/make_hf_fixtures.py),
loaded through hf_import, both MLA paths, in float32 at full matmul precision.

  hf_deepseek_v3_bf16  DeepSeek-V3 layout written by HF's save_pretrained (bf16 tensors, per-expert names)
  hf_kimi_k2_6_int4    Kimi K2.6 layout: `text_config`, `language_model.` names, routed experts packed by
                       compressed-tensors (INT4, group 32), a vision-tower tensor the engine ignores
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import hf_import
from pallas_kernels import ops

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TOLERANCE = 1e-4  # max |ours - hf| / max |hf| in float32 (measured: below 1e-6)


def max_rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name,expert_quant,keep_int4", [("hf_deepseek_v3_bf16", "bf16", True),
                                                         ("hf_kimi_k2_6_int4", "int4", True),
                                                         ("hf_kimi_k2_6_int4", "bf16", False)])
def test_logits_match_hf_transformers(name, expert_quant, keep_int4):
    directory = os.path.join(FIXTURES, name)
    reference = np.load(os.path.join(directory, "hf_logits.npz"))
    model = hf_import.load_hf_checkpoint(directory, dtype="float32", progress=False, keep_int4=keep_int4)
    assert model.cfg.expert_quant == expert_quant and model.cfg.rope_scaling_factor == 4.0
    tokens = jnp.asarray(reference["tokens"])
    with jax.default_matmul_precision("highest"), ops.implementation("reference"):
        for absorbed in (True, False):
            logits = model.causal(tokens, absorbed=absorbed).logits
            assert max_rel(logits, reference["logits"]) < TOLERANCE, (name, absorbed)
