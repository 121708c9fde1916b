"""Orbax round trips of the target and the drafter; restoring into a different config fails loudly."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import causal_logits
from kdtree_jax import checkpoint, config
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer


@pytest.fixture(scope="module")
def target():
    return Transformer(config.tiny(), nnx.Rngs(1))


def _params(model):
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def _abstract(cfg):
    return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))


def test_target_round_trip(tmp_path, target):
    path = checkpoint.save(tmp_path / "t", target, step=3)
    assert checkpoint.read_meta(path) == {"kind": "target", "config": dataclasses.asdict(target.cfg),
                                          "dense_layout": checkpoint.DENSE_LAYOUT}
    restored = checkpoint.restore_target(path)
    assert restored.cfg == target.cfg
    _assert_same_params(restored, target)
    tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, target.cfg.vocab_size)
    np.testing.assert_array_equal(causal_logits(restored, tokens), causal_logits(target, tokens))


def test_bf16_params_keep_their_dtype(tmp_path, target):
    cfg = target.cfg.replace(dtype="bfloat16")
    graphdef, state = nnx.split(_abstract(cfg), nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x, a: x.astype(a.dtype),
                                                 nnx.to_pure_dict(nnx.state(target, nnx.Param)),
                                                 nnx.to_pure_dict(state)))
    model = nnx.merge(graphdef, state)
    checkpoint.save(tmp_path / "b", model)
    restored = checkpoint.restore_target(tmp_path / "b")
    assert restored.layers[1].mlp.w_gate[...].dtype == jnp.bfloat16
    assert restored.layers[1].mlp.gate[...].dtype == jnp.float32  # the router stays f32
    _assert_same_params(restored, model)


def test_drafter_round_trip(tmp_path, target):
    dcfg = config.tiny_drafter(target.cfg)
    drafter = Drafter(dcfg, target.cfg, nnx.Rngs(3))
    checkpoint.save(tmp_path / "d", drafter)
    restored = checkpoint.restore_drafter(tmp_path / "d", target.cfg)
    assert restored.cfg == dcfg
    _assert_same_params(restored, drafter)

    s, t, d = 2, 6, target.cfg.hidden_size
    keys = jax.random.split(jax.random.key(1), len(dcfg.target_layer_ids) + 1)
    hidden = tuple(jax.random.normal(k, (s, t, d)) for k in keys[1:])
    positions = jnp.broadcast_to(jnp.arange(t), (s, t))
    bonus = jax.random.randint(keys[0], (s,), 0, target.cfg.vocab_size)

    def drafts(dr):
        cache = dr.extend_cache(dr.init_cache(s, 16), hidden, positions, jnp.zeros((s,), jnp.int32))
        return dr.draft(target.embed, target.logits, bonus, jnp.full((s,), t), cache, jnp.full((s,), t))

    np.testing.assert_array_equal(drafts(restored), drafts(drafter))


def test_restore_params_into_existing_model(tmp_path, target):
    checkpoint.save(tmp_path / "t", target)
    other = Transformer(target.cfg, nnx.Rngs(99))
    assert checkpoint.restore_params_into(tmp_path / "t", other) is other
    _assert_same_params(other, target)


def test_restore_into_a_different_config_names_the_shapes(tmp_path, target):
    checkpoint.save(tmp_path / "t", target)
    with pytest.raises(ValueError) as e:
        checkpoint.restore_params_into(tmp_path / "t", _abstract(target.cfg.replace(moe_intermediate_size=16)))
    msg = str(e.value)
    assert "layers/1/mlp/w_gate: checkpoint (8, 64, 32) vs model (8, 64, 16)" in msg
    assert "layers/2/mlp/shared/down_proj: checkpoint (64, 32) vs model (64, 16)" in msg
    assert "layers/1/self_attn" not in msg

    with pytest.raises(ValueError, match=r"layers/2/input_layernorm/weight: not in the model \(checkpoint \(64,\)\)"):
        checkpoint.restore_params_into(tmp_path / "t", _abstract(target.cfg.replace(num_layers=2)))
    with pytest.raises(ValueError, match=r"layers/0/self_attn/q_proj: missing from the checkpoint"):
        checkpoint.restore_params_into(tmp_path / "t", _abstract(target.cfg.replace(q_lora_rank=None)))


def test_wrong_kind_and_missing_checkpoint(tmp_path, target):
    checkpoint.save(tmp_path / "t", target)
    with pytest.raises(ValueError, match="holds a 'target' model, not a 'drafter'"):
        checkpoint.restore_drafter(tmp_path / "t", target.cfg)
    with pytest.raises(ValueError, match="no checkpoint found"):
        checkpoint.restore_target(tmp_path / "empty")
    with pytest.raises(ValueError, match="has no step 5"):
        checkpoint.restore_target(tmp_path / "t", step=5)


def test_restore_with_explicit_shardings(tmp_path, target):
    checkpoint.save(tmp_path / "t", target)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
    restored = checkpoint.restore_target(tmp_path / "t", shardings=lambda path, shape: device)
    for _, v in nnx.to_flat_state(nnx.state(restored, nnx.Param)):
        assert v[...].sharding == device
    _assert_same_params(restored, target)


def _largest_data_file(step_dir):
    files = [os.path.join(root, f) for root, _, fs in os.walk(os.path.join(step_dir, "params")) for f in fs
             if os.sep + "d" + os.sep in os.path.join(root, f)]
    return max(files, key=os.path.getsize)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _overwrite_start(path):
    with open(path, "r+b") as f:
        f.write(b"\0" * 64)


@pytest.mark.parametrize("damage, names", [
    (lambda step: _truncate(_largest_data_file(step)), r"params/.*/d/\w+ has \d+ bytes, \d+ when saved"),
    (lambda step: os.remove(_largest_data_file(step)), r"params/.*/d/\w+ is missing"),
    (lambda step: os.remove(os.path.join(step, "params", "_METADATA")), r"params/_METADATA is missing"),
    (lambda step: os.remove(os.path.join(step, "meta", "metadata")), r"meta/metadata is missing"),
    (lambda step: _overwrite_start(_largest_data_file(step)), r"reading it failed \(.*Error reading"),
], ids=["truncated", "deleted", "metadata_deleted", "meta_deleted", "overwritten"])
def test_a_corrupt_checkpoint_is_reported_as_corrupt(tmp_path, target, damage, names):
    """One line naming the checkpoint, the damaged file (or the reader's reason) and the fix, never a TensorStore
    dump or a config mismatch."""
    path = checkpoint.save(tmp_path / "t", target)
    damage(os.path.join(path, "0"))
    with pytest.raises(ValueError, match=rf"checkpoint {path} step 0 is corrupt: .*{names}.*; copy the checkpoint "
                                         rf"again or save it again") as e:
        checkpoint.restore_target(path)
    assert "\n" not in str(e.value)


def test_int4_target_records_its_nibble_encoding(tmp_path):
    """An INT4 target's meta names its nibbles' encoding; a checkpoint without it (saved when the nibbles held q + 8)
    is refused with the fix, not read as other values."""
    model = Transformer(config.tiny().replace(expert_quant="int4"), nnx.Rngs(2))
    path = checkpoint.save(tmp_path / "int4", model)
    assert checkpoint.read_meta(path)["int4_nibbles"] == "twos_complement"
    _assert_same_params(checkpoint.restore_target(path), model)
    step_dir = os.path.join(path, "0")
    meta_file = os.path.join(step_dir, "meta", "metadata")
    with open(meta_file) as f:
        meta = json.load(f)
    del meta["int4_nibbles"]
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    sizes_file = os.path.join(step_dir, checkpoint.FILE_SIZES)
    with open(sizes_file) as f:
        sizes = json.load(f)
    sizes[os.path.join("meta", "metadata")] = os.path.getsize(meta_file)
    with open(sizes_file, "w") as f:
        json.dump(sizes, f)
    with pytest.raises(ValueError, match="q \\+ 8.*re-import"):
        checkpoint.restore_target(path)
    with pytest.raises(ValueError, match="q \\+ 8"):
        checkpoint.restore_params_into(path, model)


def _in_out(path: tuple, x):
    """`checkpoint.to_out_in`'s inverse: a param in the layout checkpoints had before they stored [out..., in]."""
    if path[-1] == "o_proj":
        return jnp.moveaxis(x, 0, -1)
    return jnp.moveaxis(x, -1, 0) if path[-1] in checkpoint._INPUT_FIRST else x


@pytest.mark.parametrize("kind", ["target", "drafter"])
def test_a_checkpoint_of_the_old_layout_is_refused_then_upgraded(tmp_path, target, kind):
    """A checkpoint written with the dense weights [in, out...] (no "dense_layout" in its meta) is refused with the
    command that converts it; `upgrade` writes one that restores to the same model."""
    model = target if kind == "target" else Drafter(config.tiny_drafter(target.cfg), target.cfg, nnx.Rngs(2))
    saved = checkpoint.save(tmp_path / "new", model)
    meta = checkpoint.read_meta(saved)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    old_params = jax.tree_util.tree_map_with_path(lambda p, x: _in_out(checkpoint._keys(p), x), params)
    assert any(a.shape != b.shape for a, b in zip(jax.tree.leaves(old_params), jax.tree.leaves(params)))
    old = checkpoint._write(tmp_path / "old", old_params, {k: v for k, v in meta.items() if k != "dense_layout"}, 0)
    restore = ((lambda d: checkpoint.restore_target(d)) if kind == "target"
               else (lambda d: checkpoint.restore_drafter(d, target.cfg)))
    with pytest.raises(ValueError, match=r"stores its dense weights as 'in_out' .* python -m kdtree_jax.checkpoint "):
        restore(old)
    _assert_same_params(restore(checkpoint.upgrade(old, tmp_path / "upgraded")), model)
    with pytest.raises(ValueError, match="there is nothing to convert"):
        checkpoint.upgrade(saved, tmp_path / "again")
