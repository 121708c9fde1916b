"""Training utilities and both training scripts (kdtree_jax/training/, experiments/train_*.py): tiny configs, CPU."""
import dataclasses
import importlib.util
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdtree_jax import checkpoint, config, data
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.training.corpus import Corpus, count_epochs
from kdtree_jax.training.drafter_objective import (draft_blocks, drafter_logits, drafter_metrics, drafter_summary,
                                                   draw_anchors, make_drafter_step, position_weights)
from kdtree_jax.training.loop import Budget, History, LoopConfig, evaluate_final, train_loop
from kdtree_jax.training.optim import ROUTER_BIAS, OptimConfig, make_optimizer
from kdtree_jax.training.precision import master_params
from kdtree_jax.training.run import RunConfig
from kdtree_jax.training.target_objective import (balance_router_bias, load_imbalance, make_target_step, target_loss,
                                                  target_loss_and_loads, token_nll)
from kdtree_jax.training.train_state import BestParams, StateCheckpointer, TrainState

SHIPPED_TOKENIZER = os.path.join(os.path.dirname(__file__), os.pardir, "checkpoints", "tokenizer.json")
RATE = 1e-3  # router bias balancing rate


def _compile(jitted, *args):
    """Compiled ahead of the call (the suite's cheap-compile XLA flags, tests/conftest.py, apply)."""
    return jitted.lower(*args).compile()


def _load_script(name):
    """experiments/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(__file__), os.pardir, "experiments", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _small_target(vocab_size=64) -> config.ModelConfig:
    """One dense layer, one MoE layer, bf16 like the real target."""
    return config.tiny().replace(vocab_size=vocab_size, num_layers=2, hidden_size=32, num_heads=2, q_lora_rank=16,
                                 kv_lora_rank=16, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                 dtype="bfloat16", name="small")


def _small_drafter(target: config.ModelConfig, block_size=4) -> config.DrafterConfig:
    return config.DrafterConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_layers=1,
                                block_size=block_size, target_layer_ids=(0, 1), mask_token_id=data.MASK_ID,
                                num_heads=2, head_dim=8, intermediate_size=32)


def _fit(step_fn, state, args, lr, steps):
    step_fn = _compile(step_fn, state, *args, jnp.float32(lr))
    losses = []
    for _ in range(steps):
        state, metrics = step_fn(state, *args, jnp.float32(lr))
        losses.append(float(metrics["loss"]))
    return state, losses, metrics


# ------------------------------------------------------------------------------------------------------ target


def test_target_step_fits_a_fixed_batch_and_balances_the_router():
    cfg = _small_target()
    layout, params = master_params(Transformer(cfg, nnx.Rngs(0)))
    assert layout.dtypes["layers"][1]["mlp"]["w_gate"] == jnp.bfloat16
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    optimizer = make_optimizer(params, OptimConfig(lr=1e-2, warmup_steps=1))
    state = TrainState(params, optimizer.init(params))
    window = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 17)), jnp.int32)
    state, losses, metrics = _fit(make_target_step(layout, optimizer, RATE), state, (window,), 1e-2, 6)
    assert losses[-1] < losses[0] - 0.5, losses
    assert float(metrics["imbalance"]) >= 1.0
    bias = np.asarray(state.params["layers"][1]["mlp"][ROUTER_BIAS])
    assert np.any(bias != 0)  # moved by the balancing rule, in whole multiples of the rate
    np.testing.assert_allclose(bias / RATE, np.round(bias / RATE), atol=1e-3)


def test_expert_loads_count_every_routed_token():
    cfg = _small_target()
    model = Transformer(cfg, nnx.Rngs(1))
    window = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 9)), jnp.int32)
    graphdef, params = nnx.split(model)

    def both(p, w):
        m = nnx.merge(graphdef, p)
        return target_loss_and_loads(m, w), target_loss(m, w)

    (loss, loads), plain = _compile(jax.jit(both), params, window)(params, window)
    assert loads.shape == (1, cfg.num_experts)  # one MoE layer
    assert float(loads.sum()) == 3 * 8 * cfg.num_experts_per_tok
    np.testing.assert_allclose(float(loss), float(plain), rtol=1e-6)  # capturing changes nothing


def test_router_bias_rule_moves_toward_the_mean_load():
    params = {"layers": {0: {"mlp": {"w": jnp.ones((2, 2))}},
                         1: {"mlp": {ROUTER_BIAS: jnp.zeros(4)}},
                         2: {"mlp": {ROUTER_BIAS: jnp.full(4, 0.5)}}}}
    loads = jnp.array([[8.0, 0.0, 4.0, 4.0], [1.0, 2.0, 3.0, 6.0]])  # means 4 and 3
    out = balance_router_bias(params, loads, 0.01)
    np.testing.assert_allclose(out["layers"][1]["mlp"][ROUTER_BIAS], [-0.01, 0.01, 0.0, 0.0])
    np.testing.assert_allclose(out["layers"][2]["mlp"][ROUTER_BIAS], [0.51, 0.51, 0.5, 0.49])
    assert out["layers"][0] is params["layers"][0]
    assert float(load_imbalance(loads)) == 2.0


def test_optimizer_freezes_the_router_bias_and_decays_only_matrices():
    params = {"m": jnp.ones((2, 3)), "v": jnp.ones(3), "mlp": {ROUTER_BIAS: jnp.ones(3)}}
    cfg = OptimConfig(weight_decay=0.5)
    optimizer = make_optimizer(params, cfg)
    grads = {"m": jnp.zeros((2, 3)), "v": jnp.zeros(3), "mlp": {ROUTER_BIAS: jnp.ones(3)}}
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    np.testing.assert_allclose(updates["m"], 0.5)  # decoupled decay: + wd * param (the step multiplies by -lr)
    np.testing.assert_allclose(updates["v"], 0.0)
    np.testing.assert_allclose(updates["mlp"][ROUTER_BIAS], 0.0)


def test_learning_rate_schedule_and_budget():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, final_lr_fraction=0.1)
    assert cfg.learning_rate(0, 0.0) == pytest.approx(0.1)
    assert cfg.learning_rate(50, 0.0) == pytest.approx(1.0)
    assert cfg.learning_rate(50, 0.5) == pytest.approx(0.55)
    assert cfg.learning_rate(50, 1.0) == pytest.approx(0.1)
    budget = Budget(steps=8, seconds=None, started=time.monotonic())
    budget.begin()
    assert budget.progress(2) == 0.25 and not budget.done(7) and budget.done(8)
    timed = Budget(steps=None, seconds=1e-3, started=time.monotonic() - 1.0)
    timed.begin()
    assert timed.done(0)
    with pytest.raises(ValueError, match="no budget"):
        Budget(steps=None, seconds=None, started=0.0)


# ----------------------------------------------------------------------------------------------------- drafter


def test_anchors_leave_room_for_a_block_and_some_context():
    rng = np.random.default_rng(0)
    anchors = draw_anchors(rng, batch=64, seq_len=24, num_anchors=5, block_size=16)
    assert anchors.shape == (64, 5) and anchors.dtype == np.int32
    assert all(row == sorted(set(row)) for row in anchors.tolist())  # distinct, sorted
    # every anchor a has a context (a >= 1) and its block a .. a+L-1 inside the window (a <= T - L), and all occur
    assert set(np.unique(anchors)) == set(range(1, 24 - 16 + 1))
    with pytest.raises(ValueError, match="no anchor"):
        draw_anchors(rng, 1, 16, 1, 16)
    with pytest.raises(ValueError, match="num_anchors"):
        draw_anchors(rng, 1, 20, 5, 16)


def test_draft_blocks_on_a_hand_made_example():
    tokens = jnp.array([[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]])
    greedy = tokens + 100  # the target's token after each position
    anchors = jnp.array([[1, 4], [3, 2]])
    blocks = draft_blocks(tokens, greedy, anchors, block_size=4, mask_id=2)
    np.testing.assert_array_equal(blocks.block, [[11, 2, 2, 2], [14, 2, 2, 2], [23, 2, 2, 2], [22, 2, 2, 2]])
    np.testing.assert_array_equal(blocks.positions, [[1, 2, 3, 4], [4, 5, 6, 7], [3, 4, 5, 6], [2, 3, 4, 5]])
    # label k (1..L-1) = the target's greedy token after position a+k-1
    np.testing.assert_array_equal(blocks.labels, [[111, 112, 113], [114, 115, 116], [123, 124, 125],
                                                  [122, 123, 124]])
    np.testing.assert_array_equal(blocks.ctx_len, [1, 4, 3, 2])
    np.testing.assert_allclose(position_weights(4, 2.0), np.exp([0.0, -0.5, -1.0]), rtol=1e-6)


def test_drafter_context_rows_at_or_after_the_anchor_are_hidden():
    target_cfg = _small_target()
    target = Transformer(target_cfg, nnx.Rngs(2))
    drafter = Drafter(_small_drafter(target_cfg), target_cfg, nnx.Rngs(3))
    tokens = jnp.asarray(np.random.default_rng(2).integers(4, 64, (1, 12)), jnp.int32)
    anchors = jnp.array([[5]])
    (dgraph, dparams), (tgraph, tparams) = nnx.split(drafter), nnx.split(target)
    run = _compile(jax.jit(lambda d, t, x: drafter_logits(nnx.merge(dgraph, d), nnx.merge(tgraph, t), x,
                                                          anchors)[0]), dparams, tparams, tokens)
    logits = run(dparams, tparams, tokens)
    after = run(dparams, tparams, tokens.at[0, 6:].set((tokens[0, 6:] + 7) % 60 + 4))
    before = run(dparams, tparams, tokens.at[0, 4].set((tokens[0, 4] + 7) % 60 + 4))
    np.testing.assert_array_equal(after, logits)  # context rows >= a and later tokens are not seen
    assert float(jnp.max(jnp.abs(before - logits))) > 0  # context row a-1 is


def test_drafter_metrics_chain_acceptance():
    labels = jnp.array([[1, 2, 3], [1, 2, 3]])
    predicted = jnp.array([[1, 2, 0], [1, 0, 3]])  # right: [1,1,0] and [1,0,1]
    logits = jax.nn.one_hot(predicted, 8) * 10.0
    weights = position_weights(4, 7.0)
    loss, sums = drafter_metrics(logits, labels, weights)
    summary = drafter_summary({**jax.device_get(sums), "loss_sum": loss * sums["blocks"]})
    assert summary["acc"] == [1.0, 0.5, 0.5]
    assert summary["chain"] == [1.0, 0.5, 0.0]
    assert summary["tau"] == pytest.approx(2.5)
    nll = np.asarray(token_nll(logits, labels))
    assert summary["loss"] == pytest.approx(float((nll * weights).sum() / (2 * weights.sum())), rel=1e-5)


def test_drafter_step_fits_a_fixed_batch_with_the_target_frozen():
    target_cfg = _small_target()
    target_graphdef, target_params = nnx.split(Transformer(target_cfg, nnx.Rngs(4)))
    frozen = jax.tree.map(np.asarray, target_params)
    dcfg = _small_drafter(target_cfg)
    layout, params = master_params(Drafter(dcfg, target_cfg, nnx.Rngs(5)))
    optimizer = make_optimizer(params, OptimConfig(lr=1e-2, warmup_steps=1))
    state = TrainState(params, optimizer.init(params))
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(4, 64, (4, 16)), jnp.int32)
    anchors = jnp.asarray(draw_anchors(rng, 4, 16, 6, dcfg.block_size))
    step = make_drafter_step(layout, target_graphdef, optimizer, position_weights(4, 7.0))
    state, losses, metrics = _fit(step, state, (target_params, tokens, anchors), 1e-2, 6)
    assert losses[-1] < losses[0] - 0.3, losses
    assert float(metrics["blocks"]) == 24
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, target_params), frozen)


# --------------------------------------------------------------------------------------------------------- loop


def test_best_params_keep_the_lowest_held_out_loss():
    best = BestParams(keep=True)
    for step, loss in [(0, 5.0), (10, 3.0), (20, 3.0), (30, float("nan")), (40, 4.0)]:
        best.offer(step, {"loss": loss}, {"w": jnp.float32(step)})
    assert best.summary() == {"step": 10, "held_out": {"loss": 3.0}}  # a tie or a NaN does not replace the best
    assert best.to_save(40, {"w": jnp.float32(40)}) == (10, {"w": 10.0})
    last = BestParams(keep=False)
    assert last.offer(0, {"loss": 1.0}, {"w": jnp.float32(0)}) and last.params is None
    assert last.to_save(40, "last params") == (40, "last params")
    with pytest.raises(ValueError, match="no held-out evaluation"):
        BestParams(keep=True).to_save(0, {})


@pytest.mark.parametrize("keep_best", [True, False])
def test_train_loop_keeps_the_params_of_the_best_evaluation(keep_best):
    """A fake run whose held-out loss (w - 3)^2 falls until step 3 and then rises; the step donates its state, so the
    best params must be a copy."""
    step_fn = jax.jit(lambda state, lr: (TrainState({"w": state.params["w"] + 1.0}, state.opt_state),
                                         {"loss": state.params["w"]}), donate_argnums=0)
    evaluate = lambda p: {"loss": float((p["w"] - 3.0) ** 2)}
    state = TrainState({"w": jnp.float32(0.0)}, ())
    history, best = History(), BestParams(keep_best)
    loop = LoopConfig(eval_every=0.125, log_every=1)
    state, step, _ = train_loop(state, step_fn, lambda _: (), evaluate, Budget(8, None, 0.0),
                                OptimConfig(), loop, history, best, 4, 0, None, lambda *_: {})
    assert step == 8 and float(state.params["w"]) == 8.0
    assert [r["step"] for r in history.held_out] == list(range(9))  # at the start, then every 1/8 of the budget
    final = evaluate_final(evaluate, state.params, step, 4, history, best)
    assert final == {"loss": 25.0} and len(history.held_out) == 9  # the step-8 evaluation is reused
    assert best.summary() == {"step": 3, "held_out": {"loss": 0.0}}
    saved_step, params = best.to_save(step, state.params)
    assert (saved_step, float(params["w"])) == ((3, 3.0) if keep_best else (8, 8.0))


def test_epochs_beyond_two_warn_and_name_the_default_roots(caplog):
    """(The absl logger's level is set for the test: a script run in-process earlier in this worker may have left
    absl's verbosity at ERROR, which dropped the warning before caplog saw it.)"""
    corpus = Corpus(np.zeros(1000, np.uint16), np.zeros(10, np.uint16), {"roots": ["/stdlib"]})
    with caplog.at_level("WARNING", logger="absl"):
        assert count_epochs(1500, corpus, "train_x") == 1.5
    assert not caplog.records
    with caplog.at_level("WARNING", logger="absl"):
        assert count_epochs(26000, corpus, "train_x") == 26.0
    assert "26.0 epochs" in caplog.text and "default roots" in caplog.text
    with pytest.raises(ValueError, match="fraction of the budget"):
        LoopConfig(eval_every=0.0)


# ------------------------------------------------------------------------------------------------------ script


def _corpus(root, files=40):
    """Python-looking files; the held-out split (by path hash) gets some of them."""
    rng = np.random.default_rng(0)
    for i in range(files):
        body = "".join(f"def f{i}_{j}(x, y={rng.integers(100)}):\n    return x * {rng.integers(100)} + y\n\n"
                       for j in range(12))
        (root / f"mod{i}.py").write_text(f'"""Module {i}."""\nimport os\n\n{body}')
    assert any(data.is_held_out(f"mod{i}.py") for i in range(files))


def test_training_scripts_write_checkpoints_that_restore(tmp_path):
    (tmp_path / "src").mkdir()
    _corpus(tmp_path / "src")
    cfg = _small_target(vocab_size=4096)
    run = RunConfig(out=str(tmp_path / "target"), state_dir=str(tmp_path / "state"),
                    results_dir=str(tmp_path / "results"), steps=2, batch=2, seq_len=16, eval_batches=1,
                    roots=(str(tmp_path / "src"),), tokenizer=SHIPPED_TOKENIZER, token_cache=None,
                    loop=LoopConfig(log_every=1))
    train_target = _load_script("train_target")
    results = train_target.train(cfg, run, RATE, time.monotonic())
    assert results["steps"] == 2 and results["tokens_seen"] == 2 * 2 * 16
    assert results["epochs"] == pytest.approx(2 * 2 * 16 / results["corpus"]["tokens_train"])
    assert np.isfinite(results["final"]["held_out"]["loss"]) and results["corpus"]["files_held_out"] > 0
    assert results["final"]["step"] == 2 and results["checkpoint"]["step"] == results["best"]["step"]
    assert results["best"]["held_out"]["loss"] <= results["final"]["held_out"]["loss"]

    restored = checkpoint.restore_target(run.out)
    assert restored.cfg == cfg
    assert restored.layers[1].mlp.w_gate[...].dtype == jnp.bfloat16
    assert restored.layers[1].mlp.gate[...].dtype == jnp.float32
    state = StateCheckpointer(run.state_dir, {"config": results["config"]})
    layout, like = master_params(Transformer(cfg, nnx.Rngs(9)))
    optimizer = make_optimizer(like, run.optim)
    saved, meta, best = state.restore(TrainState(like, optimizer.init(like)), keep_best=True)
    assert meta["step"] == 2 and best.summary() == results["best"]
    mine = nnx.to_pure_dict(nnx.state(restored, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, mine, layout.cast(best.params))  # the bf16 cast of the best masters

    with open(os.path.join(run.results_dir, "train_target.json")) as f:
        written = json.load(f)
    assert written["steps"] == 2 and written["best"] == results["best"] and written["checkpoint"]["params"] == \
        "best held-out"
    assert os.path.getsize(os.path.join(run.results_dir, "train_target_loss.png")) > 0

    # The drafter script on that checkpoint.
    drafter_run = dataclasses.replace(run, out=str(tmp_path / "drafter"), state_dir=str(tmp_path / "dstate"),
                                      seq_len=24)
    train_drafter = _load_script("train_drafter")
    drafter_results = train_drafter.train(drafter_run, run.out, 3, 7.0, time.monotonic(), drafter_config=_small_drafter)
    assert drafter_results["steps"] == 2 and drafter_results["blocks_seen"] == 2 * 2 * 3
    assert drafter_results["epochs"] == pytest.approx(2 * 2 * 24 / drafter_results["corpus"]["tokens_train"])
    held_out = drafter_results["final"]["held_out"]
    assert 1.0 <= held_out["tau"] <= 4.0 and len(held_out["chain"]) == 3
    assert drafter_results["checkpoint"]["step"] == drafter_results["best"]["step"]
    with open(os.path.join(run.results_dir, "train_drafter.json")) as f:
        assert {"epochs", "final", "best"} <= set(json.load(f))
    drafter = checkpoint.restore_drafter(drafter_run.out, restored.cfg)
    assert drafter.cfg == _small_drafter(cfg) and drafter.fc[...].dtype == jnp.bfloat16
    assert os.path.getsize(os.path.join(run.results_dir, "train_drafter_loss.png")) > 0


def test_a_train_state_of_the_old_dense_layout_is_not_resumed(tmp_path, monkeypatch):
    """A train state saved before the dense weights were stored [out..., in] (its meta without the layout) is refused
    by name, not restored transposed (a square weight would fit) nor failed with orbax's shape error."""
    from kdtree_jax import checkpoint
    like = TrainState({"w": jnp.ones((4, 4))}, {"m": jnp.zeros((4, 4))})
    store = StateCheckpointer(str(tmp_path / "state"), {"config": "x"})
    monkeypatch.setattr(checkpoint, "DENSE_LAYOUT", None)          # as saved before the layout was recorded
    store.save(1, like, {"step": 1}, BestParams(keep=False))
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"dense weights and their optimizer moments \[in, out...\]"):
        store.restore(like, keep_best=False)
