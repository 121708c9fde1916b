"""experiments/bench_k26.py: the whole script at tiny scale on 8 fake CPU devices (a child process), its floors at
the full Kimi K2.6 shapes, and its reading of collectives from compiled HLO text."""
import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from kdtree_jax import config, sharding
from kdtree_jax.model.transformer import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "experiments", "bench_k26.py")
DEVICES = 8


def _bench():
    spec = importlib.util.spec_from_file_location("bench_k26", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


bench = _bench()


def _run_on_8_devices(out, *args) -> dict:
    """Run the script at tiny scale (2 layers, prefix 64, B = 4) on 8 fake CPU devices; its JSON results."""
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
               f"--xla_force_host_platform_device_count={DEVICES}".strip())
    tiny = ["--scale=tiny", "--layers=2", "--prefix=64", "--budgets=4", "--fast_compile", f"--out={out}"]
    proc = subprocess.run([sys.executable, SCRIPT, *tiny, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["meta"]["mesh"] == {"data": 1, "tp": DEVICES}
    assert results["meta"]["config"]["num_layers"] == 2 and results["meta"]["config"]["expert_quant"] == "int4"
    return results


def _param_bytes(cfg) -> tuple[int, int]:
    """(bytes of the whole model, bytes on each device under tp = 8), from the abstract model and the rules."""
    _, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
    whole = per_device = 0
    for path, variable in nnx.to_flat_state(state):
        leaf = variable.get_value()
        spec = sharding.param_spec(path, leaf.shape, {"data": 1, "tp": DEVICES})
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        whole += nbytes
        per_device += nbytes // (DEVICES if sharding.TP in spec else 1)
    return whole, per_device


def test_tiny_run_on_8_cpu_devices(tmp_path):
    """The script's main path: params made in their shards, every case timed, floors and collectives reported."""
    results = _run_on_8_devices(tmp_path / "k26_tiny.json", "--streams=1,8", "--prefill_tokens=16", "--reps=2",
                                "--warmup=1")
    cases = {(c["kind"], c["streams"], c["nodes"]): c for c in results["cases"]}
    assert set(cases) == {("prefill", 1, 16), ("ar", 1, 1), ("verify", 1, 5), ("ar", 8, 1), ("verify", 8, 5)}
    for case in cases.values():
        assert "error" not in case and "skipped" not in case, case
        timed = ("step_ms", "step_ms_min", "step_ms_pipelined", "compile_s", "model_bytes", "device_bytes", "flops")
        for key in timed + (("step_ms_in_loop",) if case["kind"] != "prefill" else ()):
            assert np.isfinite(case[key]) and case[key] > 0, (key, case)
        for kind in ("model", "device", "compute"):
            assert np.isfinite(case["floor_ms"][kind]) and case["floor_ms"][kind] > 0, case
            assert case["fraction_of_floor"][kind] == pytest.approx(case["floor_ms"][kind] / case["step_ms"])
        assert case["collectives"]["count"] > 0 and case["collectives"]["ms"] > 0, case  # tp = 8: psums at least
        assert case["memory_per_device"]["temp"] >= 0 and case["cache_bytes_per_device"] > 0
    assert cases[("verify", 8, 5)]["tokens"] == 40 and cases[("verify", 8, 5)]["budget"] == 4
    # Routing as it happened: one count per MoE layer, between top-k and min(E, M x top-k); one token hits exactly k.
    cfg = bench.bench_config("kimi_k2_6", "tiny", 2)
    moe_layers, k = cfg.num_layers - cfg.first_k_dense, cfg.num_experts_per_tok
    for case in cases.values():
        hit = case["experts_hit_per_layer"]
        assert len(hit) == moe_layers and all(k <= h <= min(cfg.num_experts, case["tokens"] * k) for h in hit), case
        assert 0 < case["floor_ms_routed"]["model"] and case["fraction_of_floor_routed"]["model"] > 0
    assert cases[("ar", 1, 1)]["experts_hit_per_layer"] == [k] * moe_layers

    # Each device holds exactly its shard: the script checked every param's shards; here the bytes add up to the
    # rules' split of the abstract model, far below the whole.
    whole, per_device = _param_bytes(bench.bench_config("kimi_k2_6", "tiny", 2))
    assert results["params"]["total_bytes"] == whole
    assert results["params"]["per_device_bytes"] == [per_device] * DEVICES
    assert per_device < whole / 4
    assert sum(v for k, v in results["weights"].items() if k.endswith("_per_device")) == per_device


def test_the_tp8_step_takes_two_collectives_a_layer(tmp_path):
    """The tp = 8 step compiled on 8 fake CPU devices: one all-reduce of the hidden state after attention and one
    after the MLP / MoE of every layer, one for the embedding lookup and the argmax's two all-gathers per step; none
    for routing (the router is replicated). These are the collectives `share_collectives` reports for one device's
    share (--shard_of), op for op."""
    results = _run_on_8_devices(tmp_path / "compiled.json", "--compile_only", "--streams=1,8", "--prefill_tokens=0")
    cfg = bench.bench_config("kimi_k2_6", "tiny", 2)
    for case in results["cases"]:
        got = {(o["op"], o["elements"]): o["count"] for o in case["collectives"]["ops"]}
        modeled = bench.share_collectives(cfg, DEVICES, case["streams"], case["nodes"], None)
        assert got == {(o["op"], o["elements"]): o["count"] for o in modeled["ops"]}, case["collectives"]
        reduces = sum(n for (op, _), n in got.items() if op == "all-reduce")
        assert reduces <= 2 * cfg.num_layers + 1, f"{reduces} all-reduces for {cfg.num_layers} layers"


def test_one_devices_share_of_tp8_holds_its_shards(tmp_path):
    """--shard_of=tp=8 on one device: it holds exactly one device's bytes of the tp = 8 layout (every param at its
    shard's shape), computes the most loaded device's experts each layer (never more than a device holds), and
    reports the deployment's collectives apart. --exact=on,off: every case also with the batch-invariant forward;
    --command_buffers reaches the compile options."""
    out = tmp_path / "share.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, SCRIPT, "--scale=tiny", "--layers=2", "--prefix=64", "--budgets=4",
                           "--fast_compile", "--streams=1", "--prefill_tokens=0", "--shard_of=tp=8", "--loop_only",
                           "--loop_steps=2", "--reps=1", "--warmup=0", "--exact=on,off",
                           "--command_buffers=FUSION,WHILE", f"--out={out}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["meta"]["command_buffers"] == "FUSION,WHILE"   # an XLA:GPU compile option: the CPU ignores it
    cfg = bench.bench_config("kimi_k2_6", "tiny", 2)
    assert results["params"]["per_device_bytes"] == [_param_bytes(cfg)[1]]
    per_device = cfg.num_experts // DEVICES
    for case in results["cases"]:
        assert case["step_ms_in_loop"] > 0 and case["collectives"]["modeled"], case
        assert case["collectives"]["count"] == 2 * cfg.num_layers + 3
        hit = case["device_experts_hit_per_layer"]
        assert all(-(-cfg.num_experts_per_tok // DEVICES) <= h <= per_device for h in hit), case
        assert case["floor_ms"]["device"] > 0 and case["fraction_of_floor"]["device"] > 0
    assert sorted((c["kind"], c["budget"], c["exact"]) for c in results["cases"]) == [
        ("ar", 0, False), ("ar", 0, True), ("verify", 4, False), ("verify", 4, True)]


def test_step_loop_runs_the_step_its_number_of_times(monkeypatch):
    """make_step_loop's while loop runs the step 3 times (counted), its outputs (argmax tokens, cache, experts hit)
    equal to the step called 3 times on the same tokens, and XLA cannot count its trips (the host reads the predicate
    after each, as in the decode loop), so `step_ms_in_loop` times 3 real steps routed as the waited step. (The same
    tokens write the same cache rows each step, so the outputs cannot tell the trips apart: the count does.)"""
    cfg = bench.bench_config("kimi_k2_6", "tiny", 2)
    mesh = bench.bench_mesh("tp=1")
    graphdef, params, _ = bench.make_params(cfg, mesh, 0, False)
    inputs = bench.block_inputs(np.random.default_rng(0), cfg, "verify", 2, 5, 16)
    step = bench.make_step(graphdef, params, mesh)
    with jax.set_mesh(mesh):
        cache = bench.random_cache(cfg, mesh, 2, 64, 16, 1)
        for _ in range(3):
            tokens, cache, hit = step(params, cache, *inputs)
        forward, steps_run = bench._forward, []

        def counted(*args, **kwargs):
            jax.debug.callback(lambda: steps_run.append(1))
            return forward(*args, **kwargs)

        monkeypatch.setattr(bench, "_forward", counted)
        loop = bench.make_step_loop(graphdef, params, mesh, 3)
        looped = jax.block_until_ready(loop.fn(params, bench.random_cache(cfg, mesh, 2, 64, 16, 1), *inputs))
        hlo = loop.fn.lower(params, bench.random_cache(cfg, mesh, 2, 64, 16, 1), *inputs).compile().as_text()
    assert len(steps_run) == 3 and loop.steps == 3
    assert "while(" in hlo and "known_trip_count" not in hlo
    for a, b in zip(jax.tree.leaves((tokens, cache, hit)), jax.tree.leaves(looped)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_failed_loop_keeps_the_step_row():
    """run_case: when the loop's compile or run fails (say, out of memory), the row keeps the step's timing and
    records the loop's error, and hands back no cache (a donated one may be gone)."""
    cfg = bench.bench_config("kimi_k2_6", "tiny", 2)
    mesh = bench.bench_mesh("tp=1")
    graphdef, params, _ = bench.make_params(cfg, mesh, 0, False)
    run = dict(reps=1, warmup=0, bandwidth=1e12, matmul=1e12, compiler_options=None, compile_only=False)
    broken = bench.StepLoop(fn=None, steps=2)                  # lowering it raises AttributeError
    row, cache = bench.run_case(bench.Case("ar", 1, 1, 16), bench.make_step(graphdef, params, mesh), params,
                                bench.random_cache(cfg, mesh, 1, 64, 16, 0), mesh, cfg,
                                bench.weight_bytes(cfg, {"data": 1, "tp": 1}), np.random.default_rng(0), {}, run,
                                broken)
    assert row["step_ms"] > 0 and row["loop_error"].startswith("AttributeError") and "step_ms_in_loop" not in row
    assert cache is None
    assert "the loop failed: AttributeError" in bench.format_row(row)


def test_device_profile_splits_the_host_window(monkeypatch):
    """device_profile from a trace's calls: the window's time before the first device event and after the last,
    the span, and host events as medians over the calls (one slow first call does not move them)."""
    from experiments.timing import Call

    def call(window, first, span, host_us):
        timeline = [["host/main", "Execute", 0.0, host_us], ["device", "kernel_a", first, span / 2],
                    ["device", "kernel_b", first + span / 2, span / 2]]
        return Call(span_us=span, events_us={"kernel_a": span / 2, "kernel_b": span / 2}, events=2, d2h_copies=0,
                    timeline=timeline, window_us=window)

    calls = [call(3000.0, 600.0, 1500.0, 100.0), call(2800.0, 500.0, 1500.0, 120.0),
             call(90000.0, 600.0, 1500.0, 80000.0)]                  # a first call with one-time host work
    monkeypatch.setattr(bench, "annotation_calls", lambda trace_dir, prefix: {"ar S=1 T=1": calls})
    got = bench.device_profile("unused")["ar S=1 T=1"]
    assert got["window_ms"] == pytest.approx(3.0) and got["span_ms"] == pytest.approx(1.5)
    assert got["before_device_ms"] == pytest.approx(0.6) and got["after_device_ms"] == pytest.approx(0.9)
    assert got["top_host_events_ms"] == {"Execute": pytest.approx(0.12)}
    assert got["top_kernels_ms"] == {"kernel_a": pytest.approx(0.75), "kernel_b": pytest.approx(0.75)}


def test_compile_only_on_8_cpu_devices(tmp_path):
    """--compile_only: nothing allocated; each case compiled with its collectives and per-device argument bytes."""
    results = _run_on_8_devices(tmp_path / "k26_compiled.json", "--streams=8", "--prefill_tokens=0",
                                "--compile_only")
    assert results["params"] == {"abstract": True}
    _, per_device = _param_bytes(bench.bench_config("kimi_k2_6", "tiny", 2))
    assert [(c["kind"], c["nodes"]) for c in results["cases"]] == [("ar", 1), ("verify", 5)]
    for case in results["cases"]:
        assert "step_ms" not in case and case["compile_s"] > 0 and case["collectives"]["count"] > 0, case
        assert case["memory_per_device"]["argument"] > per_device  # its param shards + the cache + the inputs


def test_k26_ar_floor_is_33_gb_per_token():
    """The AR floor at the full K2.6 shapes on tp=8, against the parameter counts written out from the config."""
    k2 = config.kimi_k2_6()
    axis_sizes = {"data": 1, "tp": 8}
    weights = bench.weight_bytes(k2, axis_sizes)
    d, layers, moe = k2.hidden_size, k2.num_layers, k2.num_layers - k2.first_k_dense
    attention = (d * k2.q_lora_rank + k2.q_lora_rank + k2.q_lora_rank * k2.num_heads * k2.qk_head_dim
                 + d * (k2.kv_lora_rank + k2.qk_rope_head_dim) + k2.kv_lora_rank
                 + k2.kv_lora_rank * k2.num_heads * (k2.qk_nope_head_dim + k2.v_head_dim)
                 + k2.num_heads * k2.v_head_dim * d + 2 * d)
    bf16 = (layers * attention + 3 * d * k2.intermediate_size + moe * 3 * d * k2.moe_intermediate_size + d
            + d * k2.vocab_size)
    router_f32 = moe * (d + 1) * k2.num_experts
    assert weights.resident == 2 * bf16 + 4 * router_f32
    expert = 3 * d * k2.moe_intermediate_size * (4 + 16 / k2.quant_group_size) / 8  # nibbles + a bf16 scale per 32
    assert weights.experts == moe * k2.num_experts * expert

    ar = bench.step_cost(k2, weights, axis_sizes, streams=1, nodes=1, prefix=0)
    assert ar.experts_touched == pytest.approx(k2.num_experts_per_tok)
    assert ar.weight_bytes == pytest.approx(weights.resident + moe * k2.num_experts_per_tok * expert)
    assert 33.0e9 < ar.weight_bytes < 33.6e9
    assert ar.floors_s(8, 4.3e12, 780e12)["model"] == pytest.approx((ar.weight_bytes + ar.kv_bytes) / (8 * 4.3e12))
    # One device: its resident shards + one of the 8 experts on average (E/8 local) + the whole latent cache.
    at_4k = bench.step_cost(k2, weights, axis_sizes, streams=8, nodes=65, prefix=4096)
    assert at_4k.kv_bytes == 8 * (4096 + 65) * layers * (k2.kv_lora_rank + k2.qk_rope_head_dim) * 2
    assert ar.device_bytes == pytest.approx(weights.resident_per_device + moe * expert + ar.kv_bytes)
    assert at_4k.experts_touched == pytest.approx(k2.num_experts, rel=1e-3)  # 520 tokens touch every expert


def test_hlo_collectives_reads_sync_async_and_combined_ops():
    hlo = "\n".join([
        "  %all-reduce-start = bf16[8,7168]{1,0} all-reduce-start(bf16[8,7168]{1,0} %fusion.1), channel_id=1",
        "  %all-reduce-done = bf16[8,7168]{1,0} all-reduce-done(bf16[8,7168]{1,0} %all-reduce-start)",
        "  %ag = (f32[8,48]{1,0}, f32[8,384]{1,0}) all-gather-start(f32[8,48]{1,0} %x), dimensions={1}",
        "  %ag.done = f32[8,384]{1,0} all-gather-done((f32[8,48]{1,0}, f32[8,384]{1,0}) %ag)",
        "  %ar = (f32[8,7168]{1,0}, f32[8,8]{1,0}) all-reduce(f32[8,7168]{1,0} %a, f32[8,8]{1,0} %b), to_apply=%add",
        "  %cp = (bf16[4]{0}, bf16[4]{0}, u32[], u32[]) collective-permute-start(bf16[4]{0} %z)",
        "  %f = f32[8]{0} fusion(f32[8]{0} %p), kind=kLoop, calls=%fused_all-reduce",
        "  %s = f32[] all-reduce(f32[] %loss), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add",
    ])
    assert bench.hlo_collectives(hlo) == {("all-reduce", "bf16", 8 * 7168): 1, ("all-gather", "f32", 8 * 384): 1,
                                          ("all-reduce", "f32", 8 * 7168): 1, ("all-reduce", "f32", 64): 1,
                                          ("collective-permute", "bf16", 4): 1, ("all-reduce", "f32", 1): 1}


def test_flag_errors_and_append_guard(tmp_path):
    with pytest.raises(ValueError, match="--layers"):
        bench.bench_config("kimi_k2_6", "full", -1)
    with pytest.raises(ValueError, match="--loop_steps"):
        bench.cases_from_flags(SimpleNamespace(streams=["1"], budgets=["4"], prefix=16, prefill_tokens=0,
                                               loop_steps=-1), 1024, 1)
    with pytest.raises(ValueError, match="--scale"):
        bench.bench_config("kimi_k2_6", "huge", 0)
    assert bench.bench_config("kimi_k2_6", "full", 4).num_layers == 4
    path = tmp_path / "old.json"
    meta = dict(config={"num_layers": 4}, mesh={"data": 1, "tp": 1}, prefix=4096)
    path.write_text(json.dumps({"meta": meta, "cases": []}))      # a run from before --moe_launcher: jax-triton's
    meta["moe_launcher"] = "jax_triton"
    assert bench.previous_results(str(path), meta) is not None
    with pytest.raises(ValueError, match="another mesh"):
        bench.previous_results(str(path), dict(meta, mesh={"data": 1, "tp": 8}))
    with pytest.raises(ValueError, match="another moe_launcher"):
        bench.previous_results(str(path), dict(meta, moe_launcher="ffi"))
    assert bench.previous_results(str(tmp_path / "none.json"), meta) is None


def test_profiling_also_annotates_the_step_loops_calls(monkeypatch):
    """With --profile_dir each step loop's calls are annotated "k26|<case> loop|<i>" (device_profile's loop rows);
    without it nothing more runs."""
    names, calls = [], []
    monkeypatch.setattr(bench.jax.profiler, "TraceAnnotation",
                        lambda name: names.append(name) or contextlib.nullcontext())
    bench.profile_loop_calls(lambda: calls.append(1), "ar S=1 T=1 loop", {"profile": False})
    assert not names and not calls
    bench.profile_loop_calls(lambda: calls.append(1), "ar S=1 T=1 loop", {"profile": True})
    assert names == [f"k26|ar S=1 T=1 loop|{i}" for i in range(3)] and len(calls) == 3
