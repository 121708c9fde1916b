"""DFlash drafters in the published format (z-lab/dflash `DFlashDraftModel`, served by SGLang's DFLASH mode) <-> ours.

A published drafter directory holds a Qwen3-style `config.json` (architectures ["DFlashDraftModel"]) and safetensors:
  config     hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
             rms_norm_eps, rope_theta (plain RoPE), vocab_size, block_size, num_target_layers,
             dflash_config {target_layer_ids, mask_token_id}
  tensors    layers.{i}.input_layernorm / post_attention_layernorm .weight [D]
             layers.{i}.self_attn.q_proj.weight [H*hd, D], k_proj / v_proj .weight [H_kv*hd, D],
             o_proj.weight [D, H*hd], q_norm / k_norm .weight [hd]
             layers.{i}.mlp.gate_proj / up_proj .weight [I, D], down_proj.weight [D, I]
             fc.weight [D, K*D] (K = len(target_layer_ids)), hidden_norm.weight [D], norm.weight [D]
  (names may carry a `model.` prefix; there is no embedding or lm_head: the drafter uses the target's).
The math is ours (kdtree_jax/drafter.py): the context feature hidden_norm(fc(concat of the target layers' outputs)) is
projected into every layer's K/V, the block attends non-causally to context + block, q/k are RMS-normed per head then
rotated. Torch Linear weights are [out, in], as ours (ours split `out` into heads: q_proj [H, hd, D], o_proj's `in`
into [H, hd]); one layout difference is converted here: the published RoPE turns dims (i, i + hd/2) together where
ours turns (2i, 2i+1); q_proj / k_proj head-dim rows and the q_norm / k_norm weights are permuted per head on the way
in and back on the way out, which leaves every attention score unchanged.

`target_layer_ids` name the hidden state after target layer i (HF `output_hidden_states[i + 1]`, SGLang's capture
before layer i + 1), which is the residual stream our Transformer returns, for every layer but the last: there HF
hands over the final-normed state and SGLang captures nothing, so a drafter that reads the target's last layer is
refused both ways.
"""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax.config import DrafterConfig, ModelConfig
from kdtree_jax.drafter import Drafter
from kdtree_jax.hf_import import Place, _nest, _TensorFiles, read_json, save_safetensors

ARCHITECTURE = "DFlashDraftModel"
MODEL_PREFIX = "model."  # some trainers save the layers under this prefix; SGLang accepts both
WEIGHTS_FILE = "model.safetensors"


def is_dflash_dir(directory: str) -> bool:
    """Whether `directory/config.json` names the published DFlash drafter architecture."""
    config = _read_json(os.path.join(directory, "config.json"))
    architectures = (config or {}).get("architectures")
    return isinstance(architectures, list) and ARCHITECTURE in architectures


def read_dflash_config(directory: str, target: ModelConfig) -> DrafterConfig:
    """The DrafterConfig of a published drafter directory, for the target `target`.

    Raises ValueError naming the file and field for anything missing or not runnable here.
    """
    path = os.path.join(directory, "config.json")
    hf = _read_json(path)
    if hf is None:
        raise ValueError(f"{path} does not exist: a DFlash drafter directory needs its config.json")
    try:
        return drafter_config_from_hf(hf, target, where=path)
    except (TypeError, AttributeError, KeyError) as e:  # a field of a JSON type no check foresaw
        raise ValueError(f"{path}: a field has a JSON type the config does not allow ({e})") from None


def check_dflash_tensors(directory: str, cfg: DrafterConfig, target: ModelConfig) -> None:
    """Every tensor the drafter config needs is in the directory's safetensors with its shape (headers only)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Drafter(cfg, target, nnx.Rngs(0))), nnx.Param)
    wanted = {path: tuple(v.shape) for path, v in nnx.to_flat_state(state)}
    with _TensorFiles(os.path.abspath(directory)) as files:
        _check_tensor_shapes(files, cfg, wanted)


def _check_tensor_shapes(files, cfg: DrafterConfig, wanted: dict) -> str:
    """The name prefix of the drafter's tensors, after checking each is there with the shape `wanted` implies."""
    prefix = MODEL_PREFIX if any(n.startswith(MODEL_PREFIX + "layers.") for n in files.names) else ""
    missing = [prefix + name for name in _tensor_names(cfg) if prefix + name not in files.names]
    if missing:
        raise ValueError(f"DFlash drafter {files.directory} lacks tensors its config.json needs: "
                         f"{', '.join(missing[:8])}" + (f", ... ({len(missing)} in all)" if len(missing) > 8 else ""))
    for path, name in _param_names(cfg):
        expected, found = _hf_shape(path, wanted[path]), files.shape(prefix + name)
        if found != expected:
            raise ValueError(f"tensor {prefix + name!r} in {files.file_of[prefix + name]} has shape {found}, expected "
                             f"{expected} for this config.json")
    return prefix


def drafter_config_from_hf(hf: dict, target: ModelConfig, where: str = "config.json") -> DrafterConfig:
    """DrafterConfig of a published config.json dict (see the module docstring for the fields read)."""
    dflash = hf.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ValueError(f"{where}: field 'dflash_config' = {dflash!r} must be a JSON object")

    def integer(key: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).lstrip("-").isdigit():
            raise ValueError(f"{where}: field {key!r} = {value!r} must be an integer")
        return int(value)

    def need(key: str, value):
        if value is None:
            raise ValueError(f"{where} lacks field {key!r}, which a DFlash drafter config must have")
        return value

    def check(ok: bool, key: str, why: str):
        if not ok:
            raise ValueError(f"{where}: field {key!r} = {hf.get(key, dflash.get(key))!r} {why}")

    check(hf.get("hidden_act", "silu") == "silu", "hidden_act", "is not supported (only 'silu')")
    check(not hf.get("attention_bias", False), "attention_bias", "is not supported (the projections have no bias)")
    layer_types = hf.get("layer_types") or []
    check(all(t == "full_attention" for t in layer_types), "layer_types",
          "is not supported: only 'full_attention' layers (no sliding window) are implemented")
    try:
        rope_theta, rope = _rope(hf)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    check(rope in (None, "default"), "rope_scaling", "is not supported: only plain RoPE (rope_type 'default')")
    for key in ("conv_kernel_size", "selector_rank", "projector_type", "attention_sink_bias"):
        check(not dflash.get(key), key, "names a DFlash variant that is not implemented (plain DFlash only)")

    layers = integer("num_hidden_layers", need("num_hidden_layers", hf.get("num_hidden_layers")))
    check(layers >= 1, "num_hidden_layers", "must be at least 1")
    num_target = hf.get("num_target_layers", dflash.get("num_target_layers"))
    if num_target is not None and integer("num_target_layers", num_target) != target.num_layers:
        raise ValueError(f"{where}: num_target_layers = {num_target} but the target has {target.num_layers} layers; "
                         f"use the drafter trained for this target")
    layer_ids = dflash.get("target_layer_ids", hf.get("target_layer_ids"))
    if layer_ids is None:
        layer_ids = default_target_layer_ids(integer("num_target_layers", need("num_target_layers", num_target)),
                                             layers)
    if not isinstance(layer_ids, list) or not layer_ids:
        raise ValueError(f"{where}: field 'target_layer_ids' = {layer_ids!r} must be a non-empty list of layer ids")
    sizes = {key: integer(key, need(key, hf.get(key))) for key in ("num_attention_heads", "hidden_size", "vocab_size",
                                                                    "intermediate_size")}
    sizes["block_size"] = integer("block_size", need("block_size", hf.get("block_size", dflash.get("block_size"))))
    sizes["head_dim"] = integer("head_dim", hf.get("head_dim") or sizes["hidden_size"] // max(
        sizes["num_attention_heads"], 1))
    sizes["num_key_value_heads"] = integer("num_key_value_heads", hf.get("num_key_value_heads")
                                           or sizes["num_attention_heads"])
    for key, value in sizes.items():
        check(value >= 1, key, "must be a positive integer")
    eps = hf.get("rms_norm_eps", 1e-6)
    check(isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < 1, "rms_norm_eps",
          "must be a number in (0, 1)")
    check(rope_theta > 0 and rope_theta != float("inf"), "rope_theta", "must be a positive number")
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    cfg = DrafterConfig(
        hidden_size=hidden, vocab_size=sizes["vocab_size"], num_layers=layers, block_size=sizes["block_size"],
        target_layer_ids=tuple(integer("target_layer_ids", i) for i in layer_ids),
        mask_token_id=integer("dflash_config.mask_token_id", need(
            "dflash_config.mask_token_id", dflash.get("mask_token_id", hf.get("mask_token_id")))),
        num_heads=heads, head_dim=sizes["head_dim"], intermediate_size=sizes["intermediate_size"],
        rms_norm_eps=float(eps), rope_theta=rope_theta, num_kv_heads=sizes["num_key_value_heads"])
    cfg.check_fits(target)
    _refuse_last_layer(cfg, target, where)
    return cfg


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default when a config names no target_layer_ids: the middle layer for a one-layer drafter,
    else `num_draft_layers` layers evenly from layer 1 to layer num_target_layers - 3 (rounded)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [int(round(first + i * (last - first) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def load_dflash_drafter(directory: str, target: ModelConfig, place: Place | None = None) -> Drafter:
    """Build our Drafter (in the target's dtype) from a published drafter directory.

    place(path, host_array) -> jax.Array puts each param on its devices (default jnp.asarray). Raises ValueError
    naming the file, tensor or field for a missing tensor, a wrong shape or a config this engine cannot run.
    """
    directory = os.path.abspath(directory)
    cfg = read_dflash_config(directory, target)
    place = place or (lambda path, x: jnp.asarray(x))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Drafter(cfg, target, nnx.Rngs(0))), nnx.Param)
    wanted = {path: (tuple(v.shape), np.dtype(v.dtype)) for path, v in nnx.to_flat_state(state)}
    with _TensorFiles(directory) as files:
        prefix = _check_tensor_shapes(files, cfg, {path: shape for path, (shape, _) in wanted.items()})
        params: dict = {}
        for path, name in _param_names(cfg):
            shape, dtype = wanted[path]
            _nest(params, path, place(path, _to_ours(path, files.read(prefix + name), shape).astype(dtype)))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def export_dflash_drafter(drafter: Drafter, target: ModelConfig, directory: str, dtype: str | None = None) -> str:
    """Write `drafter` as a published DFlash drafter directory (config.json + model.safetensors).

    target: the ModelConfig the drafter was trained on (num_target_layers, max positions). dtype: of the stored
    weights ("bfloat16" | "float32"; default the drafter's). Returns the absolute directory.
    """
    cfg = drafter.cfg
    check_exportable(cfg, target)
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    params = {path: np.asarray(v[...], np.float32) for path, v in nnx.to_flat_state(nnx.state(drafter, nnx.Param))}
    dtype = dtype or jnp.dtype(drafter.fc[...].dtype).name
    store = jnp.bfloat16 if dtype == "bfloat16" else np.float32
    tensors = {name: np.ascontiguousarray(np.asarray(_to_hf(path, params[path]).astype(store)))
               for path, name in _param_names(cfg)}
    save_safetensors(tensors, os.path.join(directory, WEIGHTS_FILE))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dflash_config_dict(cfg, target, dtype), f, indent=2)
    return directory


def dflash_config_dict(cfg: DrafterConfig, target: ModelConfig, dtype: str) -> dict:
    """The published config.json of `cfg` (a Qwen3 config plus the DFlash fields)."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "max_position_embeddings": target.max_position_embeddings,
        "layer_types": ["full_attention"] * cfg.num_layers, "sliding_window": None, "use_sliding_window": False,
        "vocab_size": cfg.vocab_size, "tie_word_embeddings": False, "dtype": dtype, "torch_dtype": dtype,
        "block_size": cfg.block_size, "num_target_layers": target.num_layers,
        "dflash_config": {"target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id},
    }


# ----------------------------------------------------------------------------------------------- layouts

def _param_names(cfg: DrafterConfig) -> list[tuple[tuple, str]]:
    """(our Param path, published tensor name) for every param of Drafter(cfg)."""
    out = [(("fc",), "fc.weight"), (("hidden_norm", "weight"), "hidden_norm.weight"),
           (("norm", "weight"), "norm.weight")]
    for i in range(cfg.num_layers):
        layer, name = ("layers", i), f"layers.{i}."
        out += [(layer + ("input_layernorm", "weight"), name + "input_layernorm.weight"),
                (layer + ("post_attention_layernorm", "weight"), name + "post_attention_layernorm.weight")]
        out += [(layer + (p,), f"{name}self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        out += [(layer + (n, "weight"), f"{name}self_attn.{n}.weight") for n in ("q_norm", "k_norm")]
        out += [(layer + ("mlp", p), f"{name}mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")]
    return out


def _tensor_names(cfg: DrafterConfig) -> list[str]:
    return [name for _, name in _param_names(cfg)]


def _pairs_from_halves(head_dim: int) -> np.ndarray:
    """[hd] index: our dim j holds the published dim index[j] (ours 2i <- theirs i, ours 2i+1 <- theirs i + hd/2)."""
    return np.arange(head_dim).reshape(2, head_dim // 2).T.ravel()


def _rotated(path: tuple) -> bool:
    """q_proj, k_proj and their norms: the params whose head dim RoPE turns."""
    return path[-1] in ("q_proj", "k_proj") or (path[-1] == "weight" and path[-2] in ("q_norm", "k_norm"))


def _hf_shape(path: tuple, ours: tuple) -> tuple:
    """The published shape of a param of our shape `ours`: Linear weights [out, in], the rest as ours."""
    name = path[-1]
    if name == "o_proj":  # ours [D, H, hd]
        return ours[0], ours[1] * ours[2]
    if name in ("q_proj", "k_proj", "v_proj"):  # ours [H, hd, D]
        return ours[0] * ours[1], ours[2]
    return ours  # norms; fc, gate/up/down_proj: ours [out, in]


def _head_dim_axis(path: tuple) -> int:
    """The axis of a rotated param (`_rotated`) that holds the head dim: a norm's only one, a projection's [H, hd, D]
    middle one."""
    return 0 if path[-1] == "weight" else 1


def _to_ours(path: tuple, x: np.ndarray, ours: tuple) -> np.ndarray:
    """A published tensor in our layout `ours` (heads split out of Linear axes, RoPE dims reordered into pairs)."""
    y = x.reshape(ours)
    if not _rotated(path):
        return y
    axis = _head_dim_axis(path)
    return np.take(y, _pairs_from_halves(ours[axis]), axis=axis)


def _to_hf(path: tuple, x: np.ndarray) -> np.ndarray:
    """Our param in the published layout (the inverse of _to_ours)."""
    if _rotated(path):
        axis = _head_dim_axis(path)
        x = np.take(x, np.argsort(_pairs_from_halves(x.shape[axis])), axis=axis)
    return x.reshape(_hf_shape(path, x.shape))


# ----------------------------------------------------------------------------------------------- helpers

def _rope(hf: dict) -> tuple[float, str | None]:
    """(rope_theta, rope type or None) from rope_theta + rope_scaling or transformers 5's rope_parameters."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"field 'rope_theta' = {theta!r} must be a number")
    theta = float(theta)
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type", params.get("type"))
    return theta, kind


def check_exportable(cfg: DrafterConfig, target: ModelConfig) -> None:
    """A drafter of ours can be written in the published format: it does not read the target's last layer."""
    _refuse_last_layer(cfg, target, "the drafter")


def _refuse_last_layer(cfg: DrafterConfig, target: ModelConfig, where: str) -> None:
    if target.num_layers - 1 in cfg.target_layer_ids:
        raise ValueError(f"{where}: target_layer_ids {list(cfg.target_layer_ids)} include the target's last layer "
                         f"({target.num_layers - 1}), whose hidden state the published format does not define the "
                         f"way this engine does (HF gives it final-normed, SGLang does not capture it); use a "
                         f"drafter whose target_layer_ids are below {target.num_layers - 1}")


def _read_json(path: str) -> dict | None:
    return read_json(path, "a model config") if os.path.exists(path) else None
