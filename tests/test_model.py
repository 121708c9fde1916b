"""The target model: absorbed == naive MLA, cached decode == full forward, router semantics, ragged batches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdtree_jax import config as config_lib
from kdtree_jax.cache import init_cache
from kdtree_jax.decode import DecodeSpec, Decoder
from kdtree_jax.model.moe import route
from kdtree_jax.model.transformer import Transformer
from pallas_kernels import ops
from conftest import rel_err



def causal(s, t):
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (s, t, t))


def randomize_biases(model: Transformer, seed: int):
    """Non-zero router correction biases, so that selection differs from the unbiased ranking."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if hasattr(layer.mlp, "e_score_correction_bias"):
            layer.mlp.e_score_correction_bias[...] = jnp.asarray(rng.normal(0, 0.5, layer.mlp.e_score_correction_bias.shape),
                                                                 jnp.float32)


@pytest.fixture(scope="module")
def tiny_model():
    cfg = config_lib.tiny()
    assert cfg.rope_scaling_factor > 1, "the tiny preset must exercise YaRN"
    model = Transformer(cfg, nnx.Rngs(0))
    randomize_biases(model, 0)
    return model


@pytest.mark.parametrize("prefix", [0, 5])
def test_absorbed_equals_naive(tiny_model, prefix):
    cfg, s, t, n = tiny_model.cfg, 2, 6, 24
    key = jax.random.key(prefix + 1)
    cache = init_cache(cfg, s, n)
    if prefix:
        toks = jax.random.randint(key, (s, prefix), 0, cfg.vocab_size)
        pos = jnp.broadcast_to(jnp.arange(prefix), (s, prefix))
        cache = tiny_model(toks, pos, cache, causal(s, prefix)).cache._replace(
            length=jnp.full((s,), prefix, jnp.int32))
    toks = jax.random.randint(jax.random.fold_in(key, 1), (s, t), 0, cfg.vocab_size)
    pos = prefix + jnp.broadcast_to(jnp.arange(t), (s, t))
    absorbed = tiny_model(toks, pos, cache, causal(s, t), absorbed=True).logits
    naive = tiny_model(toks, pos, cache, causal(s, t), absorbed=False).logits
    assert rel_err(absorbed, naive) < 1e-5


def test_cached_decode_matches_full_forward(tiny_model):
    cfg, s, prompt, steps = tiny_model.cfg, 2, 5, 6
    total = prompt + steps
    toks = jax.random.randint(jax.random.key(7), (s, total), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(total), (s, total))
    full = tiny_model(toks, pos, init_cache(cfg, s, 32), causal(s, total), absorbed=False).logits

    out = tiny_model(toks[:, :prompt], pos[:, :prompt], init_cache(cfg, s, 32), causal(s, prompt))
    cache, logits = out.cache._replace(length=jnp.full((s,), prompt, jnp.int32)), [out.logits]
    for i in range(prompt, total):
        out = tiny_model(toks[:, i:i + 1], pos[:, i:i + 1], cache, causal(s, 1))
        cache = out.cache._replace(length=cache.length + 1)
        logits.append(out.logits)
    assert rel_err(jnp.concatenate(logits, axis=1), full) < 1e-5


def test_router_matches_numpy_loop():
    cfg = config_lib.tiny().replace(num_experts=16, num_experts_per_tok=4)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(9, cfg.hidden_size)).astype(np.float32)
    w = rng.normal(size=(cfg.num_experts, cfg.hidden_size)).astype(np.float32) * 0.2
    bias = rng.normal(size=(cfg.num_experts,)).astype(np.float32)
    ids, weights = route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), cfg)
    k, bias_changed_selection = cfg.num_experts_per_tok, False
    for m in range(x.shape[0]):
        scores = 1.0 / (1.0 + np.exp(-(w @ x[m].astype(np.float64))))
        chosen = np.argsort(-(scores + bias), kind="stable")[:k]
        expect = scores[chosen] / scores[chosen].sum() * cfg.routed_scaling_factor
        got = dict(zip(np.asarray(ids[m]).tolist(), np.asarray(weights[m]).tolist()))
        assert sorted(got) == sorted(chosen.tolist())
        np.testing.assert_allclose([got[e] for e in chosen], expect, rtol=1e-5)
        bias_changed_selection |= set(chosen) != set(np.argsort(-scores)[:k])
    assert bias_changed_selection, "the test needs a bias that changes some selection"


def test_ragged_batch_decodes_like_each_stream_alone(tiny_model):
    decoder = Decoder(tiny_model)
    prompts = [[5, 9, 14, 3, 8, 1, 7], [11, 2], [4, 4, 4, 4]]
    spec = DecodeSpec(policy="ar", max_new_tokens=12)
    together = decoder.generate(prompts, spec).tokens
    for prompt, tokens in zip(prompts, together):
        assert decoder.generate([prompt], spec).tokens[0] == tokens
    assert all(len(t) == 12 for t in together)


def test_ar_stops_at_eos(tiny_model):
    decoder = Decoder(tiny_model)
    free = decoder.generate([[5, 9, 14]], DecodeSpec(max_new_tokens=10)).tokens[0]
    eos = free[3]
    stopped = decoder.generate([[5, 9, 14]], DecodeSpec(max_new_tokens=10, eos_token_ids=(eos,))).tokens[0]
    assert stopped == free[:free.index(eos) + 1]
    unseen = next(t for t in range(tiny_model.cfg.vocab_size) if t not in free)
    either = decoder.generate([[5, 9, 14]], DecodeSpec(max_new_tokens=10, eos_token_ids=(unseen, eos))).tokens[0]
    assert either == stopped  # any of the ids stops the stream


def test_prompt_longer_than_cache_raises(tiny_model):
    decoder = Decoder(tiny_model)
    with pytest.raises(ValueError, match="cache"):
        decoder.generate([list(range(1, 40))], DecodeSpec(max_new_tokens=8), cache_len=32)
    with pytest.raises(ValueError, match="empty prompt"):
        decoder.generate([[]], DecodeSpec(max_new_tokens=8))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.generate([[tiny_model.cfg.vocab_size]], DecodeSpec(max_new_tokens=8))


def test_int4_experts_equal_dequantized_bf16_experts():
    cfg = config_lib.tiny()
    int4 = Transformer(cfg.replace(expert_quant="int4"), nnx.Rngs(5))
    dense = Transformer(cfg, nnx.Rngs(5))
    # Same non-expert weights; the dense model's experts are the INT4 weights dequantized ([out, in] -> [in, out]).
    shared = [(path, var) for path, var in nnx.to_flat_state(nnx.state(int4))
              if not str(path[-1]).endswith(("_packed", "_scale"))]
    nnx.update(dense, nnx.from_flat_state(shared))
    for a, b in zip(int4.layers, dense.layers):
        if hasattr(a.mlp, "int4_experts"):
            gate, up, down = a.mlp.int4_experts().dequantize()
            b.mlp.w_gate[...] = jnp.swapaxes(gate, 1, 2)
            b.mlp.w_up[...] = jnp.swapaxes(up, 1, 2)
            b.mlp.w_down[...] = jnp.swapaxes(down, 1, 2)
    s, t = 2, 5
    toks = jax.random.randint(jax.random.key(2), (s, t), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(t), (s, t))
    got = int4(toks, pos, init_cache(cfg, s, 8), causal(s, t)).logits
    want = dense(toks, pos, init_cache(cfg, s, 8), causal(s, t)).logits
    assert rel_err(got, want) < 1e-5


def test_int4_layers_give_ops_the_routing_expert_count(monkeypatch):
    """Each INT4 MoE layer calls ops.int4_moe with routed_experts = the config's experts (under expert parallelism a
    device holds a slice; the kernels' dispatch and tilings count pairs per routed expert)."""
    cfg = config_lib.tiny().replace(expert_quant="int4")
    model = Transformer(cfg, nnx.Rngs(5))
    seen, real = [], ops.int4_moe
    monkeypatch.setattr(ops, "int4_moe", lambda *a, **k: seen.append(k.get("routed_experts")) or real(*a, **k))
    toks = jax.random.randint(jax.random.key(2), (1, 3), 0, cfg.vocab_size)
    model(toks, jnp.arange(3)[None], init_cache(cfg, 1, 8), causal(1, 3))
    assert seen and set(seen) == {cfg.num_experts}


def test_a_forward_makes_one_attention_plan_for_all_its_layers(monkeypatch):
    """The absorbed forward builds `ops.tree_verify_plan` once (from the prefix lengths and the tree mask every layer
    shares) and hands that plan to each layer's attention call; the naive path needs none."""
    cfg = config_lib.tiny()
    model = Transformer(cfg, nnx.Rngs(1))
    plans, calls = [], []
    real_plan, real_attention = ops.tree_verify_plan, ops.tree_verify_attention
    monkeypatch.setattr(ops, "tree_verify_plan", lambda *a, **k: plans.append(real_plan(*a, **k)) or plans[-1])
    monkeypatch.setattr(ops, "tree_verify_attention",
                        lambda *a, **k: calls.append(a[6]) or real_attention(*a, **k))
    toks = jax.random.randint(jax.random.key(3), (2, 3), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(3), (2, 3))
    jax.eval_shape(lambda: model(toks, pos, init_cache(cfg, 2, 8), causal(2, 3)))
    assert len(plans) == 1 and plans[0].num_heads == cfg.num_heads
    assert len(calls) == cfg.num_layers and all(plan is plans[0] for plan in calls)
    plans.clear()
    jax.eval_shape(lambda: model(toks, pos, init_cache(cfg, 2, 8), causal(2, 3), absorbed=False))
    assert not plans


def test_a_share_of_the_experts_computes_the_most_loaded_devices_pairs():
    """`parallel.expert_parallel` without a mesh, holding E / tp of the routed experts (one device's share, as
    bench_k26 --shard_of builds it): it computes exactly the pairs of the device that holds the most distinct
    experts of the step (ties: most pairs), as that device would (ids shifted by its first expert; the others'
    pairs zero), plus the shared expert's slice."""
    from kdtree_jax.model.layers import gated_mlp
    from kdtree_jax.model.moe import routed_experts
    from kdtree_jax.model.parallel import expert_parallel, most_loaded_first

    # device 2 of 4 (experts 4, 5) holds 2 distinct experts; device 0 one (twice); device 3 one
    ids = jnp.array([[4, 0], [5, 0], [7, 4]], jnp.int32)
    assert int(most_loaded_first(ids, 2, 8)) == 4
    assert int(most_loaded_first(jnp.array([[0, 6], [0, 7]], jnp.int32), 2, 8)) == 6  # 2 distinct beat 2 pairs of 1
    keys = jax.random.split(jax.random.key(0), 6)
    d, i, held, routed = 16, 8, 2, 8
    x = jax.random.normal(keys[0], (3, d))
    experts = tuple(jax.random.normal(k, shape) for k, shape in zip(keys[1:4], ((held, d, i), (held, d, i),
                                                                                 (held, i, d))))
    shared = tuple(jax.random.normal(k, s) for k, s in zip(keys[4:], ((4, d), (4, d))))
    shared = (*shared, jax.random.normal(keys[5], (d, 4)))
    weights = jax.random.uniform(keys[5], ids.shape)
    got = expert_parallel(lambda x, e, i, w: routed_experts(x, *e, i, w), x, experts, ids, weights,
                          (gated_mlp, shared), routed_experts=routed)
    want = routed_experts(x, *experts, ids - 4, weights) + gated_mlp(x, *shared)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
