"""HF safetensors checkpoints (DeepSeek-V3, Kimi K2.x incl. compressed-tensors INT4 experts) <-> our params.

Import streams tensor by tensor: each of our params is read, converted and placed before the next is touched, and the
routed experts are stacked into one host array [E, ...] filled expert by expert, so the host never holds more than one
param. HF Linear weights are [out, in], and so are our dense weights, their axes split (q_b_proj [H, P+R, Q], o_proj
[D, H, V]): a reshape, the HF head-major order kept; kv_b_proj [C, H, P+V] and the bf16 expert stacks (w_gate [E, D,
I], ...) are ours [in, ...out]: a transpose then a reshape. Routed experts in INT4 (`weight_packed`, `weight_scale`,
`weight_shape`) are dequantized into the model dtype. Tensor names may carry the `language_model.` prefix of
K2.5/K2.6; tensors of other towers and MTP layers (index >= num_layers) are ignored. Export writes the same layout
(config.json + safetensors, INT4 experts packed on request).
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import math
import os
import re
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from pallas_kernels import int4_layout
from kdtree_jax import memory
from kdtree_jax.config import ModelConfig, from_hf_config
from kdtree_jax.model.transformer import Transformer
from pallas_kernels.int4_moe import repack_linear

NESTED_PREFIX = "language_model."  # K2.5 / K2.6 nest the text model under this prefix
INDEX_FILE = "model.safetensors.index.json"
INT4_SUFFIXES = ("_packed", "_scale", "_shape")  # "<name>.weight" -> "<name>.weight_packed" etc.

# place(path, host_array) -> jax.Array: puts one converted param (our layout and dtype) on its devices.
Place = Callable[[tuple, np.ndarray], jax.Array]


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one of our params comes from.

    path: our Param path, e.g. ("layers", 1, "mlp", "w_gate"). hf: the HF tensor names, one per routed expert for
    an expert stack (our axis 0), else one. linear: an HF Linear weight [out, in], whose `in` our last `in_axes`
    axes split and `out` the rest (row-major, as HF views them: o_proj [D, H*V] -> [D, H, V]); transposed: our
    layout is [in..., out...] instead, `in` the first `in_axes` axes (kv_b_proj, the bf16 expert stacks); else
    copied as is. int4: a routed expert stored as compressed-tensors INT4.
    """

    path: tuple
    hf: tuple[str, ...]
    linear: bool
    int4: bool = False
    in_axes: int = 1
    transposed: bool = False

    @property
    def stacked(self) -> bool:
        return self.path[-1] in ("w_gate", "w_up", "w_down")

    def tensor_names(self) -> list[str]:
        return [n + s for n in self.hf for s in INT4_SUFFIXES] if self.int4 else list(self.hf)


def param_sources(cfg: ModelConfig, prefix: str = "") -> list[Source]:
    """Every param of a Transformer(cfg) with its HF tensor name(s), in the model's layer order."""
    model = prefix + "model."
    int4 = cfg.expert_quant == "int4"
    out = [Source(("embed_tokens",), (model + "embed_tokens.weight",), linear=False)]
    for i in range(cfg.num_layers):
        hf_layer, layer = f"{model}layers.{i}.", ("layers", i)

        def src(ours: tuple, theirs: str, linear: bool = True, in_axes: int = 1, transposed: bool = False):
            return Source(layer + ours, (hf_layer + theirs,), linear, in_axes=in_axes, transposed=transposed)

        out += [src(("input_layernorm", "weight"), "input_layernorm.weight", False),
                src(("post_attention_layernorm", "weight"), "post_attention_layernorm.weight", False)]
        if cfg.q_lora_rank:
            out += [src(("self_attn", "q_a_proj"), "self_attn.q_a_proj.weight"),
                    src(("self_attn", "q_a_norm", "weight"), "self_attn.q_a_layernorm.weight", False),
                    src(("self_attn", "q_b_proj"), "self_attn.q_b_proj.weight")]
        else:
            out.append(src(("self_attn", "q_proj"), "self_attn.q_proj.weight"))
        out += [src(("self_attn", "kv_a_proj"), "self_attn.kv_a_proj_with_mqa.weight"),
                src(("self_attn", "kv_a_norm", "weight"), "self_attn.kv_a_layernorm.weight", False),
                src(("self_attn", "kv_b_proj"), "self_attn.kv_b_proj.weight", transposed=True),  # [C, H, P+V]
                src(("self_attn", "o_proj"), "self_attn.o_proj.weight", in_axes=2)]  # [D, H, V]
        if i < cfg.first_k_dense:
            out += [src(("mlp", w), f"mlp.{w}.weight") for w in ("gate_proj", "up_proj", "down_proj")]
            continue
        out += [src(("mlp", "gate"), "mlp.gate.weight"),
                src(("mlp", "e_score_correction_bias"), "mlp.gate.e_score_correction_bias", False)]
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            names = tuple(f"{hf_layer}mlp.experts.{e}.{theirs}.weight" for e in range(cfg.num_experts))
            out.append(Source(layer + ("mlp", ours), names, linear=True, int4=int4, transposed=True))
        if cfg.num_shared_experts:
            out += [src(("mlp", "shared", w), f"mlp.shared_experts.{w}.weight")
                    for w in ("gate_proj", "up_proj", "down_proj")]
    out.append(Source(("norm", "weight"), (model + "norm.weight",), linear=False))
    if not cfg.tie_word_embeddings:
        out.append(Source(("lm_head",), (prefix + "lm_head.weight",), linear=True))
    return out


def hf_tensor_names(cfg: ModelConfig, prefix: str = "") -> list[str]:
    """Every tensor name an HF checkpoint of `cfg` must hold (INT4 experts: weight_packed/_scale/_shape each)."""
    return [name for s in param_sources(cfg, prefix) for name in s.tensor_names()]


def read_json(path: str, what: str = "a JSON object") -> dict:
    """The JSON object in file `path`; ValueError naming the file when it is empty, not JSON or not an object."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({'empty file' if not text.strip() else e}); "
                         f"re-download the checkpoint") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not {what}; re-download the checkpoint")
    return value


def read_hf_config(directory: str) -> ModelConfig:
    """The ModelConfig of `directory/config.json`."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist; pass cfg= to load a checkpoint without a config.json")
    hf = read_json(path, "a model config")
    try:
        return from_hf_config(legacy_rope_fields(hf), name=os.path.basename(os.path.normpath(directory)))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    except (TypeError, AttributeError, KeyError) as e:  # a field of a JSON type no check above foresaw
        raise ValueError(f"{path}: a field has a JSON type the config does not allow ({e})") from None


def text_config_fields(directory: str) -> dict:
    """The text model's fields of `directory/config.json` as written (under `text_config` for K2.5/K2.6); {} when
    there is no config.json."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        return {}
    hf = read_json(path, "a model config")
    text = hf.get("text_config", hf)
    return text if isinstance(text, dict) else {}


def legacy_rope_fields(hf: dict) -> dict:
    """Rewrite the `rope_parameters` that transformers >= 5 writes into the released checkpoints' field names.

    transformers 5 saves {"rope_parameters": {"rope_type", "rope_theta", "factor", ...}} where DeepSeek-V3 / Kimi
    config.json files have `rope_theta` + `rope_scaling`; from_hf_config reads only the latter.
    """
    if "text_config" in hf:
        return {**hf, "text_config": legacy_rope_fields(hf["text_config"])}
    params = hf.get("rope_parameters")
    if not params or hf.get("rope_scaling"):
        return hf
    if not isinstance(params, dict):
        raise ValueError(f"config field 'rope_parameters' = {params!r} must be a JSON object")
    if params.get("truncate", True) is not True:
        raise ValueError(f"config field 'rope_parameters.truncate' = {params['truncate']!r} is not supported; "
                         f"the YaRN correction range is always rounded outward (truncate = true)")
    out = {k: v for k, v in hf.items() if k != "rope_parameters"}
    out["rope_theta"] = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if params.get("rope_type", params.get("type", "default")) != "default":
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return out


def load_hf_checkpoint(directory: str, cfg: ModelConfig | None = None, *, dtype: str | None = None,
                       place: Place | None = None, progress: bool = True, keep_int4: bool = True) -> Transformer:
    """Build a Transformer from the HF safetensors in `directory`, one param at a time.

    cfg: read from config.json when None. dtype: the model dtype ("bfloat16" | "float32"); by default cfg.dtype when
    cfg is given, else the checkpoint's own (its embedding's, which config.json's torch_dtype / dtype must not
    contradict). INT4 experts stay INT4 in device memory (repacked once into the int4_moe kernel's layout, the model's
    INT4 path) unless keep_int4=False, which dequantizes them into bf16-path experts of `dtype`.
    place(path, host_array) -> jax.Array puts each param on its devices (default
    jnp.asarray; pass a function built on jax.make_array_from_callback to shard). Raises ValueError naming the tensor,
    file or config field for a missing tensor, a wrong shape, a truncated / corrupt file, a tensor of the text model
    the config does not use (another layer count, a tied lm_head that is present, ...), or a dtype config.json
    contradicts; tensors of other towers (vision) and of the declared MTP layers are skipped.
    """
    directory = os.path.abspath(directory)
    text = text_config_fields(directory)
    told_dtype = dtype or (cfg.dtype if cfg is not None else None)
    cfg = cfg or read_hf_config(directory)
    place = place or (lambda path, x: jnp.asarray(x))
    with _TensorFiles(directory) as files:
        prefix, sources, found_dtype = _check_headers(files, cfg, text)
        cfg = cfg.replace(dtype=told_dtype or found_dtype)
        resident = keep_int4 and cfg.expert_quant == "int4"
        model_cfg = cfg if resident else cfg.replace(expert_quant="bf16")
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0))), nnx.Param)
        memory.check_fits({f"{cfg.name} params": memory.tree_bytes(state)}, jax.devices(),
                          "place it over more devices (place=, --mesh) or use a machine with more memory")
        wanted = {path: (tuple(v.shape), np.dtype(v.dtype)) for path, v in nnx.to_flat_state(state)}
        expected = {p for s in sources for p in (_int4_paths(s) if resident and s.stacked else (s.path,))}
        if set(wanted) != expected:
            raise AssertionError(f"param_sources disagrees with the model: {set(wanted) ^ expected}")
        params: dict = {}
        for s in tqdm(sources, desc=f"loading {os.path.basename(directory)}", unit="param", disable=not progress):
            if resident and s.stacked:
                for path, host in zip(_int4_paths(s), _read_int4_stack(files, s, model_cfg)):
                    _nest(params, path, place(path, host.astype(wanted[path][1])))
                continue
            shape, dt = wanted[s.path]
            _nest(params, s.path, place(s.path, _read_param(files, s, shape, dt, cfg.quant_group_size)))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def check_hf_checkpoint(directory: str, cfg: ModelConfig | None = None) -> ModelConfig:
    """Everything load_hf_checkpoint checks before it reads a tensor, from config.json and the safetensors headers
    alone: every tensor the config needs is there with its shape, none of the text model's is left over, the dtype
    agrees with config.json. Returns the config (cfg, or config.json's)."""
    directory = os.path.abspath(directory)
    cfg = cfg or read_hf_config(directory)
    with _TensorFiles(directory) as files:
        _check_headers(files, cfg, text_config_fields(directory))
    return cfg


def _check_headers(files: "_TensorFiles", cfg: ModelConfig, text: dict) -> tuple[str, list[Source], str]:
    """(name prefix, sources, the checkpoint's dtype) after the header checks of check_hf_checkpoint."""
    prefix = NESTED_PREFIX if any(n.startswith(NESTED_PREFIX + "model.") for n in files.names) else ""
    sources = param_sources(cfg, prefix)
    _check_present(files, sources)
    _check_unused(files, sources, cfg, prefix, mtp_layers=text.get("num_nextn_predict_layers") or 0)
    found_dtype = _checkpoint_dtype(files, sources[0].hf[0], text)
    _check_shapes(files, sources, cfg)
    return prefix, sources, found_dtype


def _check_shapes(files: "_TensorFiles", sources: list[Source], cfg: ModelConfig) -> None:
    """Every tensor's shape as its file's header gives it, against the shape the config implies."""
    plain = cfg.replace(expert_quant="bf16")
    _, state = nnx.split(nnx.eval_shape(lambda: Transformer(plain, nnx.Rngs(0))), nnx.Param)
    ours = {path: tuple(v.shape) for path, v in nnx.to_flat_state(state)}
    for s in sources:
        shape = _hf_shape(s, ours[s.path][1:] if s.stacked else ours[s.path])
        for name in s.hf:
            if s.int4:
                out_dim, in_dim = shape
                want = {name + "_packed": (out_dim, in_dim // int4_layout.NIBBLES_PER_WORD),
                        name + "_scale": (out_dim, in_dim // cfg.quant_group_size), name + "_shape": (2,)}
            else:
                want = {name: shape}
            for tensor, expected in want.items():
                found = files.shape(tensor)
                if found != expected:
                    raise ValueError(f"tensor {tensor!r} in {files.file_of[tensor]} has shape {found}, expected "
                                     f"{expected} for this config; the checkpoint and config.json disagree")


def save_safetensors(tensors: dict, path: str) -> None:
    """safetensors.numpy.save_file, the file then readable as any file this process writes (0666 less the umask;
    the library creates it readable by the owner only)."""
    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def export_hf_checkpoint(model: Transformer, directory: str, int4: bool = False, prefix: str = "",
                         max_shard_bytes: int = 4 << 30) -> str:
    """Write `model` as an HF checkpoint: config.json + safetensors shards (+ the index when there are several).

    int4: routed experts packed in the compressed-tensors layout (quantized from the model's weights). prefix:
    NESTED_PREFIX writes the K2.5/K2.6 layout (names under `language_model.`, config under `text_config`).
    Returns the absolute directory.
    """
    if prefix not in ("", NESTED_PREFIX):
        raise ValueError(f"prefix {prefix!r} is not a known layout; use '' or {NESTED_PREFIX!r}")
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    cfg = model.cfg.replace(expert_quant="int4" if int4 else "bf16")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, nested=bool(prefix)), f, indent=2)
    params = {path: v[...] for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    shards, shard, size = [], {}, 0
    for s in param_sources(cfg, prefix):
        for name, tensor in _hf_tensors(s, np.asarray(params[s.path]), cfg.quant_group_size):
            if shard and size + tensor.nbytes > max_shard_bytes:
                shards.append(shard)
                shard, size = {}, 0
            shard[name] = np.ascontiguousarray(tensor)
            size += tensor.nbytes
    shards.append(shard)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, os.path.join(directory, file))
        weight_map.update({name: file for name in shard})
    if len(shards) > 1:
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    return directory


def hf_config_dict(cfg: ModelConfig, nested: bool = False) -> dict:
    """The config.json of `cfg` in the DeepSeek-V3 / Kimi K2 field names (`nested`: the K2.5/K2.6 wrapper)."""
    rope = None
    if cfg.rope_scaling_factor > 1.0:
        rope = {"type": "yarn", "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position,
                "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
                "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim}
    text = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2" if nested else "deepseek_v3",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads, "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.num_shared_experts, "first_k_dense_replace": cfg.first_k_dense, "moe_layer_freq": 1,
        "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
        "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id, "num_nextn_predict_layers": 0, "torch_dtype": cfg.dtype,
    }
    if cfg.expert_quant == "int4":
        text["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                "group_size": cfg.quant_group_size}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"]}
    if not nested:
        return text
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}


# ----------------------------------------------------------------------------------------------- reading

class _TensorFiles(contextlib.AbstractContextManager):
    """The tensor names of a checkpoint directory and their files, opened lazily and closed together."""

    def __init__(self, directory: str):
        self.directory = directory
        self._open: dict[str, object] = {}
        self._stack = contextlib.ExitStack()
        try:
            self.file_of = self._weight_map()
        except BaseException:
            self._stack.close()
            raise
        self.names = set(self.file_of)

    def _weight_map(self) -> dict[str, str]:
        """tensor name -> file name, from the index when there is one, else from every *.safetensors header."""
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.exists(index):
            weight_map = read_json(index, "a safetensors index").get("weight_map")
            if not (isinstance(weight_map, dict) and weight_map
                    and all(isinstance(v, str) and os.path.basename(v) == v for v in weight_map.values())):
                raise ValueError(f"{index} has no weight_map of tensor name -> file name in this directory; "
                                 f"re-download the checkpoint")
            for file in sorted(set(weight_map.values())):
                self._handle(file)  # every shard named is there with a readable header
            return dict(weight_map)
        files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(self.directory, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files and no {INDEX_FILE} in {self.directory}")
        return {name: f for f in files for name in self._handle(f).keys()}

    def read(self, name: str) -> np.ndarray:
        file = self.file_of[name]
        handle = self._handle(file)
        if name not in handle.keys():
            raise ValueError(f"tensor {name!r} is not in {os.path.join(self.directory, file)} although {INDEX_FILE} "
                             f"says so; the index and the shards disagree (re-download the checkpoint)")
        try:
            tensor = handle.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"cannot read tensor {name!r} from {os.path.join(self.directory, file)}: {e}") from None
        check_finite(tensor, f"tensor {name!r} in {os.path.join(self.directory, file)}")
        return tensor

    def shape(self, name: str) -> tuple:
        """The shape of tensor `name` from its file's header (no data read)."""
        handle = self._handle(self.file_of[name])
        if name not in handle.keys():
            raise ValueError(f"tensor {name!r} is not in {os.path.join(self.directory, self.file_of[name])} although "
                             f"{INDEX_FILE} says so; the index and the shards disagree (re-download the checkpoint)")
        return tuple(handle.get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype code of tensor `name` ("BF16", "F32", ...), from the file's header."""
        return self._handle(self.file_of[name]).get_slice(name).get_dtype()

    def _handle(self, file: str):
        if file not in self._open:
            path = os.path.join(self.directory, file)
            if not os.path.exists(path):
                raise ValueError(f"safetensors file {path} is missing (named by {INDEX_FILE})")
            try:
                self._open[file] = self._stack.enter_context(safe_open(path, framework="numpy"))
            except (SafetensorError, OSError) as e:
                raise ValueError(f"safetensors file {path} is truncated or corrupt ({e}); re-download it") from None
        return self._open[file]

    def __exit__(self, *exc):
        self._stack.close()


def check_finite(x: np.ndarray, what: str) -> None:
    """Refuse a floating-point array holding NaN or +-inf, naming `what` and where the first one is."""
    if not np.issubdtype(x.dtype, np.floating) and x.dtype.name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return
    finite = np.isfinite(x)
    if finite.all():
        return
    bad = np.argwhere(~finite)
    index = tuple(int(i) for i in bad[0])
    raise ValueError(f"{what} holds {len(bad)} non-finite value(s) ({x[index]} at {list(index)}); the checkpoint is "
                     f"corrupt: re-download or re-export it")


def _check_present(files: _TensorFiles, sources: list[Source]) -> None:
    missing = [n for s in sources for n in s.tensor_names() if n not in files.names]
    if not missing:
        return
    hint = ""
    if any(n + "_packed" in files.names for n in missing):
        hint = ("; the checkpoint holds INT4 experts (weight_packed) but the config has no compressed-tensors "
                "quantization_config: pass cfg with expert_quant='int4'")
    elif any(n.endswith("_packed") and n[:-len("_packed")] in files.names for n in missing):
        hint = "; the checkpoint holds bf16 experts but the config says INT4: pass cfg with expert_quant='bf16'"
    shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
    raise ValueError(f"checkpoint {files.directory} lacks tensors the config needs: {shown}{hint}")


def _check_unused(files: _TensorFiles, sources: list[Source], cfg: ModelConfig, prefix: str, mtp_layers: int) -> None:
    """Refuse tensors of the text model (`<prefix>model.*`, `<prefix>lm_head.weight`) that no param reads: config.json
    and the checkpoint then disagree, and loading would run another model. Skipped: other towers, the
    `mtp_layers` multi-token-prediction layers after the last layer, and rotary `inv_freq` buffers (recomputed)."""
    model, lm_head = prefix + "model.", prefix + "lm_head.weight"
    used = {n for s in sources for n in s.tensor_names()}
    mtp = tuple(f"{model}layers.{i}." for i in range(cfg.num_layers, cfg.num_layers + mtp_layers))
    unused = sorted(n for n in files.names if (n.startswith(model) or n == lm_head) and n not in used
                    and not n.startswith(mtp) and not n.endswith("rotary_emb.inv_freq"))
    if not unused:
        return
    where = f"checkpoint {files.directory}"
    if lm_head in unused and cfg.tie_word_embeddings:
        raise ValueError(f"config.json says tie_word_embeddings=true (the output layer is the embedding) but {where} "
                         f"has its own {lm_head}; set tie_word_embeddings to false in config.json")
    layers = sorted({int(m.group(1)) for n in unused if (m := re.match(re.escape(model) + r"layers\.(\d+)\.", n))
                     and int(m.group(1)) >= cfg.num_layers})
    if layers:
        raise ValueError(f"{where} has tensors of layers {layers[0]}..{layers[-1]} but config.json says "
                         f"num_hidden_layers={cfg.num_layers} (and num_nextn_predict_layers={mtp_layers} MTP layers "
                         f"after them); fix num_hidden_layers (or num_nextn_predict_layers) in config.json")
    shown = ", ".join(unused[:8]) + (f", ... ({len(unused)} in all)" if len(unused) > 8 else "")
    raise ValueError(f"{where} has tensors the config does not use: {shown}; config.json and the tensors disagree "
                     f"(q_lora_rank, first_k_dense_replace, n_shared_experts, n_routed_experts, ...): fix config.json")


SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16", "F64": "float64"}


def _checkpoint_dtype(files: _TensorFiles, name: str, text: dict) -> str:
    """The dtype the checkpoint was saved in (that of tensor `name`, the embedding), checked against config.json's
    torch_dtype / dtype fields (`text`)."""
    code = files.dtype(name)
    found = SAFETENSORS_DTYPES.get(code, code)
    for field in ("torch_dtype", "dtype"):
        if text.get(field) not in (None, found):
            raise ValueError(f"config.json says {field}={text[field]!r} but checkpoint {files.directory} holds "
                             f"{found} tensors ({name}); fix {field} in config.json, or pass dtype= to convert them")
    if found not in ("bfloat16", "float32"):
        raise ValueError(f"checkpoint {files.directory} holds {found} tensors ({name}), which the engine does not "
                         f"run; pass dtype='bfloat16' or dtype='float32' to convert them")
    return found


def _read_param(files: _TensorFiles, s: Source, shape: tuple, dtype, group: int) -> np.ndarray:
    """One of our params in our layout `shape` and `dtype`, read tensor by tensor."""
    if not s.stacked:
        return _our_layout(_read_hf(files, s.hf[0], _hf_shape(s, shape)), s, shape).astype(dtype)
    out = np.empty(shape, dtype)  # the expert stack, filled one expert at a time
    for e, name in enumerate(s.hf):
        hf_shape = _hf_shape(s, shape[1:])
        w = _read_int4(files, name, hf_shape, group) if s.int4 else _read_hf(files, name, hf_shape)
        out[e] = _our_layout(w, s, shape[1:])
    return out


def _read_hf(files: _TensorFiles, name: str, shape: tuple) -> np.ndarray:
    x = files.read(name)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} in {files.file_of[name]} has shape {tuple(x.shape)}, expected "
                         f"{tuple(shape)} for this config; the checkpoint and config.json disagree")
    return x


def _read_int4_tensors(files: _TensorFiles, name: str, shape: tuple, group: int) -> tuple[np.ndarray, np.ndarray]:
    """A compressed-tensors INT4 Linear `name` ([out, in]) as stored: (weight_packed, weight_scale)."""
    out_dim, in_dim = shape
    stored = tuple(int(v) for v in _read_hf(files, name + "_shape", (2,)))
    if stored != (out_dim, in_dim):
        raise ValueError(f"tensor {name + '_shape'!r} says {stored}, expected {(out_dim, in_dim)} for this config")
    return (_read_hf(files, name + "_packed", (out_dim, in_dim // int4_layout.NIBBLES_PER_WORD)),
            _read_hf(files, name + "_scale", (out_dim, in_dim // group)))


def _read_int4(files: _TensorFiles, name: str, shape: tuple, group: int) -> np.ndarray:
    """A compressed-tensors INT4 Linear `name` ([out, in]) dequantized to float32."""
    packed, scale = _read_int4_tensors(files, name, shape, group)
    return np.asarray(int4_layout.dequantize_int4(packed, scale, group, dtype=jnp.float32))


_INT4_PARAMS = {"w_gate": "gate", "w_up": "up", "w_down": "down"}


def _int4_paths(s: Source) -> tuple[tuple, tuple]:
    """The INT4-resident params (packed, scale) that replace the bf16 expert stack `s.path`."""
    name = _INT4_PARAMS[s.path[-1]]
    return s.path[:-1] + (f"{name}_packed",), s.path[:-1] + (f"{name}_scale",)


def _read_int4_stack(files: _TensorFiles, s: Source, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """An expert stack kept INT4: the compressed-tensors tensors of every expert, stacked one expert at a time, then
    repacked once into the int4_moe kernel's layout -> (packed, scale) host arrays."""
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    shape = (d, i) if s.path[-1] == "w_down" else (i, d)
    packed, scale = None, None
    for e, name in enumerate(s.hf):
        p, sc = _read_int4_tensors(files, name, shape, cfg.quant_group_size)
        if packed is None:
            packed = np.empty((len(s.hf),) + p.shape, np.int32)
            scale = np.empty((len(s.hf),) + sc.shape, sc.dtype)
        packed[e], scale[e] = p, sc
    return tuple(np.asarray(a) for a in repack_linear(packed, scale))


def _hf_shape(s: Source, ours: tuple) -> tuple:
    """HF shape of a tensor whose param (one expert of a stack) has our shape `ours`."""
    if not s.linear:
        return tuple(ours)
    if s.transposed:
        return math.prod(ours[s.in_axes:]), math.prod(ours[:s.in_axes])
    return math.prod(ours[:-s.in_axes]), math.prod(ours[-s.in_axes:])


def _our_layout(x: np.ndarray, s: Source, ours: tuple) -> np.ndarray:
    if not s.linear:
        return x
    return x.T.reshape(ours) if s.transposed else x.reshape(ours)


def _nest(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ----------------------------------------------------------------------------------------------- writing

def _hf_tensors(s: Source, ours: np.ndarray, group: int) -> Iterator[tuple[str, np.ndarray]]:
    """The HF tensors of one of our params (the inverse of _read_param)."""
    if not s.stacked:
        yield s.hf[0], _hf_layout(ours, s)
        return
    for name, w in zip(s.hf, ours):
        w = _hf_layout(w, s)
        if not s.int4:
            yield name, w
            continue
        q, scale = int4_layout.quantize_int4(w, group)
        yield name + "_packed", int4_layout.pack_int4(q)
        yield name + "_scale", scale.astype(jnp.bfloat16)  # already bf16-rounded
        yield name + "_shape", np.asarray(w.shape, np.int64)


def _hf_layout(x: np.ndarray, s: Source) -> np.ndarray:
    if not s.linear:
        return x
    if s.transposed:
        return x.reshape(math.prod(x.shape[:s.in_axes]), -1).T
    return x.reshape(-1, math.prod(x.shape[-s.in_axes:]))
