"""Model and drafter configuration: presets and the reader of HF `config.json` files.

Every field here changes the math of the DeepSeek-V3 / Kimi K2.x architecture; nothing else is read.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3-architecture target model (MLA attention + sigmoid-routed MoE)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None: q is projected directly from hidden (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # dense MLP (the first `first_k_dense` layers)
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    first_k_dense: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    latent_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek-V3 builds them with the default eps
    rope_scaling_factor: float = 1.0  # YaRN factor; 1.0 means plain RoPE
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    expert_quant: str = "bf16"  # "bf16" | "int4" (compressed-tensors W4A16, symmetric, group 32)
    quant_group_size: int = 32
    dtype: str = "bfloat16"  # activations and non-quantized weights
    name: str = "custom"

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                      "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size", "num_experts",
                      "num_experts_per_tok", "max_position_embeddings", "quant_group_size"):
            _check(getattr(self, field) > 0, field, getattr(self, field), "must be positive")
        _check(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", self.q_lora_rank,
               "must be positive (or None)")
        _check(self.num_shared_experts >= 0, "num_shared_experts", self.num_shared_experts, "must be >= 0")
        _check(0 <= self.first_k_dense <= self.num_layers, "first_k_dense", self.first_k_dense,
               f"must lie in [0, num_layers={self.num_layers}]")
        _check(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok", self.num_experts_per_tok,
               f"must not exceed num_experts={self.num_experts}")
        _check(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", self.qk_rope_head_dim, "must be even")
        _check(self.expert_quant in ("bf16", "int4"), "expert_quant", self.expert_quant, "use 'bf16' or 'int4'")
        _check(self.dtype in ("bfloat16", "float32"), "dtype", self.dtype, "use 'bfloat16' or 'float32'")
        if self.expert_quant == "int4":
            for field in ("hidden_size", "moe_intermediate_size"):
                value = getattr(self, field)
                _check(value % self.quant_group_size == 0, field, value,
                       f"must be a multiple of quant_group_size={self.quant_group_size} for INT4 experts")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_mscale(self) -> float:
        """mscale(factor, mscale_all_dim) of YaRN; 1.0 when YaRN is off."""
        return yarn_get_mscale(self.rope_scaling_factor, self.rope_mscale_all_dim)

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 * mscale^2 (DeepSeek-V3 attention)."""
        return self.qk_head_dim ** -0.5 * self.yarn_mscale ** 2

    @property
    def cache_bytes_per_token_per_layer(self) -> int:
        return (self.kv_lora_rank + self.qk_rope_head_dim) * (2 if self.dtype == "bfloat16" else 4)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DFlash block-diffusion drafter attached to a target (DESIGN.md section 4).

    hidden_size and vocab_size must equal the target's: the drafter shares its embedding and lm_head.
    """

    hidden_size: int
    vocab_size: int
    num_layers: int
    block_size: int  # L: the block is [bonus, MASK x (L-1)]
    target_layer_ids: tuple[int, ...]  # target layers whose outputs feed the context feature
    mask_token_id: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_kv_heads: int | None = None  # grouped-query attention: K/V heads (None: num_heads, one K/V head per query)

    def __post_init__(self):
        _check(self.block_size >= 2, "block_size", self.block_size, "must be at least 2 (bonus + one draft)")
        _check(len(self.target_layer_ids) > 0, "target_layer_ids", self.target_layer_ids, "must name a layer")
        _check(0 <= self.mask_token_id < self.vocab_size, "mask_token_id", self.mask_token_id,
               f"must be a token id below vocab_size={self.vocab_size}")
        _check(self.head_dim % 2 == 0, "head_dim", self.head_dim, "must be even (RoPE turns pairs of dims)")
        _check(self.num_heads % self.kv_heads == 0, "num_kv_heads", self.num_kv_heads,
               f"must divide num_heads={self.num_heads}")

    @property
    def kv_heads(self) -> int:
        """K/V heads per layer (num_heads unless grouped-query attention)."""
        return self.num_kv_heads or self.num_heads

    def check_fits(self, target: "ModelConfig") -> None:
        """Raise ValueError when this drafter cannot run on `target`."""
        for field in ("hidden_size", "vocab_size"):
            mine, theirs = getattr(self, field), getattr(target, field)
            if mine != theirs:
                raise ValueError(f"drafter {field}={mine} does not fit the target's {field}={theirs}; "
                                 f"use a drafter trained for this target")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ValueError(f"drafter target_layer_ids {bad} are not layers of the target "
                             f"(it has {target.num_layers}); use a drafter trained for this target")

    def replace(self, **kw) -> "DrafterConfig":
        return dataclasses.replace(self, **kw)


def yarn_get_mscale(scale: float, mscale: float) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _check(ok: bool, field: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"config field {field!r} = {value!r} {why}")


# ----------------------------------------------------------------------------------------------- presets

def kimi_k2_6() -> ModelConfig:
    """Kimi K2.6 text model (DeepSeek-V3 architecture, INT4 routed experts)."""
    return ModelConfig(
        name="kimi_k2_6", vocab_size=163840, hidden_size=7168, num_layers=61, num_heads=64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=18432, moe_intermediate_size=2048, num_experts=384, num_experts_per_tok=8,
        num_shared_experts=1, first_k_dense=1, routed_scaling_factor=2.827, norm_topk_prob=True,
        rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling_factor=64.0, rope_original_max_position=4096,
        rope_beta_fast=1.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        max_position_embeddings=262144, bos_token_id=163584, eos_token_id=163585, expert_quant="int4")


def deepseek_v3() -> ModelConfig:
    """DeepSeek-V3 (671B) with bf16 experts (the FP8 release dequantized)."""
    return ModelConfig(
        name="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=18432, moe_intermediate_size=2048, num_experts=256, num_experts_per_tok=8,
        num_shared_experts=1, first_k_dense=3, routed_scaling_factor=2.5, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling_factor=40.0, rope_original_max_position=4096,
        rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        max_position_embeddings=163840, bos_token_id=0, eos_token_id=1)


def tiny() -> ModelConfig:
    """A few layers, a few experts, Kimi-like routing and YaRN: fast on CPU, every code path exercised."""
    return ModelConfig(
        name="tiny", vocab_size=512, hidden_size=64, num_layers=3, num_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        num_shared_experts=1, first_k_dense=1, routed_scaling_factor=2.827, norm_topk_prob=True,
        rms_norm_eps=1e-5, rope_theta=50000.0, rope_scaling_factor=4.0, rope_original_max_position=64,
        rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        max_position_embeddings=1024, eos_token_id=1, dtype="float32")


def tiny_drafter(target: ModelConfig, block_size: int = 8) -> DrafterConfig:
    return DrafterConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_layers=1,
                         block_size=block_size, target_layer_ids=tuple(sorted({0, target.num_layers // 2, target.num_layers - 1})),
                         mask_token_id=target.vocab_size - 1, num_heads=4, head_dim=16,
                         intermediate_size=128, rms_norm_eps=target.rms_norm_eps)


def code_target() -> ModelConfig:
    """The project's trained target: DeepSeek-V3 architecture at ~16M params for Python source (vocab = the shipped
    tokenizer's). MLA with q_lora, sigmoid-routed MoE (16 experts of 128, top-2, one shared expert) after one dense
    layer; plain RoPE (YaRN factor 1). Trained by experiments/train_target.py at 512 tokens per window."""
    from kdtree_jax.data import DEFAULT_VOCAB_SIZE, EOS_ID
    return ModelConfig(
        name="code_target", vocab_size=DEFAULT_VOCAB_SIZE, hidden_size=256, num_layers=8, num_heads=8,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        intermediate_size=768, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=2,
        num_shared_experts=1, first_k_dense=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, eos_token_id=EOS_ID,
        dtype="bfloat16")


def code_drafter(target: ModelConfig) -> DrafterConfig:
    """The DFlash drafter of `target` (code_target): 2 layers, block 16, context from 3 layers spread through the
    target's depth (the second, the middle and the last), MASK = the shipped tokenizer's mask token."""
    from kdtree_jax.data import MASK_ID
    last = target.num_layers - 1
    return DrafterConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_layers=2, block_size=16,
                         target_layer_ids=tuple(sorted({min(1, last), target.num_layers // 2, last})),
                         mask_token_id=MASK_ID, num_heads=8, head_dim=32, intermediate_size=768,
                         rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta)


PRESETS = {"kimi_k2_6": kimi_k2_6, "deepseek_v3": deepseek_v3, "tiny": tiny, "code_target": code_target}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown config preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


# ----------------------------------------------------------------------------------------------- HF reader

_SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size",
                    "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor", "rms_norm_eps")
_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
                        "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "max_position_embeddings")


def from_hf_config(hf: Mapping[str, Any], name: str = "hf") -> ModelConfig:
    """Read a DeepSeek-V3 / Kimi K2 / Kimi K2.5-K2.6 (`text_config`-nested) `config.json` dict.

    Raises ValueError naming the field for anything this engine cannot run exactly.
    """
    _check(isinstance(hf, Mapping), "(the whole file)", type(hf).__name__, "must be a JSON object")
    outer_quant = hf.get("quantization_config")  # a nested config may keep it beside text_config
    if "text_config" in hf:
        _check(isinstance(hf["text_config"], Mapping), "text_config", hf["text_config"], "must be a JSON object")
        hf = hf["text_config"]
    _check_types(hf)
    _check(outer_quant is None or isinstance(outer_quant, Mapping), "quantization_config", outer_quant,
           "must be a JSON object")
    model_type = hf.get("model_type", "deepseek_v3")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config field 'model_type' = {model_type!r} is not supported; "
                         f"expected one of {_SUPPORTED_MODEL_TYPES}")
    missing = [field for field in _REQUIRED_FIELDS if field not in hf]
    if missing:
        raise ValueError(f"config fields {missing} are missing: not the config.json of a DeepSeek-V3 / Kimi K2.x "
                         f"text model (or a truncated one)")
    for field in _POSITIVE_INT_FIELDS:
        value = hf.get(field, 1)
        _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, field, value,
               "must be a positive integer")
    q_lora = hf.get("q_lora_rank")
    _check(q_lora is None or (isinstance(q_lora, int) and q_lora >= 1), "q_lora_rank", q_lora,
           "must be a positive integer, or null for a direct q projection")
    for field in ("routed_scaling_factor", "rms_norm_eps", "rope_theta"):
        value = hf.get(field, 1.0)
        _check(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, field, value,
               "must be a positive number")
    scoring = hf.get("scoring_func", "sigmoid")
    _check(scoring == "sigmoid", "scoring_func", scoring, "is not supported; only 'sigmoid' routing is implemented")
    method = hf.get("topk_method", "noaux_tc")
    _check(method == "noaux_tc", "topk_method", method, "is not supported; only 'noaux_tc' is implemented")
    n_group, topk_group = hf.get("n_group", 1), hf.get("topk_group", 1)
    _check(n_group == 1 or topk_group == n_group, "n_group", n_group,
           f"with topk_group={topk_group} needs group-limited routing, which is not implemented (use n_group=1)")
    mtp = hf.get("num_nextn_predict_layers", 0)
    _check(mtp in (0, 1), "num_nextn_predict_layers", mtp, "is not supported (0 or 1; MTP layers are ignored)")
    _check(hf.get("hidden_act", "silu") == "silu", "hidden_act", hf.get("hidden_act"), "must be 'silu'")
    _check(not hf.get("attention_bias", False), "attention_bias", hf.get("attention_bias"), "must be false")
    freq = hf.get("moe_layer_freq", 1)
    _check(freq == 1, "moe_layer_freq", freq, "must be 1")

    rope = hf.get("rope_scaling") or {}
    rope_type = rope.get("type", rope.get("rope_type", "yarn")) if rope else None
    _check(rope_type in (None, "yarn"), "rope_scaling.type", rope_type, "is not supported; only YaRN is implemented")
    quant = _expert_quant(hf.get("quantization_config") or outer_quant)
    for field in ("bos_token_id", "eos_token_id"):
        ids = hf.get(field)
        ids = ids if isinstance(ids, list) else [] if ids is None else [ids]
        _check(all(0 <= i < hf["vocab_size"] for i in ids), field, hf.get(field),
               f"must name tokens below vocab_size={hf['vocab_size']}")
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    return ModelConfig(
        name=name,
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"], intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["moe_intermediate_size"], num_experts=hf["n_routed_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"], num_shared_experts=hf.get("n_shared_experts", 1) or 0,
        first_k_dense=hf.get("first_k_dense_replace", 0), routed_scaling_factor=float(hf["routed_scaling_factor"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), rms_norm_eps=float(hf["rms_norm_eps"]),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rope_scaling_factor=float(rope.get("factor", 1.0)) if rope else 1.0,
        rope_original_max_position=int(rope.get("original_max_position_embeddings",
                                                hf.get("max_position_embeddings", 4096))) if rope else 4096,
        rope_beta_fast=float(rope.get("beta_fast", 32.0)) if rope else 32.0,
        rope_beta_slow=float(rope.get("beta_slow", 1.0)) if rope else 1.0,
        rope_mscale=float(rope.get("mscale", 1.0)) if rope else 1.0,
        rope_mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)) if rope else 0.0,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=eos, expert_quant=quant)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_token_ids(v) -> bool:
    return v is None or _is_int(v) or (isinstance(v, list) and len(v) > 0 and all(_is_int(i) for i in v))


# The JSON type of every field from_hf_config reads besides the positive integers (checked with their values).
_FIELD_TYPES = {
    "model_type": (lambda v: isinstance(v, str), "a string"),
    "q_lora_rank": (lambda v: v is None or _is_int(v), "an integer or null"),
    "n_shared_experts": (lambda v: v is None or _is_int(v), "an integer or null"),
    "first_k_dense_replace": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "n_group": (_is_int, "an integer"), "topk_group": (_is_int, "an integer"),
    "num_nextn_predict_layers": (lambda v: v is None or _is_int(v), "an integer"),
    "moe_layer_freq": (_is_int, "an integer"),
    "norm_topk_prob": (lambda v: isinstance(v, bool), "true or false"),
    "tie_word_embeddings": (lambda v: isinstance(v, bool), "true or false"),
    "attention_bias": (lambda v: isinstance(v, bool), "true or false"),
    "scoring_func": (lambda v: isinstance(v, str), "a string"), "topk_method": (lambda v: isinstance(v, str), "a string"),
    "hidden_act": (lambda v: isinstance(v, str), "a string"),
    "bos_token_id": (_is_token_ids, "a token id, a non-empty list of them, or null"),
    "eos_token_id": (_is_token_ids, "a token id, a non-empty list of them, or null"),
    "rope_scaling": (lambda v: v is None or (isinstance(v, Mapping) and all(
        _is_number(x) for k, x in v.items() if k not in ("type", "rope_type"))), "null or an object of numbers"),
    "quantization_config": (lambda v: v is None or isinstance(v, Mapping), "an object or null"),
}


def _check_types(hf: Mapping[str, Any]) -> None:
    for field, (ok, kind) in _FIELD_TYPES.items():
        if field in hf:
            _check(ok(hf[field]), field, hf[field], f"must be {kind}")
    rope = hf.get("rope_scaling") or {}
    for field in ("type", "rope_type"):
        _check(isinstance(rope.get(field, ""), str), f"rope_scaling.{field}", rope.get(field), "must be a string")


def _expert_quant(qc: Mapping[str, Any] | None) -> str:
    """'int4' for a compressed-tensors pack-quantized W4A16 group-32 symmetric config, 'bf16' when absent."""
    if not qc:
        return "bf16"
    fmt = qc.get("format", qc.get("quant_method"))
    _check(fmt in ("pack-quantized", "compressed-tensors"), "quantization_config.format", fmt,
           "is not supported; only compressed-tensors 'pack-quantized' INT4 is implemented")
    groups = qc.get("config_groups", {})
    _check(isinstance(groups, Mapping) and all(isinstance(g, Mapping) and isinstance(g.get("weights", {}), Mapping)
                                               for g in groups.values()),
           "quantization_config.config_groups", groups, "must be an object of {\"weights\": {...}} groups")
    for group in groups.values():
        w = group.get("weights", {})
        _check(w.get("num_bits") == 4, "quantization_config.weights.num_bits", w.get("num_bits"), "must be 4")
        _check(w.get("symmetric", True), "quantization_config.weights.symmetric", w.get("symmetric"), "must be true")
        _check(w.get("group_size") == 32, "quantization_config.weights.group_size", w.get("group_size"), "must be 32")
    return "int4"
