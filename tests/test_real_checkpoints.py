"""Real checkpoint formats through the scripts: experiments/generate.py on the committed fixtures (a tiny Kimi K2.6
HF directory with its tiktoken tokenizer and chat template, a tiny DFlash drafter in the published format) on a mesh
of fake CPU devices, and what --init / --drafter accept or refuse (kdtree_jax.model_dir)."""
import json
import os
import subprocess
import sys

import pytest

from kdtree_jax import config, model_dir
from conftest import FAST_COMPILE

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
TARGET_DIR = os.path.join(ROOT, "tests", "fixtures", "kimi_k26_tiny")
DRAFTER_DIR = os.path.join(ROOT, "tests", "fixtures", "dflash_tiny")
DEVICES = 2


def generate(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    """experiments/generate.py on DEVICES fake CPU devices -> (the process, its --out JSON or None)."""
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{FAST_COMPILE} --xla_force_host_platform_device_count={DEVICES}")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "generate.py"), *args, f"--out={out}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


CHAT = ["--chat", "--prompt=Write a haiku about the sea.", "--prompt=def fib(n):"]


@pytest.mark.parametrize("policy", ["ddtree", "chain"])
def test_generate_equals_ar_on_a_mesh(tmp_path, policy):
    """The HF target streamed into a tp=2 mesh, the DFlash drafter, the tiktoken tokenizer with its chat template:
    greedy chain / ddtree emit ar's tokens (--compare runs ar in the same process)."""
    proc, report = generate(tmp_path, f"--init={TARGET_DIR}", f"--drafter={DRAFTER_DIR}", *CHAT, f"--policy={policy}",
                            "--budget=8", "--compare", "--mesh=tp=2", "--dtype=float32", "--max_new_tokens=12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["identical_to_ar"] is True and report["new_tokens"] == 24
    assert (report["block_size"], report["eos_token_ids"], report["dtype"]) == (4, [511], "float32")
    assert report["drafter"] == DRAFTER_DIR and report["mesh"] == "tp=2"
    assert "<|im_user|>user<|im_middle|>Write a haiku about the sea.<|im_end|>" in proc.stdout  # decoded by tiktoken


def test_unusable_directory_is_one_error_line(tmp_path):
    proc, _ = generate(tmp_path, f"--init={tmp_path}", "--prompt=1,2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "has no config.json" in proc.stderr


def test_checkpoint_kinds(tmp_path):
    assert model_dir.checkpoint_kind("random") == model_dir.RANDOM
    assert model_dir.checkpoint_kind(os.path.join(ROOT, "checkpoints", "target")) == model_dir.ORBAX
    assert model_dir.checkpoint_kind(TARGET_DIR) == model_dir.HF
    assert model_dir.checkpoint_kind(DRAFTER_DIR) == model_dir.DFLASH
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has a config.json but no \*.safetensors"):
        model_dir.checkpoint_kind(str(tmp_path))
    with pytest.raises(ValueError, match="neither 'random' nor a directory"):
        model_dir.checkpoint_kind(str(tmp_path / "absent"))


def test_target_and_drafter_swapped_are_named():
    with pytest.raises(ValueError, match="holds a DFlash drafter, not a target model"):
        model_dir.load_target(DRAFTER_DIR)
    with pytest.raises(ValueError, match="holds a target model .* not a drafter"):
        model_dir.load_drafter(TARGET_DIR, config.tiny())


def test_eos_from_generation_config(tmp_path):
    cfg = config.tiny()
    assert model_dir.eos_token_ids(TARGET_DIR, cfg) == (cfg.eos_token_id,)  # no generation_config.json: config.json's
    (tmp_path / model_dir.GENERATION_CONFIG).write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert model_dir.eos_token_ids(str(tmp_path), cfg) == (7, 9, cfg.eos_token_id)  # every one of them stops a stream


def test_quantization_config_beside_text_config():
    """A K2.5/K2.6 config.json may keep quantization_config at the top level, beside text_config."""
    with open(os.path.join(TARGET_DIR, "config.json")) as f:
        hf = json.load(f)
    hf["quantization_config"] = hf["text_config"].pop("quantization_config")
    assert config.from_hf_config(hf).expert_quant == "int4"


def test_config_without_model_fields_is_named(tmp_path):
    """A config.json that is not a DeepSeek-V3 / Kimi K2.x text model's: the missing fields and the file are named."""
    for name in os.listdir(TARGET_DIR):
        os.symlink(os.path.join(TARGET_DIR, name), tmp_path / name)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "hidden_size": 64}))
    with pytest.raises(ValueError, match=r"config.json: config fields \['vocab_size', 'num_hidden_layers'"):
        model_dir.load_target(str(tmp_path))
