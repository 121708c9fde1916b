"""Orbax checkpoints of a target Transformer or a DFlash Drafter: params in their own dtype plus the config.

A checkpoint directory holds one orbax step per save (`<directory>/<step>/`) with two items:
  params  the `nnx.Param` state as a pure dict (StandardSave), each array in the dtype it had when saved
  meta    JSON: {"kind": "target" | "drafter", "config": the ModelConfig or DrafterConfig as a dict}, and for a
          target with INT4 experts "int4_nibbles": their encoding in the kernels' layout (`Int4Experts.NIBBLES`;
          a checkpoint without it, or with another, is refused: the words would be read as other values), and
          "dense_layout": DENSE_LAYOUT (the dense weights stored [out..., in]; a checkpoint without it holds them
          [in, out...] and is refused with the command that converts it: `upgrade`)
and beside them FILE_SIZES, the size of every file of the step when it was written. Restores build the model
abstractly (no random init), refuse a model larger than the devices' memory, check that the step's files are all
there with their sizes (a missing or truncated file is reported as corrupt, by name), compare the checkpoint's tree of
shapes with the model's before reading any array, and place every array with the given shardings (default: the first
device). An array that still cannot be read is reported as corrupt too, with the reader's own reason.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from kdtree_jax import memory
from kdtree_jax.config import DrafterConfig, ModelConfig
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer
from pallas_kernels.int4_moe import Int4Experts

TARGET, DRAFTER = "target", "drafter"
FILE_SIZES = "file_sizes.json"  # in each step directory: {file path relative to the step: bytes when saved}
REQUIRED_FILES = ("params/_METADATA", "params/manifest.ocdbt", "meta/metadata")  # what every orbax step of ours has
DENSE_LAYOUT = "out_in"  # meta["dense_layout"]: the dense weights [out..., in] (`layers.project`)

# A pytree of jax.sharding.Sharding shaped like the model's Param state (or an nnx.State of them), or a function
# (path, jax.ShapeDtypeStruct) -> Sharding with path a tuple of state keys such as ("layers", 1, "mlp", "w_gate").
Shardings = Any | Callable[[tuple, jax.ShapeDtypeStruct], jax.sharding.Sharding] | None


def save(directory: str, model: Transformer | Drafter, step: int = 0) -> str:
    """Write `model`'s params and config as step `step` under `directory`; returns the absolute directory."""
    kind, cfg = _kind_and_config(model)
    meta = {"kind": kind, "config": dataclasses.asdict(cfg), "dense_layout": DENSE_LAYOUT}
    if kind == TARGET and cfg.expert_quant == "int4":
        meta["int4_nibbles"] = Int4Experts.NIBBLES
    return _write(directory, nnx.to_pure_dict(nnx.state(model, nnx.Param)), meta, step)


def upgrade(old: str, new: str) -> str:
    """Convert OLD's latest step, whose dense weights are stored [in, out...] (saved before the model stored them
    [out..., in]), into a new checkpoint NEW in the current layout (`to_out_in`); returns NEW's absolute path. The
    config and every value are kept: the converted model computes the same function. Raises ValueError when OLD
    records a layout (current or unknown) or NEW exists. The whole checkpoint passes through this process's first
    device (the shipped checkpoints' size; a K2.6-sized model comes from its HF directory instead). Command line:
    python -m kdtree_jax.checkpoint OLD NEW."""
    meta = read_meta(old, any_layout=True)
    if "dense_layout" in meta:
        raise ValueError(f"checkpoint {old} stores its dense weights {meta['dense_layout']!r}, not the old layout "
                         f"(no \"dense_layout\" in its meta); there is nothing to convert")
    if os.path.exists(new):
        raise ValueError(f"{new} exists; pass a new directory for the converted checkpoint")
    old = os.path.abspath(old)
    with _manager(old) as mngr:
        step = _resolve_step(mngr, old, None)
        with _reported_as_corrupt(old, step):
            params = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))["params"]
    params = jax.tree_util.tree_map_with_path(lambda path, x: to_out_in(_keys(path), x), params)
    return _write(new, params, {**meta, "dense_layout": DENSE_LAYOUT}, step)


# Leaf names of the dense weights whose input axis came first in the old layout and goes last now (o_proj apart).
_INPUT_FIRST = ("q_a_proj", "q_b_proj", "q_proj", "k_proj", "v_proj", "kv_a_proj", "gate_proj", "up_proj",
                "down_proj", "gate", "lm_head", "fc")


def to_out_in(path: tuple, x):
    """One param of the old layout in the current one: o_proj [H, V, D] -> [D, H, V] (its input is the heads x head
    dim), the `_INPUT_FIRST` weights their first axis last; kv_b_proj, the routed experts, the embedding and the norms
    as they are. path: the param's state keys, e.g. ("layers", 0, "self_attn", "o_proj")."""
    name = path[-1]
    if name == "o_proj":
        return jnp.moveaxis(x, -1, 0)
    return jnp.moveaxis(x, 0, -1) if name in _INPUT_FIRST else x


def _write(directory: str, params: dict, meta: dict, step: int) -> str:
    """params (a pure dict) and meta as step `step` under `directory`, with FILE_SIZES; returns the absolute
    directory."""
    directory = os.path.abspath(directory)
    with _manager(directory, read_only=False) as mngr:
        mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)))
        mngr.wait_until_finished()
    step_dir = os.path.join(directory, str(step))
    sizes = {os.path.relpath(os.path.join(root, f), step_dir): os.path.getsize(os.path.join(root, f))
             for root, _, files in os.walk(step_dir) for f in files}
    with open(os.path.join(step_dir, FILE_SIZES), "w") as f:
        json.dump(sizes, f, indent=1, sort_keys=True)
    return directory


def restore_target(directory: str, step: int | None = None, shardings: Shardings = None,
                   dtype: str | None = None) -> Transformer:
    """The Transformer saved in `directory` (latest step unless `step`), built from its stored ModelConfig.

    dtype: run the model in this dtype instead of the stored one ("float32" for exact equivalence checks); the
    params are cast on restore.
    """
    cfg = read_target_config(directory, step)
    if dtype:
        cfg = cfg.replace(dtype=dtype)
    return _restore_new(directory, step, lambda: Transformer(cfg, nnx.Rngs(0)), shardings)


def read_target_config(directory: str, step: int | None = None) -> ModelConfig:
    """The ModelConfig stored with a target checkpoint (no array is read)."""
    meta = read_meta(directory, step)
    _expect_kind(meta, TARGET, directory)
    cfg = _config_from_dict(ModelConfig, meta["config"])
    _expect_int4_nibbles(meta, cfg, directory)
    return cfg


def restore_drafter(directory: str, target_cfg: ModelConfig, step: int | None = None,
                    shardings: Shardings = None) -> Drafter:
    """The Drafter saved in `directory`, built from its stored DrafterConfig for the target `target_cfg`.

    The params take the target's dtype (a bf16 checkpoint restored for a float32 target is cast).
    """
    cfg = read_drafter_config(directory, step)
    return _restore_new(directory, step, lambda: Drafter(cfg, target_cfg, nnx.Rngs(0)), shardings)


def restore_params_into(directory: str, model: Transformer | Drafter, step: int | None = None,
                        shardings: Shardings = None) -> Transformer | Drafter:
    """Overwrite `model`'s params (in place, cast to the model's dtypes) with a checkpoint of the same shapes."""
    kind, cfg = _kind_and_config(model)
    meta = read_meta(directory, step)
    _expect_kind(meta, kind, directory)
    if kind == TARGET:
        _expect_int4_nibbles(meta, cfg, directory)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, _restore_params(directory, step, state, shardings))
    nnx.update(model, state)
    return model


def read_meta(directory: str, step: int | None = None, *, any_layout: bool = False) -> dict:
    """The JSON meta item ({"kind", "config", ...}) of a checkpoint step. any_layout: also one whose dense weights
    are stored [in, out...] (`upgrade` reads those); else such a checkpoint is refused."""
    directory = os.path.abspath(directory)
    with _manager(directory) as mngr:
        step = _resolve_step(mngr, directory, step)
        _check_files(directory, step)
        with _reported_as_corrupt(directory, step):
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if not (isinstance(meta, dict) and meta.get("kind") in (TARGET, DRAFTER) and isinstance(meta.get("config"), dict)):
        raise _corrupt(directory, step, "its meta item is not {\"kind\": \"target\" | \"drafter\", \"config\": {...}}")
    if meta.get("dense_layout") != DENSE_LAYOUT and not any_layout:
        raise ValueError(f"checkpoint {directory} stores its dense weights as {meta.get('dense_layout', 'in_out')!r} "
                         f"([in, out...], saved before they were stored [out..., in]), not {DENSE_LAYOUT!r}; convert "
                         f"it once: python -m kdtree_jax.checkpoint {directory} <new directory>")
    return meta


def read_drafter_config(directory: str, step: int | None = None) -> DrafterConfig:
    """The DrafterConfig stored with a drafter checkpoint (no array is read)."""
    meta = read_meta(directory, step)
    _expect_kind(meta, DRAFTER, directory)
    return _config_from_dict(DrafterConfig, meta["config"])


# ----------------------------------------------------------------------------------------------- internals

def _restore_new(directory, step, build: Callable[[], nnx.Module], shardings):
    abstract = nnx.eval_shape(build)
    graphdef, state = nnx.split(abstract, nnx.Param)  # raises if the module holds anything but Params
    memory.check_fits({f"{type(abstract).__name__} params": memory.tree_bytes(state)}, jax.devices(),
                      "restore it on more devices (shardings over a mesh) or a machine with more memory")
    nnx.replace_by_pure_dict(state, _restore_params(directory, step, state, shardings))
    return nnx.merge(graphdef, state)


def _restore_params(directory, step, state: nnx.State, shardings) -> dict:
    """Read the params of `directory` into the layout, dtypes and shardings of `state` (abstract or concrete)."""
    directory = os.path.abspath(directory)
    target = _abstract_params(state, shardings)
    with _manager(directory) as mngr:
        step = _resolve_step(mngr, directory, step)
        _check_files(directory, step)
        _check_same_shapes(mngr.item_metadata(step)["params"], target, f"{directory} step {step}")
        with _reported_as_corrupt(directory, step):
            restored = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    _check_finite(restored["params"], f"checkpoint {directory} step {step}")
    return restored["params"]


def _check_finite(params, where: str) -> None:
    """Refuse params holding NaN or +-inf, naming the first such param (one reduction per param, on its devices)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    finite = [jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating) else True for _, x in leaves]
    bad = [_path_str(path) for (path, _), ok in zip(leaves, jax.device_get(finite)) if not ok]
    if bad:
        raise ValueError(f"{where} holds non-finite values (NaN or inf) in {', '.join(bad[:8])}"
                         + (f", ... ({len(bad)} params in all)" if len(bad) > 8 else "")
                         + "; the checkpoint is corrupt: copy it again or save it again")


def _check_files(directory: str, step: int) -> None:
    """Raise ValueError naming the first file of the step that is missing or no longer has its saved size."""
    step_dir = os.path.join(directory, str(step))
    sizes_path = os.path.join(step_dir, FILE_SIZES)
    sizes = {}
    if os.path.exists(sizes_path):  # checkpoints saved before FILE_SIZES existed have only REQUIRED_FILES checked
        with open(sizes_path) as f:
            try:
                sizes = json.load(f)
            except ValueError:
                sizes = None
        if not (isinstance(sizes, dict) and all(isinstance(v, int) for v in sizes.values())):
            raise _corrupt(directory, step, f"{sizes_path} is not a JSON object of file sizes")
    for rel in dict.fromkeys(REQUIRED_FILES + tuple(sorted(sizes))):
        path = os.path.join(step_dir, rel)
        if not os.path.exists(path):
            raise _corrupt(directory, step, f"{path} is missing")
        if rel in sizes and os.path.getsize(path) != sizes[rel]:
            raise _corrupt(directory, step, f"{path} has {os.path.getsize(path)} bytes, {sizes[rel]} when saved")


@contextlib.contextmanager
def _reported_as_corrupt(directory: str, step: int):
    """An error of orbax / TensorStore while reading a step becomes a ValueError naming the step and the root cause
    (TensorStore wraps it in a bare Exception carrying a 60-line spec)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - TensorStore raises bare Exceptions
        while e.__cause__ is not None or e.__context__ is not None:
            e = e.__cause__ or e.__context__
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise _corrupt(directory, step, f"reading it failed ({reason[:500]})") from None


def _corrupt(directory: str, step: int, what: str) -> ValueError:
    return ValueError(f"checkpoint {directory} step {step} is corrupt: {what}; copy the checkpoint again or "
                              f"save it again")


def _abstract_params(state: nnx.State, shardings) -> dict:
    """The pure-dict tree of jax.ShapeDtypeStruct (shape, dtype of `state`; sharding from `shardings`)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        placed = jax.tree.map(lambda _: device, shapes)
    elif callable(shardings):
        placed = jax.tree_util.tree_map_with_path(lambda p, s: shardings(_keys(p), s), shapes)
    else:
        placed = nnx.to_pure_dict(shardings) if isinstance(shardings, nnx.State) else shardings
    try:
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, placed)
    except ValueError as e:
        raise ValueError(f"shardings do not match the model's param tree: {e}; pass one Sharding per param "
                         f"(the structure of nnx.state(model, nnx.Param)) or a function (path, shape) -> Sharding")


def _check_same_shapes(stored, target, where: str) -> None:
    """Raise ValueError naming every param path whose shape differs, is missing or is extra."""
    have = {_path_str(p): tuple(v.shape) for p, v in jax.tree_util.tree_flatten_with_path(stored)[0]}
    want = {_path_str(p): tuple(v.shape) for p, v in jax.tree_util.tree_flatten_with_path(target)[0]}
    problems = [f"{k}: checkpoint {have[k]} vs model {want[k]}" for k in sorted(want.keys() & have.keys())
                if have[k] != want[k]]
    problems += [f"{k}: missing from the checkpoint (model {want[k]})" for k in sorted(want.keys() - have.keys())]
    problems += [f"{k}: not in the model (checkpoint {have[k]})" for k in sorted(have.keys() - want.keys())]
    if problems:
        raise ValueError(f"checkpoint {where} does not fit the model ({len(problems)} params differ):\n  "
                         + "\n  ".join(problems)
                         + "\nbuild the model with the checkpoint's config (restore_target / restore_drafter)")


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def _path_str(path) -> str:
    return "/".join(str(k) for k in _keys(path))


def _kind_and_config(model) -> tuple[str, ModelConfig | DrafterConfig]:
    if isinstance(model, Transformer):
        return TARGET, model.cfg
    if isinstance(model, Drafter):
        return DRAFTER, model.cfg
    raise ValueError(f"cannot checkpoint a {type(model).__name__}; pass a Transformer or a Drafter")


def _expect_int4_nibbles(meta: dict, cfg: ModelConfig, directory: str) -> None:
    if cfg.expert_quant == "int4" and meta.get("int4_nibbles") != Int4Experts.NIBBLES:
        raise ValueError(f"checkpoint {os.path.abspath(directory)} stores its INT4 experts with nibbles "
                         f"{meta.get('int4_nibbles', 'q + 8 (saved before the sixteenth session)')!r}, not "
                         f"{Int4Experts.NIBBLES!r} as the kernels read them: re-import the model from its HF "
                         "directory (generate.py --init=<hf dir>) and save it again")


def _expect_kind(meta: dict, kind: str, directory: str) -> None:
    if meta.get("kind") != kind:
        raise ValueError(f"checkpoint {os.path.abspath(directory)} holds a {meta.get('kind')!r} model, not a {kind!r}; "
                         f"pass it where a {meta.get('kind')} goes")


# The JSON type each field annotation of ModelConfig / DrafterConfig allows in a checkpoint's meta.
_ANNOTATION_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "tuple[int, ...]": lambda v: isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in v),
}


def _config_from_dict(cls, d: dict):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"checkpoint config has fields {unknown} that {cls.__name__} does not know; "
                         f"it was written by a newer kdtree_jax")
    missing = sorted(name for name, f in fields.items() if name not in d and f.default is dataclasses.MISSING)
    if missing:
        raise ValueError(f"checkpoint config lacks fields {missing} of {cls.__name__}; the checkpoint is corrupt")
    for name, value in d.items():
        annotation = str(fields[name].type)
        optional = annotation.endswith(" | None")
        check = _ANNOTATION_CHECKS[annotation.removesuffix(" | None")]
        if not ((optional and value is None) or check(value)):
            raise ValueError(f"checkpoint config field {name!r} = {value!r} is not of type {annotation}; the "
                             f"checkpoint is corrupt")
    if "target_layer_ids" in d:
        d = {**d, "target_layer_ids": tuple(d["target_layer_ids"])}
    return cls(**d)


def _manager(directory: str, read_only: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(create=not read_only, read_only=read_only, enable_async_checkpointing=False)
    handlers = {"params": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


def _resolve_step(mngr: ocp.CheckpointManager, directory: str, step: int | None) -> int:
    steps = mngr.all_steps()
    if not steps:
        raise ValueError(f"no checkpoint found in {directory}; write one with kdtree_jax.checkpoint.save")
    if step is None:
        return max(steps)
    if step not in steps:
        raise ValueError(f"checkpoint {directory} has no step {step}; it has steps {sorted(steps)}")
    return step


if __name__ == "__main__":
    import sys
    if len(sys.argv) != 3:
        sys.exit("usage: python -m kdtree_jax.checkpoint OLD_DIR NEW_DIR (converts OLD's dense weights to [out, in])")
    print(upgrade(sys.argv[1], sys.argv[2]))
