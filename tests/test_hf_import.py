"""HF config reading and the safetensors importer/exporter on synthetic tiny checkpoints."""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from conftest import causal_logits, rel_err
from kdtree_jax import config, hf_import
from pallas_kernels import int4_layout
from kdtree_jax.model.transformer import Transformer

YARN_K2 = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
K2_6_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384, "routed_scaling_factor": 2.827,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": YARN_K2,
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163585,
    "num_nextn_predict_layers": 0, "use_cache": True, "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
            "dynamic": False, "actorder": None, "observer": "minmax"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"]},
}
K2_6 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": K2_6_TEXT,
        "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27}, "media_placeholder_token_id": 163605}
DEEPSEEK_V3 = {  # the FP8 release's config.json
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "rope_scaling": {**YARN_K2, "factor": 40, "beta_fast": 32}, "attention_bias": False,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
# What the engine runs: experts dequantized to bf16 and all 8 expert groups eligible (topk_group = n_group).
DEEPSEEK_V3_BF16 = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"} | {"topk_group": 8}


def test_kimi_k2_6_config():
    assert config.from_hf_config(K2_6, name="kimi_k2_6") == config.kimi_k2_6()


def test_deepseek_v3_config():
    assert config.from_hf_config(DEEPSEEK_V3_BF16, name="deepseek_v3") == config.deepseek_v3()
    with pytest.raises(ValueError, match="n_group"):
        config.from_hf_config(DEEPSEEK_V3)


@pytest.mark.parametrize("change, field", [
    ({"rope_scaling": {**YARN_K2, "type": "linear"}}, "rope_scaling.type"), ({"scoring_func": "softmax"}, "scoring_func"),
    ({"num_nextn_predict_layers": 3}, "num_nextn_predict_layers"), ({"n_group": 8, "topk_group": 4}, "n_group")])
def test_bad_config_fields_raise(change, field):
    with pytest.raises(ValueError, match=re.escape(f"config field '{field}'")):
        config.from_hf_config({**K2_6, "text_config": {**K2_6_TEXT, **change}})


def test_hf_config_dict_round_trips():
    cfg = config.kimi_k2_6()
    for nested in (False, True):
        assert config.from_hf_config(hf_import.hf_config_dict(cfg, nested), name=cfg.name) == cfg


def test_tensor_names():
    cfg = config.tiny()
    names = hf_import.hf_tensor_names(cfg)
    assert len(names) == len(set(names))
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names and "lm_head.weight" in names
    int4 = hf_import.hf_tensor_names(cfg.replace(expert_quant="int4"), prefix="language_model.")
    assert "language_model.model.layers.1.mlp.experts.0.up_proj.weight_packed" in int4
    assert "language_model.model.layers.1.mlp.experts.0.up_proj.weight_shape" in int4
    assert "language_model.model.layers.1.mlp.experts.0.up_proj.weight" not in int4
    assert "language_model.model.layers.1.mlp.shared_experts.up_proj.weight" in int4
    assert len(int4) == len(names) + 2 * 3 * cfg.num_experts * (cfg.num_layers - cfg.first_k_dense)
    no_lora = hf_import.hf_tensor_names(cfg.replace(q_lora_rank=None))
    assert "model.layers.0.self_attn.q_proj.weight" in no_lora and not any("q_a_" in n for n in no_lora)


@pytest.fixture(scope="module")
def model():
    return Transformer(config.tiny(), nnx.Rngs(5))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(7), (2, 9), 0, config.tiny().vocab_size)


def _params(m):
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


def test_hf_layouts(tmp_path, model):
    """Exported tensors follow HF's [out, in] Linear layout with heads major in `out` (or `in` for o_proj)."""
    cfg = model.cfg
    h, p, r, v, d = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.hidden_size
    directory = hf_import.export_hf_checkpoint(model, tmp_path / "hf")
    with safe_open(os.path.join(directory, "model.safetensors"), framework="numpy") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}
    attn, moe = model.layers[1].self_attn, model.layers[1].mlp
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    expected = [  # ours = f(HF), written per tensor from HF's view of it
        (a + "q_b_proj.weight", attn.q_b_proj, lambda w: w.reshape(h, p + r, -1)),
        (a + "kv_b_proj.weight", attn.kv_b_proj, lambda w: w.reshape(h, p + v, -1).transpose(2, 0, 1)),
        (a + "o_proj.weight", attn.o_proj, lambda w: w.reshape(d, h, v)),
        (a + "kv_a_proj_with_mqa.weight", attn.kv_a_proj, lambda w: w),
        (m + "gate.weight", moe.gate, lambda w: w),
        (m + "experts.5.gate_proj.weight", moe.w_gate, lambda w: np.stack([w.T])),
        (m + "experts.5.down_proj.weight", moe.w_down, lambda w: np.stack([w.T])),
        ("lm_head.weight", model.lm_head, lambda w: w),
        ("model.embed_tokens.weight", model.embed_tokens, lambda w: w),
    ]
    for name, param, ours_from_hf in expected:
        ours = np.asarray(param[...])
        ours = ours[5:6] if "experts.5" in name else ours
        np.testing.assert_array_equal(ours_from_hf(hf[name]), ours, err_msg=name)


@pytest.mark.parametrize("prefix", ["", "language_model."])
def test_bf16_experts_round_trip(tmp_path, model, tokens, prefix):
    directory = hf_import.export_hf_checkpoint(model, tmp_path / "hf", prefix=prefix, max_shard_bytes=100_000)
    assert os.path.exists(os.path.join(directory, hf_import.INDEX_FILE))  # several shards
    loaded = hf_import.load_hf_checkpoint(directory, dtype="float32", progress=False)
    assert loaded.cfg.replace(name="tiny") == model.cfg
    _assert_same_params(loaded, model)
    assert rel_err(causal_logits(loaded, tokens), causal_logits(model, tokens)) == 0.0


def test_int4_experts_load_as_their_dequantized_values(tmp_path, model, tokens):
    directory = hf_import.export_hf_checkpoint(model, tmp_path / "hf", int4=True, prefix="language_model.")
    with open(os.path.join(directory, "config.json")) as f:
        assert config.from_hf_config(json.load(f)).expert_quant == "int4"
    resident = hf_import.load_hf_checkpoint(directory, dtype="float32", progress=False)
    assert resident.cfg.expert_quant == "int4"  # the experts stay INT4 in device memory
    loaded = hf_import.load_hf_checkpoint(directory, dtype="float32", progress=False, keep_int4=False)
    assert loaded.cfg.expert_quant == "bf16"
    assert rel_err(causal_logits(resident, tokens), causal_logits(loaded, tokens)) < 1e-5

    expected = Transformer(model.cfg, nnx.Rngs(0))
    nnx.update(expected, nnx.state(model, nnx.Param))
    for layer in expected.layers[model.cfg.first_k_dense:]:
        for w in (layer.mlp.w_gate, layer.mlp.w_up, layer.mlp.w_down):
            hf = jnp.swapaxes(w[...], 1, 2)  # [E, out, in], grouped along in
            q, scale = int4_layout.quantize_int4(hf)
            w[...] = jnp.swapaxes(int4_layout.dequantize_int4(int4_layout.pack_int4(q), scale, dtype=jnp.float32), 1, 2)
    _assert_same_params(loaded, expected)
    assert 0.0 < rel_err(expected.layers[1].mlp.w_up[...], model.layers[1].mlp.w_up[...]) < 0.2
    assert rel_err(causal_logits(loaded, tokens), causal_logits(expected, tokens)) == 0.0


def test_bf16_model_without_index_and_foreign_tensors(tmp_path):
    cfg = config.tiny().replace(dtype="bfloat16", q_lora_rank=None, num_layers=2)
    model = Transformer(cfg, nnx.Rngs(3))
    directory = hf_import.export_hf_checkpoint(model, tmp_path / "hf", prefix="language_model.")
    save_file({"vision_tower.patch_embed.weight": np.ones((4, 4), np.float32),
               "language_model.model.layers.2.mlp.gate.weight": np.ones((8, 64), np.float32)},  # an MTP layer
              os.path.join(directory, "extra.safetensors"))
    _edit_config(directory, num_nextn_predict_layers=1)
    assert not os.path.exists(os.path.join(directory, hf_import.INDEX_FILE))
    loaded = hf_import.load_hf_checkpoint(directory, progress=False)  # config.json: bfloat16, no q_lora
    assert loaded.cfg.q_lora_rank is None and loaded.cfg.dtype == "bfloat16"
    _assert_same_params(loaded, model)


def test_sharded_placement_hook(tmp_path, model):
    directory = hf_import.export_hf_checkpoint(model, tmp_path / "hf")
    seen = []

    def place(path, host):
        seen.append((path, host.shape))
        return jax.make_array_from_callback(host.shape, jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                                            lambda index: host[index])

    loaded = hf_import.load_hf_checkpoint(directory, model.cfg, place=place, progress=False)
    assert (("layers", 1, "mlp", "w_down"), (8, 32, 64)) in seen
    assert len(seen) == len(_params(model))
    _assert_same_params(loaded, model)


# ----------------------------------------------------------------------------------------------- broken files

def _edit_config(directory, drop=(), **changes):
    """Change (or `drop`) fields of the text model in directory/config.json."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        hf = json.load(f)
    text = hf.get("text_config", hf)
    text.update(changes)
    for field in drop:
        del text[field]
    with open(path, "w") as f:
        json.dump(hf, f)

def _rewrite(path, change):
    with safe_open(path, framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, path)


@pytest.fixture
def exported(tmp_path, model):
    return hf_import.export_hf_checkpoint(model, tmp_path / "hf")


def test_missing_tensor_is_named(exported):
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    _rewrite(os.path.join(exported, "model.safetensors"), lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"lacks tensors the config needs: {name}"):
        hf_import.load_hf_checkpoint(exported, dtype="float32", progress=False)


def test_wrong_shape_is_named(exported):
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    _rewrite(os.path.join(exported, "model.safetensors"), lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(ValueError, match=rf"tensor '{name}' in model.safetensors has shape \(127, 32\), "
                                         rf"expected \(128, 32\)"):
        hf_import.load_hf_checkpoint(exported, dtype="float32", progress=False)


def test_truncated_file_is_named(exported):
    path = os.path.join(exported, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:-100])
    with pytest.raises(ValueError, match=f"safetensors file {path} is truncated or corrupt"):
        hf_import.load_hf_checkpoint(exported, progress=False)


def test_truncated_shard_behind_an_index_is_named(tmp_path, model):
    directory = hf_import.export_hf_checkpoint(model, tmp_path / "hf", max_shard_bytes=100_000)
    with open(os.path.join(directory, hf_import.INDEX_FILE)) as f:
        shard = os.path.join(directory, json.load(f)["weight_map"]["model.layers.2.mlp.experts.0.up_proj.weight"])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(ValueError, match=f"safetensors file {shard} is truncated or corrupt"):
        hf_import.load_hf_checkpoint(directory, dtype="float32", progress=False)


def test_int4_checkpoint_with_a_bf16_config_says_so(tmp_path, model):
    directory = hf_import.export_hf_checkpoint(model, tmp_path / "hf", int4=True)
    with pytest.raises(ValueError, match="holds INT4 experts"):
        hf_import.load_hf_checkpoint(directory, model.cfg, progress=False)


def test_transformers5_rope_parameters_are_read():
    text = {k: v for k, v in K2_6_TEXT.items() if k not in ("rope_scaling", "rope_theta")}
    text["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 50000.0,
                               **{k: v for k, v in YARN_K2.items() if k != "type"}}
    hf = hf_import.legacy_rope_fields({**K2_6, "text_config": text})
    assert config.from_hf_config(hf, name="kimi_k2_6") == config.kimi_k2_6()
    plain = hf_import.legacy_rope_fields({**text, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert config.from_hf_config(plain).rope_scaling_factor == 1.0 and config.from_hf_config(plain).rope_theta == 1e4
    with pytest.raises(ValueError, match="truncate"):
        hf_import.legacy_rope_fields({**text, "rope_parameters": {**text["rope_parameters"], "truncate": False}})


# ----------------------------------------------------------------------------------------------- config vs tensors

def test_layers_the_config_does_not_count_are_refused(exported):
    _edit_config(exported, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"has tensors of layers 2..2 but config.json says num_hidden_layers=2 \(and "
                                         r"num_nextn_predict_layers=0 MTP layers after them\); fix num_hidden_layers"):
        hf_import.load_hf_checkpoint(exported, progress=False)


def test_tied_embeddings_with_an_lm_head_are_refused(exported):
    _edit_config(exported, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"tie_word_embeddings=true .* has its own lm_head.weight; set "
                                         r"tie_word_embeddings to false"):
        hf_import.load_hf_checkpoint(exported, progress=False)


def test_other_unused_tensors_are_named(exported):
    _edit_config(exported, n_shared_experts=0)
    with pytest.raises(ValueError, match=r"has tensors the config does not use: "
                                         r"model.layers.1.mlp.shared_experts.down_proj.weight, .*"
                                         r"model.layers.2.mlp.shared_experts.up_proj.weight; config.json and the "
                                         r"tensors disagree"):
        hf_import.load_hf_checkpoint(exported, progress=False)


def test_the_checkpoint_dtype_is_honoured(exported):
    """The exported tiny model is float32 (config.json: torch_dtype float32): it loads as float32 unless told."""
    assert hf_import.load_hf_checkpoint(exported, progress=False).cfg.dtype == "float32"
    _edit_config(exported, drop=("torch_dtype",))
    loaded = hf_import.load_hf_checkpoint(exported, progress=False)  # no field: the tensors' dtype
    assert loaded.cfg.dtype == "float32" and loaded.layers[0].self_attn.kv_b_proj[...].dtype == jnp.float32
    assert hf_import.load_hf_checkpoint(exported, dtype="bfloat16", progress=False).cfg.dtype == "bfloat16"
    _edit_config(exported, torch_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"config.json says torch_dtype='bfloat16' but checkpoint .* holds float32 "
                                         r"tensors \(model.embed_tokens.weight\); fix torch_dtype"):
        hf_import.load_hf_checkpoint(exported, progress=False)


@pytest.mark.parametrize("change, drop, message", [
    ({}, ("kv_lora_rank",), r"config fields \['kv_lora_rank'\] are missing"),
    ({"num_attention_heads": 0}, (), r"config field 'num_attention_heads' = 0 must be a positive integer"),
    ({"q_lora_rank": -4}, (), r"config field 'q_lora_rank' = -4 must be a positive integer, or null"),
    ({"rms_norm_eps": 0.0}, (), r"config field 'rms_norm_eps' = 0.0 must be a positive number"),
])
def test_missing_and_invalid_config_fields_are_named(exported, change, drop, message):
    _edit_config(exported, drop=drop, **change)
    with pytest.raises(ValueError, match=re.escape(os.path.join(exported, "config.json")) + ": " + message):
        hf_import.load_hf_checkpoint(exported, progress=False)
