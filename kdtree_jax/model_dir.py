"""What a script's --init / --drafter value names, and the model it loads, placed on the mesh.

A value is one of:
  random   a randomly initialised model (the target at a preset; the drafter the tiny config for that target)
  orbax    a checkpoint of ours (kdtree_jax.checkpoint: numbered step directories)
  hf       an HF target directory: config.json (DeepSeek-V3 / Kimi K2.x, K2.5/K2.6 nested) + *.safetensors
  dflash   a DFlash drafter directory in the published format (config.json naming DFlashDraftModel + *.safetensors)
A target is read straight into its shards when a mesh is given (orbax: each device reads its slice; HF: each param is
converted on the host and each device receives its slice, kdtree_jax.sharding.import_placer); a drafter is read
whole (the Decoder replicates it). A directory that is none of these raises ValueError naming what it lacks.
"""
from __future__ import annotations

import glob
import json
import os

from flax import nnx

from kdtree_jax import config as config_lib
from kdtree_jax import dflash_format, memory, sharding
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer

RANDOM, ORBAX, HF, DFLASH = "random", "orbax", "hf", "dflash"
RANDOM_BLOCK_SIZE = 8  # block size L of a random drafter unless given
GENERATION_CONFIG = "generation_config.json"


def checkpoint_kind(value: str) -> str:
    """RANDOM | ORBAX | HF | DFLASH for an --init / --drafter value; ValueError naming what a directory lacks."""
    if value == RANDOM:
        return RANDOM
    if not os.path.isdir(value):
        raise ValueError(f"{value!r} is neither 'random' nor a directory")
    if any(os.path.isdir(os.path.join(value, d)) and d.isdigit() for d in os.listdir(value)):
        return ORBAX
    config_json = os.path.join(value, "config.json")
    if not os.path.isfile(config_json):
        raise ValueError(f"{value} is not a usable checkpoint: it has no config.json (an HF model or DFlash drafter "
                         f"directory) and no numbered step directories (an orbax checkpoint of ours)")
    if not glob.glob(os.path.join(value, "*.safetensors")):
        raise ValueError(f"{value} is not a usable checkpoint: it has a config.json but no *.safetensors weights "
                         f"(download the model's safetensors shards into it)")
    return DFLASH if dflash_format.is_dflash_dir(value) else HF


def load_target(value: str, *, preset: str = "tiny", seed: int = 0, dtype: str | None = None,
                mesh=None) -> Transformer:
    """The target named by `value`; dtype: run it in this dtype (default: random -> the preset's, orbax -> the
    stored one, hf -> bfloat16); mesh: place each param in its shards."""
    kind = checkpoint_kind(value)
    if kind == RANDOM:
        cfg = config_lib.preset(preset)
        cfg = cfg.replace(dtype=dtype) if dtype else cfg
        memory.check_model_fits(lambda: Transformer(cfg, nnx.Rngs(seed)), cfg.name)
        return Transformer(cfg, nnx.Rngs(seed))  # the Decoder shards it
    if kind == ORBAX:
        from kdtree_jax.checkpoint import restore_target
        return restore_target(value, dtype=dtype, shardings=sharding.restore_shardings(mesh) if mesh else None)
    if kind == HF:
        from kdtree_jax.hf_import import load_hf_checkpoint
        return load_hf_checkpoint(value, dtype=dtype, place=sharding.import_placer(mesh) if mesh else None)
    raise ValueError(f"{value} holds a DFlash drafter, not a target model; pass it as --drafter")


def target_config(value: str) -> config_lib.ModelConfig:
    """The ModelConfig of a target checkpoint (orbax or HF) without reading its weights."""
    kind = checkpoint_kind(value)
    if kind == ORBAX:
        from kdtree_jax.checkpoint import read_target_config
        return read_target_config(value)
    if kind == HF:
        from kdtree_jax.hf_import import read_hf_config
        return read_hf_config(value)
    raise ValueError(f"{value!r} is not a target checkpoint (an orbax checkpoint of ours or an HF model directory)")


def load_drafter(value: str, target: config_lib.ModelConfig, *, block_size: int | None = None, seed: int = 0,
                 mesh=None) -> Drafter:
    """The drafter named by `value` for `target` (random: the tiny drafter config with `block_size`, default
    RANDOM_BLOCK_SIZE). A checkpointed drafter has its own block size: a `block_size` that differs is refused.

    mesh: a checkpoint of ours is restored replicated over it, so that with several processes every process holds
    its devices' copies (restored onto one device, a process could not address it)."""
    kind = checkpoint_kind(value)
    if kind == RANDOM:
        return Drafter(config_lib.tiny_drafter(target, block_size or RANDOM_BLOCK_SIZE), target, nnx.Rngs(seed))
    if kind == ORBAX:
        from kdtree_jax.checkpoint import restore_drafter
        drafter = restore_drafter(value, target,
                                  shardings=(lambda *_: sharding.replicated(mesh)) if mesh is not None else None)
    elif kind == DFLASH:
        drafter = dflash_format.load_dflash_drafter(value, target)
    else:
        raise ValueError(f"{value} holds a target model (its config.json does not name DFlashDraftModel), not a "
                         f"drafter; pass a DFlash drafter directory or a drafter checkpoint of ours as --drafter")
    if block_size is not None and block_size != drafter.cfg.block_size:
        raise ValueError(f"--block_size={block_size} differs from the block size {drafter.cfg.block_size} the drafter "
                         f"{value} was trained with; drop --block_size (a checkpointed drafter uses its own)")
    return drafter


def eos_token_id(value: str, target: config_lib.ModelConfig) -> int | None:
    """The EOS the model stops at: generation_config.json's eos_token_id (the first of a list) in an HF directory,
    else config.json's (target.eos_token_id)."""
    path = os.path.join(value, GENERATION_CONFIG)
    if value == RANDOM or not os.path.isfile(path):
        return target.eos_token_id
    with open(path) as f:
        eos = json.load(f).get("eos_token_id", target.eos_token_id)
    return eos[0] if isinstance(eos, list) else eos
