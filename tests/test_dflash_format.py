"""DFlash drafters in the published format: the fixture made by the reference code (tests/fixtures/make_dflash_fixture.py)
computes the reference's block logits here, our drafters export to that format and back, and configs this engine
cannot run are refused by name."""
import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from conftest import rel_err
from kdtree_jax import config, dflash_format, hf_import
from kdtree_jax.drafter import Drafter

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
TARGET_DIR = os.path.join(FIXTURES, "kimi_k26_tiny")
DRAFTER_DIR = os.path.join(FIXTURES, "dflash_tiny")


@pytest.fixture(scope="module")
def target():
    return hf_import.load_hf_checkpoint(TARGET_DIR, dtype="float32", progress=False)


def block_logits(drafter: Drafter, target, target_hidden, block, positions):
    """The drafter's logits [S, L, V] for `block` after a context whose concatenated feature is target_hidden
    [S, T, K*D] at positions[:, :T] (the block at positions[:, T:])."""
    s, t = target_hidden.shape[:2]
    hidden = tuple(jnp.asarray(h) for h in np.split(target_hidden, len(drafter.cfg.target_layer_ids), axis=-1))
    cache = drafter.extend_cache(drafter.init_cache(s, t), hidden, jnp.asarray(positions[:, :t]),
                                 jnp.zeros(s, jnp.int32))
    return np.asarray(drafter.block_logits(target.embed, target.logits, jnp.asarray(block),
                                           jnp.asarray(positions[:, t:]), cache, jnp.full(s, t, jnp.int32)))


def test_reference_logits(target):
    drafter = dflash_format.load_dflash_drafter(DRAFTER_DIR, target.cfg)
    assert (drafter.cfg.num_heads, drafter.cfg.kv_heads, drafter.cfg.block_size) == (4, 2, 4)
    assert drafter.cfg.target_layer_ids == (0, 1) and drafter.cfg.mask_token_id == 710
    ref = np.load(os.path.join(DRAFTER_DIR, "reference.npz"))
    ours = block_logits(drafter, target, ref["target_hidden"], ref["block"], ref["positions"])
    assert rel_err(ours, ref["logits"]) < 1e-4


def test_export_writes_the_reference_files(target, tmp_path):
    """The fixture read and written back: the same tensor names and values, the same DFlash fields."""
    drafter = dflash_format.load_dflash_drafter(DRAFTER_DIR, target.cfg)
    out = dflash_format.export_dflash_drafter(drafter, target.cfg, tmp_path / "out", dtype="bfloat16")
    theirs = load_file(os.path.join(DRAFTER_DIR, "model.safetensors"))
    ours = load_file(os.path.join(out, dflash_format.WEIGHTS_FILE))
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name].astype(np.float32), theirs[name].astype(np.float32), err_msg=name)
    with open(os.path.join(DRAFTER_DIR, "config.json")) as f:
        ref_cfg = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        our_cfg = json.load(f)
    for key in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size", "block_size",
                "num_target_layers", "dflash_config", "layer_types"):
        assert our_cfg[key] == ref_cfg[key], key


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_round_trip_of_our_drafter(target, tmp_path, kv_heads):
    """A random drafter of ours (bf16 target, GQA or not) -> published format -> ours: the same params and logits."""
    cfg = target.cfg.replace(dtype="bfloat16")
    dcfg = config.DrafterConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_layers=2, block_size=5,
                                target_layer_ids=(0, 1), mask_token_id=700, num_heads=4, head_dim=8,
                                intermediate_size=48, rms_norm_eps=1e-5, rope_theta=5000.0, num_kv_heads=kv_heads)
    drafter = Drafter(dcfg, cfg, nnx.Rngs(3))
    out = dflash_format.export_dflash_drafter(drafter, cfg, tmp_path / "drafter")
    back = dflash_format.load_dflash_drafter(out, cfg)
    assert back.cfg == dcfg
    before = nnx.to_flat_state(nnx.state(drafter, nnx.Param))
    after = dict(nnx.to_flat_state(nnx.state(back, nnx.Param)))
    for path, value in before:
        np.testing.assert_array_equal(np.asarray(after[path][...]), np.asarray(value[...]), err_msg=str(path))


def edited_copy(tmp_path, edit) -> str:
    """The fixture drafter with its config.json changed by edit(dict)."""
    directory = tmp_path / "edited"
    shutil.copytree(DRAFTER_DIR, directory)
    with open(directory / "config.json") as f:
        hf = json.load(f)
    edit(hf)
    with open(directory / "config.json", "w") as f:
        json.dump(hf, f)
    return str(directory)


@pytest.mark.parametrize("edit, message", [
    (lambda hf: hf["dflash_config"].pop("mask_token_id"), "lacks field 'dflash_config.mask_token_id'"),
    (lambda hf: hf.update(layer_types=["sliding_attention"] * 2), "'layer_types'"),
    (lambda hf: hf.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'rope_scaling'"),
    (lambda hf: hf.update(num_target_layers=61), "num_target_layers = 61 but the target has 3 layers"),
    (lambda hf: hf["dflash_config"].update(target_layer_ids=[0, 2]), "include the target's last layer (2)"),
    (lambda hf: hf.update(vocab_size=1024), "vocab_size=1024 does not fit"),
    (lambda hf: hf.pop("block_size"), "lacks field 'block_size'"),
])
def test_config_errors_name_the_field(target, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        dflash_format.load_dflash_drafter(edited_copy(tmp_path, edit), target.cfg)


def test_missing_tensor_is_named(target, tmp_path):
    directory = tmp_path / "partial"
    shutil.copytree(DRAFTER_DIR, directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors["layers.1.self_attn.k_norm.weight"]
    from safetensors.numpy import save_file
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks tensors .*layers\.1\.self_attn\.k_norm\.weight"):
        dflash_format.load_dflash_drafter(str(directory), target.cfg)


def test_default_target_layer_ids():
    """The published rule when a config names none: spread from layer 1 to num_target_layers - 3."""
    assert dflash_format.default_target_layer_ids(61, 1) == [30]
    assert dflash_format.default_target_layer_ids(61, 5) == [1, 15, 30, 44, 58]
    assert dflash_format.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


def test_export_script_refuses_a_drafter_of_the_last_layer():
    """The shipped drafter reads the code target's last layer (7), which the published format cannot express."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(root, "experiments", "export_dflash.py"),
                           f"--drafter={root}/checkpoints/drafter", f"--target={root}/checkpoints/target",
                           "--out=/nonexistent/never_written"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "include the target's last layer (7)" in proc.stderr.splitlines()[-1]
