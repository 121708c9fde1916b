"""The benchmark scripts' CPU smoke runs: experiments/kernels/bench_kernels.py --quick --sections=tree and
experiments/bench_round.py on the tiny preset run to the end and write the JSON the H200 runs will be read from.

CPU timings mean nothing here (interpret-mode kernels, wall clock under the profiler), so the child processes compile
with LLVM's cheap settings; what is checked is the JSON: the fields, their arithmetic, and the runs' own checks
(tree kernels bit-identical to the heapq spec and the python accept walk; the staged round equal to decode_round;
the fixed-trip-count loop emitting what the while loop emits).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import FAST_COMPILE

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
KERNELS = os.path.join(ROOT, "experiments", "kernels")
STAGES = ("draft", "build", "verify", "accept", "commit")


HANG_S = 900   # a guard against a hung script, not a timing: bench_decode's small table took ~200 s on a loaded CPU


def run_script(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=FAST_COMPILE, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_bench_kernels_tree_section(tmp_path):
    out = tmp_path / "kernels.json"
    stdout = run_script("kernels/bench_kernels.py", "--quick", "--sections=tree", "--reps=2", f"--out={out}")
    result = json.loads(out.read_text())
    assert result["checks"]["tree_identical"] is True
    assert result["meta"]["xla_flags"] == FAST_COMPILE       # XLA's flags change what is timed (command buffers)
    assert result["attention"] == [] and result["int4_moe"] == []
    rows = result["tree"]
    assert [r["budget"] for r in rows] == [7, 40]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert (r["streams"], r["depth"], r["vocab"]) == (4, 15, 1000)
        assert r["identical"] is True and r["accept_identical"] is True
        assert all(r["identical_detail"].values()) and all(r["accept_identical_detail"].values())
        assert 0 <= r["mean_accepted"] <= r["depth"]
        for key in ("kernel_from_topk_us", "reference_from_topk_us", "kernel_from_logits_us",
                    "reference_from_logits_us", "topk_us", "accept_kernel_us", "accept_reference_us", "peer_us",
                    "kernel_from_logits_wall_us"):
            assert r[key] > 0, key
        stages = r["peer_stages_us"]
        assert set(stages) == {"topk", "d2h", "heap", "h2d", "total"}
        assert r["peer_after_topk_us"] == pytest.approx(stages["d2h"] + stages["heap"] + stages["h2d"])
        assert r["peer_over_kernel"] == pytest.approx(r["peer_after_topk_us"] / r["kernel_from_topk_us"])
        assert r["meets_50x"] == (r["peer_over_kernel"] >= 50)
        assert {"kernel_from_topk", "kernel_from_logits", "accept_kernel", "topk"} <= set(r["timings"])
    assert "peer/kernel" in stdout

    run_script("kernels/bench_kernels.py",
               "--quick", "--sections=ceilings", "--reps=2", "--merge", "--noplot", f"--out={out}")
    merged = json.loads(out.read_text())
    assert merged["tree"] == rows and merged["checks"]["tree_identical"] is True
    assert merged["meta"]["merged"]["sections"] == ["tree"]
    assert merged["meta"]["merged"]["meta"]["date"] == result["meta"]["date"]


def test_bench_kernels_merge_keeps_the_attention_cases_not_rerun(tmp_path):
    """--merge with --attention_cases: the earlier run's other attention rows stay (named in meta.merged), the re-run
    case's row is this run's, in the table's order."""
    out = tmp_path / "kernels.json"
    cases = [dict(streams=1, heads=8, prefix=256, nodes=1), dict(streams=1, heads=8, prefix=256, nodes=16),
             dict(streams=2, heads=4, prefix=128, nodes=5)]
    earlier = dict(meta=dict(date="earlier"), ceilings={}, checks={}, attention=[dict(c, kernel_us=-1.0) for c in cases])
    out.write_text(json.dumps(earlier))
    run_script("kernels/bench_kernels.py", "--quick", "--sections=attention", "--sweep=", "--reps=2", "--merge",
               "--noplot",
               "--attention_cases=1/8/256/16", f"--out={out}")
    merged = json.loads(out.read_text())
    assert [(r["heads"], r["nodes"]) for r in merged["attention"]] == [(8, 1), (8, 16), (4, 5)]
    assert [r["kernel_us"] > 0 for r in merged["attention"]] == [False, True, False]
    assert merged["meta"]["merged"]["attention_cases"] == ["1/8/256/1", "2/4/128/5"]
    assert merged["meta"]["merged"]["meta"]["date"] == "earlier"


def test_bench_kernels_merge_keeps_the_earlier_row_of_a_case_skipped_on_the_budget(tmp_path):
    """--merge: a case this run skips on --attention_budget_s keeps the earlier run's row, not a 'skipped' stub."""
    out = tmp_path / "kernels.json"
    case = dict(streams=1, heads=8, prefix=256, nodes=16)
    out.write_text(json.dumps(dict(meta=dict(date="earlier"), ceilings={}, checks={},
                                   attention=[dict(case, kernel_us=-1.0)])))
    run_script("kernels/bench_kernels.py", "--quick", "--sections=attention", "--sweep=", "--reps=2", "--merge",
               "--noplot",
               "--attention_cases=1/8/256/16,1/8/256/1", "--attention_budget_s=0", f"--out={out}")
    merged = json.loads(out.read_text())
    assert merged["attention"][0] == dict(streams=1, heads=8, prefix=256, nodes=1, skipped="time budget")
    assert merged["attention"][1] == dict(case, kernel_us=-1.0)
    assert merged["meta"]["merged"]["attention_cases"] == ["1/8/256/16"]


def test_bench_kernels_merge_needs_an_earlier_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(KERNELS, "bench_kernels.py"), "--quick",
                           "--sections=ceilings", "--merge", f"--out={tmp_path / 'none.json'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "run without --merge first" in proc.stderr


def test_back_to_back_job_runs_the_calls_in_one_jitted_call():
    import jax.numpy as jnp
    from experiments.timing import back_to_back_job

    sets = [(jnp.full((2,), float(i)),) for i in range(3)]
    job = back_to_back_job("double", lambda x: 2 * x, sets, calls=4)
    assert job.calls == 4 and len(job.arg_sets) == 3
    outs = job.fn(*job.args(1))                        # the second window: sets 4..7 mod 3
    assert [float(o[0]) for o in outs] == [2.0, 4.0, 0.0, 2.0]


def test_attention_peers_time_the_mosaic_gpu_op_at_the_split_counts_asked():
    """--attention_splits gives the Mosaic GPU op a peer per split count other than its default, up to one cache block
    a split (built, not run: jitted functions compile when first called)."""
    import jax
    from experiments.kernels.kernels_attention import attention_inputs, attention_peers
    from pallas_kernels import tree_verify_attention_mgpu as attn_mgpu

    case = dict(streams=1, heads=64, prefix=4096, nodes=1)
    args = attention_inputs(jax.random.key(0), case, np.random.default_rng(0))
    default = attn_mgpu.default_num_splits(1, 64, args[2].shape[1])
    blocks = args[2].shape[1] // attn_mgpu.BLOCK_KV
    peers = attention_peers(args, interpret=False, splits=[default, 64, blocks + 1])
    assert [name for name in peers if name.startswith("mosaic_gpu:")] == ["mosaic_gpu:num_splits=64"]
    assert {"op_plan_in_call", "triton", "mosaic_gpu", "mosaic_gpu_combine_in_kernel"} <= set(peers)
    assert not any(name.startswith("triton:launch:") for name in peers)
    launched = attention_peers(args, interpret=False, launch_peers=True)
    assert {name for name in launched if name.startswith("triton:launch:")} == {"triton:launch:ffi",
                                                                               "triton:launch:jax_triton"}
    assert attention_peers(args, interpret=True, splits=[64]) == {}


@pytest.mark.parametrize("text", ["1/8/4096", "0/8/4096/1", "1/8/4096/-1", "a/8/4096/1"])
def test_parse_case_names_a_malformed_case(text):
    from experiments.kernels.kernels_attention import parse_case
    with pytest.raises(ValueError, match="is not S/H/N/T"):
        parse_case(text)


def test_attention_flashmla_refuses_a_cpu_and_a_malformed_case():
    """The FlashMLA comparison runs on a GPU; elsewhere, or given a malformed case, it says so (exit 2) before
    anything is built (run as a script: its absl flags would clash with other scripts' imported here)."""
    from experiments.kernels.kernels_attention import parse_case
    assert parse_case("1/64/32768/16") == dict(streams=1, heads=64, prefix=32768, nodes=16)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    for args, why in ((["--flashmla=/nonexistent"], "run it on a Hopper GPU"),
                      (["--flashmla=/nonexistent", "--cases=1/8/4096"], "is not S/H/N/T")):
        proc = subprocess.run([sys.executable, os.path.join(KERNELS, "attention_flashmla.py"), *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
        assert proc.returncode == 2 and why in proc.stderr, proc.stderr[-2000:]


def test_attention_alone_wall_refuses_a_cpu_and_a_malformed_case():
    """The profiler-free alone timing runs on a GPU; elsewhere, or given a malformed case, it says so (exit 2)."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    for args, why in (([], "run it on the GPU"), (["--cases=1/8/4096"], "is not S/H/N/T")):
        proc = subprocess.run([sys.executable, os.path.join(KERNELS, "attention_alone_wall.py"), *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
        assert proc.returncode == 2 and why in proc.stderr, proc.stderr[-2000:]


def test_bench_round_tiny(tmp_path):
    out = tmp_path / "round.json"
    stdout = run_script("bench_round.py", "--config=tiny", "--init=random", "--drafter=random", "--budgets=0,8,auto",
                        "--auto_budgets=0,4", "--streams=2", "--prompt_len=8", "--rounds=3", "--reps=2", f"--out={out}")
    result = json.loads(out.read_text())
    assert result["meta"]["model"] == "tiny" and result["meta"]["backend"] == "cpu"
    ar, tree, auto = result["rows"]
    assert auto["budget"] == "auto" and set(auto["step_costs_us"]) == {"0", "4"}
    assert all(us > 0 for us in auto["step_costs_us"].values()) and 1 <= auto["rounds"] <= 3
    assert sum(auto["budget_hist"].values()) == auto["rounds"] == len(auto["budget_rounds"])
    assert (ar["policy"], ar["budget"], tree["policy"], tree["budget"]) == ("ar", 0, "ddtree", 8)
    assert set(ar["stages_us"]) == set(STAGES) - {"draft"} and set(tree["stages_us"]) == set(STAGES)
    assert ar["tau_mean"] == 1.0 and 1.0 <= tree["tau_mean"] <= 16  # ar emits one token a round; L = 16
    for r in (ar, tree):
        assert r["streams"] == 2 and 1 <= r["rounds"] <= 3
        assert r["checks"] == dict(stages_length_equal=True, stages_vs_round_rel_err=pytest.approx(0, abs=1e-6),
                                   fixed_loop_same_output=True)
        assert r["stages_sum_us"] == pytest.approx(sum(r["stages_us"].values()))
        assert r["while_per_round_us"] == pytest.approx((r["while_loop_us"] - r["prefill_us"]) / r["rounds"])
        assert r["fixed_per_round_us"] == pytest.approx((r["fixed_loop_us"] - r["prefill_us"]) / r["rounds"])
        assert r["overhead_us"] == pytest.approx(r["while_per_round_us"] - r["stages_sum_us"])
        assert r["predicate_us"] == pytest.approx(r["while_per_round_us"] - r["fixed_per_round_us"])
        assert r["timing_method"] == "wall" and r["while_busy_per_round_us"] is None  # no device trace on the CPU
    assert "us per round" in stdout


def test_bench_round_times_the_exact_mode_beside_the_default(tmp_path):
    out = tmp_path / "round.json"
    stdout = run_script("bench_round.py", "--config=tiny", "--init=random", "--drafter=random", "--budgets=8",
                        "--exact=on,off", "--streams=2", "--prompt_len=8", "--rounds=2", "--reps=1", f"--out={out}",
                        "--noplot")
    exact, default = json.loads(out.read_text())["rows"]
    assert (exact["exact"], default["exact"]) == (True, False)
    for r in (exact, default):
        assert r["budget"] == 8 and set(r["stages_us"]) == set(STAGES)
        assert r["checks"]["stages_length_equal"] and r["checks"]["fixed_loop_same_output"]
    assert "exact" in stdout.splitlines()[1] and " on |" in stdout and " off |" in stdout


def test_bench_decode_small_table(tmp_path):
    """The shipped checkpoints, 3 held-out prompts, greedy: every batch group and policy present (ddtree with
    --budget=auto), outputs equal ar's on the CPU, histograms that count the rounds, the plot written; a spent time
    budget skips every (temperature, batch) group. Sampled decoding is checked by test_sampling and test_decode: a second temperature here would
    double the script's compiles (~130 s of the suite on two cores, experiments/notes/testing.md)."""
    out, png = tmp_path / "decode.json", tmp_path / "decode.png"
    run_script("bench_decode.py", "--num_prompts=3", "--max_new_tokens=8", "--budgets=auto", "--auto_budgets=0,4",
               "--batch_sizes=2", "--temperatures=0", "--topk=3", "--rounds_per_check=2", f"--out={out}",
               f"--plot={png}")
    result = json.loads(out.read_text())
    assert result["meta"]["skipped_groups"] == [] and result["meta"]["topk"] == 3 and png.stat().st_size > 0
    runs = result["runs"]
    groups = {(r["temperature"], r["batch"]) for r in runs}
    assert groups == {(0.0, 2)}  # 3 prompts in batches of 2: a full and a ragged last batch
    for r in runs:
        assert [x["policy"] for x in runs if (x["temperature"], x["batch"]) == (r["temperature"], r["batch"])] == \
            ["ar", "chain", "ddtree"]
        assert r["new_tokens"] == 24 and sum(r["accept_hist"]) == r["rounds"]
        emitted = sum(tau * n for tau, n in enumerate(r["accept_hist"], start=1))
        assert emitted == 24 - 3  # every round's tokens: all but the first of each of the 3 prompts (prefill's)
        assert r["tau"] == pytest.approx(emitted / r["rounds"])
        if r["policy"] == "ar":
            assert r["accept_hist"][1:] == [0] * (len(r["accept_hist"]) - 1)  # one token a round
        assert r["identical_to_ar"] is True and r["agree_prefix"] == 1.0
        assert r["speedup"] > 0
        if r["policy"] == "ddtree":  # its rounds: AR (B = 0) or a prefix of 4 nodes, from step costs it measured
            assert r["budget"] == "auto" and set(r["budget_hist"]) <= {"0", "4"}
            assert r["costs"]["candidates"] == [0, 4] and all(c > 0 for c in r["costs"]["seconds"])
            assert 0 < len(r["budget_rounds"]) < sum(r["budget_hist"].values())  # the first of two batches

    skipped = tmp_path / "skipped.json"
    run_script("bench_decode.py", "--num_prompts=2", "--max_new_tokens=8", "--budgets=4", "--batch_sizes=1",
               "--temperatures=0,1", "--time_budget_s=0", f"--out={skipped}", "--plot=")
    result = json.loads(skipped.read_text())
    assert result["runs"] == [] and len(result["meta"]["skipped_groups"]) == 2


def test_tiling_flags():
    """profile_moe --tiling and bench_k26 --moe_tiling (`cli.dataclass_fields`): integer fields, 0 / 1 for the
    boolean ones, of the Triton or the Mosaic GPU config; anything else is refused with the flag named, and a value
    the config refuses by the config."""
    from types import SimpleNamespace

    from kdtree_jax import cli
    from pallas_kernels.int4_matmul_mgpu import MgpuMatmulConfig
    from pallas_kernels.int4_moe_triton import TritonMoeConfig

    def parse(pairs, config_type=TritonMoeConfig):
        return config_type(**cli.dataclass_fields(SimpleNamespace(tiling=pairs), "tiling", config_type))

    config = parse(["block_n=128", "gate_up_splits=2", "group_by_block=1"])
    assert (config.block_n, config.gate_up_splits, config.group_by_block) == (128, 2, True)
    assert parse("fma=1,block_m=1,block_n=32").fma and parse("") == TritonMoeConfig()     # a string flag's form
    for bad in ("group_by_block=2", "block_n=wide", "no_such_field=1", "block_n"):
        with pytest.raises(ValueError, match=f"--tiling=.*{bad!r} is not field=integer"):
            parse([bad])
    mosaic = parse(["cluster=2", "block_tokens=96"], MgpuMatmulConfig)
    assert (mosaic.cluster, mosaic.block_tokens, mosaic.tile_k) == (2, 96, 128)
    with pytest.raises(ValueError, match="MgpuMatmulConfig.cluster=3"):
        parse(["cluster=3"], MgpuMatmulConfig)
    with pytest.raises(ValueError, match="takes one pair a block: block_m=1, not 4"):
        parse(["fma=1", "block_m=4", "block_n=32"])       # the multiply-adds take one token row a block


@pytest.mark.parametrize("installed,why", [("0.3.1", "found jax-triton 0.3.1"), (None, "found no jax-triton"),
                                           ("0.4.0", None), ("0.4rc1", None)])
def test_tokamax_triton_path_names_the_jax_triton_it_needs(monkeypatch, installed, why):
    """kernels_moe records why tokamax's Triton path cannot run (its jax-triton >= 0.4 `triton_call`) instead of
    the TypeError that calling it with jax-triton 0.3.1 raises; its other paths are tried."""
    import importlib.metadata

    from experiments.kernels import kernels_moe

    def version(name):
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", version)
    missing = kernels_moe.tokamax_path_missing("triton")
    assert missing is None if why is None else "needs jax-triton >= 0.4" in missing and why in missing
    assert kernels_moe.tokamax_path_missing("mosaic") is None and kernels_moe.tokamax_path_missing("xla") is None


def test_grouped_bars_writes_a_png_and_refuses_ragged_series(tmp_path):
    """The scripts' grouped bar plot: a PNG for two or three series; a series without one value per label, or no
    series, is refused."""
    from kdtree_jax import plots
    path = tmp_path / "bars.png"
    plots.grouped_bars(str(path), ["1/8/4096/1", "1/64/4096/1"], {"op": [1.0, 2.0], "reference": [2.0, 3.0]},
                       ylabel="us", title="t", log=True)
    assert path.stat().st_size > 0
    plots.grouped_bars(str(path), ["a", "b"], {"x": [1.0, 2.0], "y": [2.0, 3.0], "z": [1.5, 1.0]}, ylabel="us",
                       title="t")
    for bars in ({"op": [1.0]}, {}):
        with pytest.raises(ValueError, match="one value per label"):
            plots.grouped_bars(str(path), ["a", "b"], bars, ylabel="us", title="t")
