"""Our model against HF transformers' DeepseekV3ForCausalLM, loaded through hf_import (float32, both MLA paths).

Needs torch and transformers 5.x (not part of the project's install: skipped without them). The comparison itself
lives in experiments/hf_equivalence.py, which also runs it as a script.
"""
import importlib.util
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "hf_equivalence", os.path.join(os.path.dirname(__file__), os.pardir, "experiments", "hf_equivalence.py"))
hf_equivalence = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_equivalence)


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_logits_match_hf(tmp_path, q_lora_rank):
    result = hf_equivalence.compare(str(tmp_path), seed=0, seq_len=40, batch=2,
                                    **hf_equivalence.hf_config_kwargs(q_lora_rank))
    assert result["rope_scaling_factor"] == 4.0  # the YaRN config was read from HF's config.json
    for path in ("absorbed", "naive"):
        assert result[path]["max_rel"] < 1e-4, (path, result)
