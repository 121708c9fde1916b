"""What a script's --init / --drafter value names, and the model it loads, placed on the mesh.

Reading one happens in two steps, so that a script can check every input before any weight is read: the *_config
functions read configs only (HF config.json, a DFlash config.json, the meta JSON of a checkpoint of ours) and check
how the target, the drafter, the generation config and the tokenizer agree; `check_tensors` reads the safetensors
headers (every tensor there with its shape; no data); the load_* functions then read the weights.

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
import os

from absl import flags
from flax import nnx

from kdtree_jax import cli
from kdtree_jax import config as config_lib
from kdtree_jax import dflash_format, memory, sharding
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.tokenizer import load_tokenizer

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


# ----------------------------------------------------------------------------------------------- configs only

def target_config(value: str, *, preset: str = "tiny", dtype: str | None = None) -> config_lib.ModelConfig:
    """The ModelConfig of the target named by `value` without reading a tensor (random: the preset); dtype: the one
    it will run in (default: the preset's, a checkpoint of ours' own; an HF directory's is read from its tensors)."""
    kind = checkpoint_kind(value)
    if kind == RANDOM:
        cfg = config_lib.preset(preset)
    elif kind == ORBAX:
        from kdtree_jax.checkpoint import read_meta, read_target_config
        _expect_orbax_kind(read_meta(value), "target", value)
        cfg = read_target_config(value)
    elif kind == HF:
        from kdtree_jax.hf_import import read_hf_config
        cfg = read_hf_config(value)
    else:
        raise ValueError(f"{value} holds a DFlash drafter, not a target model; pass it as --drafter")
    return cfg.replace(dtype=dtype) if dtype else cfg


def drafter_config(value: str, target: config_lib.ModelConfig, *,
                   block_size: int | None = None) -> config_lib.DrafterConfig:
    """The DrafterConfig of the drafter named by `value`, checked to fit `target` (vocabulary, hidden size,
    target_layer_ids), without reading a tensor. random: the tiny drafter config with `block_size` (default
    RANDOM_BLOCK_SIZE); a checkpointed drafter has its own block size, and a `block_size` that differs is refused."""
    kind = checkpoint_kind(value)
    if kind == RANDOM:
        return config_lib.tiny_drafter(target, RANDOM_BLOCK_SIZE if block_size is None else block_size)
    if kind == ORBAX:
        from kdtree_jax.checkpoint import read_drafter_config, read_meta
        _expect_orbax_kind(read_meta(value), "drafter", value)
        cfg = read_drafter_config(value)
        cfg.check_fits(target)
    elif kind == DFLASH:
        cfg = dflash_format.read_dflash_config(value, target)
    else:
        raise ValueError(f"{value} holds a target model (its config.json does not name DFlashDraftModel), not a "
                         f"drafter; pass a DFlash drafter directory or a drafter checkpoint of ours as --drafter")
    if block_size is not None and block_size != cfg.block_size:
        raise ValueError(f"--block_size={block_size} differs from the block size {cfg.block_size} the drafter "
                         f"{value} was trained with; drop --block_size (a checkpointed drafter uses its own)")
    return cfg


def check_tensors(value: str, target: config_lib.ModelConfig, drafter: config_lib.DrafterConfig | None = None) -> None:
    """The safetensors headers of an HF target (drafter None) or DFlash drafter directory agree with its config:
    every tensor there with its shape, dtype as config.json says (no tensor data read). Checkpoints of ours are
    checked the same way by their restore, before any array is read; random models have nothing to check."""
    kind = checkpoint_kind(value)
    if kind == HF and drafter is None:
        from kdtree_jax.hf_import import check_hf_checkpoint
        check_hf_checkpoint(value, target)
    elif kind == DFLASH and drafter is not None:
        dflash_format.check_dflash_tensors(value, drafter, target)


def check_mesh(cfg: config_lib.ModelConfig, mesh) -> None:
    """Every param of a `cfg` target splits evenly over `mesh` (sharding.param_spec), from the abstract model."""
    if mesh is None:
        return
    _, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), nnx.Param)
    for path, leaf in nnx.to_flat_state(state):
        sharding.param_spec(path, leaf.shape, dict(mesh.shape))


def check_tokenizer(tokenizer, source: str, target: config_lib.ModelConfig, eos_ids: tuple[int, ...]) -> None:
    """The tokenizer belongs to the model: its ids lie in the model's vocabulary, and the token it ends a text with
    is one the model stops at (`eos_ids`, from eos_token_ids)."""
    if tokenizer.vocab_size > target.vocab_size:
        raise ValueError(f"the tokenizer {source} has {tokenizer.vocab_size} tokens but the model's vocabulary is "
                         f"{target.vocab_size}: it is another model's tokenizer; pass --tokenizer with this model's")
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None and eos_ids and eos not in eos_ids:
        raise ValueError(f"the tokenizer {source} ends texts with token {eos} but the model stops at {list(eos_ids)} "
                         f"(config.json / {GENERATION_CONFIG}): it is another model's tokenizer; pass --tokenizer "
                         f"with this model's")


def _expect_orbax_kind(meta: dict, kind: str, value: str) -> None:
    if meta["kind"] != kind:
        raise ValueError(f"{value} is a {meta['kind']} checkpoint, not a {kind}; pass it as "
                         f"{'--drafter' if meta['kind'] == 'drafter' else 'the target'}")


# ----------------------------------------------------------------------------------------------- loading

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


def load_drafter(value: str, target: config_lib.ModelConfig, *, block_size: int | None = None, seed: int = 0,
                 mesh=None) -> Drafter:
    """The drafter named by `value` for `target` (its config checked first: drafter_config).

    mesh: a checkpoint of ours is restored replicated over it, so that with several processes every process holds
    its devices' copies (restored onto one device, a process could not address it)."""
    cfg = drafter_config(value, target, block_size=block_size)
    kind = checkpoint_kind(value)
    if kind == RANDOM:
        return Drafter(cfg, target, nnx.Rngs(seed))
    if kind == ORBAX:
        from kdtree_jax.checkpoint import restore_drafter
        return restore_drafter(value, target,
                               shardings=(lambda *_: sharding.replicated(mesh)) if mesh is not None else None)
    return dflash_format.load_dflash_drafter(value, target)


def eos_token_ids(value: str, target: config_lib.ModelConfig) -> tuple[int, ...]:
    """Every EOS id the model names: generation_config.json's eos_token_id (an id or a list) in an HF directory, then
    config.json's (target.eos_token_id). ValueError naming the file for one that is not a token id of the model."""
    ids = () if target.eos_token_id is None else (target.eos_token_id,)
    path = os.path.join(value, GENERATION_CONFIG)
    if value == RANDOM or not os.path.isfile(path):
        return ids
    from kdtree_jax.hf_import import read_json
    eos = read_json(path, "a generation config").get("eos_token_id")
    if eos is None:
        return ids
    listed = eos if isinstance(eos, list) else [eos]
    if not listed or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < target.vocab_size
                             for i in listed):
        raise ValueError(f"{path}: eos_token_id = {eos!r} must be a token id (or a non-empty list of them) in "
                         f"[0, {target.vocab_size}), the model's vocabulary; fix it or delete the field")
    return tuple(listed) + tuple(i for i in ids if i not in listed)


def define_model_flags(fv: flags.FlagValues) -> None:
    """--target, --drafter, --tokenizer: a target, its drafter and the tokenizer of the prompts (the benchmarks on
    held-out prompts); `model_configs` checks them."""
    flags.DEFINE_string("target", "checkpoints/target", "target: a checkpoint directory of ours or an HF model "
                        "directory", flag_values=fv)
    flags.DEFINE_string("drafter", "checkpoints/drafter", "drafter: a checkpoint directory of ours or a DFlash "
                        "drafter directory in the published format", flag_values=fv)
    flags.DEFINE_string("tokenizer", "checkpoints/tokenizer.json", "the project's tokenizers JSON, or a model "
                        "directory (tiktoken.model or tokenizer.json)", flag_values=fv)


def model_configs(f, dtype: str | None):
    """The configs of --target (in `dtype`; None: its own) and --drafter, the --tokenizer and the target's stop ids,
    checked against each other before any weight is read -> (target config, drafter config, tokenizer, eos ids); an
    error names the flag."""
    with cli.about(f, "target"):
        target = target_config(f.target, dtype=dtype)
        eos = eos_token_ids(f.target, target)
    with cli.about(f, "drafter"):
        drafter = drafter_config(f.drafter, target)
    with cli.about(f, "tokenizer"):
        tokenizer = load_tokenizer(f.tokenizer)
        check_tokenizer(tokenizer, f.tokenizer, target, eos)
    return target, drafter, tokenizer, eos


def check_model_tensors(f, target: config_lib.ModelConfig, drafter: config_lib.DrafterConfig) -> None:
    """The safetensors headers (or checkpoint metadata) of --target and --drafter against their configs."""
    with cli.about(f, "target"):
        check_tensors(f.target, target)
    with cli.about(f, "drafter"):
        check_tensors(f.drafter, target, drafter)
