"""Bad input through the scripts (kdtree_jax/cli.py): one line `error: <message>` on stderr naming the problem and
the fix, exit status 2, no traceback and no output; `--debug` keeps the traceback. Each case is refused before any
compute. The checks themselves are tested where they live (test_decode: temperature, positions, a tree budget
beyond memory; test_hf_import; test_checkpoint); here, the cases only a script reaches and the reporting."""
import json
import os
import subprocess
import sys

import jax
import pytest
from flax import nnx

from kdtree_jax import config, memory
from kdtree_jax.model.transformer import Transformer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


def generate(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "generate.py"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def assert_refused(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"error: {message}"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr[-3000:] + proc.stdout[-1000:]


@pytest.mark.parametrize("args, message", [
    (["--budget=abc"], "--budget=abc: 'abc' must be 'auto' or an integer number of tree nodes B in [0, 2147483647]"),
    (["--prompt=1,x"], "--prompt='1,x' must be comma-separated token ids"),
], ids=["bad_flag_value", "bad_prompt"])
def test_bad_input_is_one_error_line(args, message):
    assert_refused(generate("--prompt=1,2,3", "--max_new_tokens=4", *args), message)


def test_a_model_beyond_memory_is_refused_before_it_is_made():
    needed = memory.module_bytes(lambda: Transformer(config.kimi_k2_6(), nnx.Rngs(0)))
    if memory.devices_memory(jax.devices())[0] >= needed:
        pytest.skip("this host could hold the K2.6 params")
    assert_refused(generate("--config=kimi_k2_6", "--init=random", "--prompt=1"),
                   f"this needs at least {needed / memory.GB:.3g} GB (kimi_k2_6 params")


def test_a_block_size_the_drafter_was_not_trained_with_is_refused():
    assert_refused(generate("--init=checkpoints/target", "--drafter=checkpoints/drafter", "--policy=ddtree",
                            "--block_size=4", "--prompt=1,2,3"),
                   "--block_size=4 differs from the block size 16 the drafter checkpoints/drafter was trained with; "
                   "drop --block_size")


def test_debug_keeps_the_traceback():
    """--temperature=nan used to run and print NaN in the JSON; refused, here with the traceback kept."""
    proc = generate("--prompt=1,2,3", "--temperature=nan", "--json", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "{" not in proc.stdout
    assert "ValueError: --temperature=nan: must be a finite number >= 0" in proc.stderr


def test_the_demo_runs_auto_ddtree_beside_ar():
    """`make demo`'s command, shortened: --budget=auto (the default) with --compare runs ar beside it (its spec without
    the auto budgets) and reports the same tokens."""
    proc = generate("--init=checkpoints/target", "--drafter=checkpoints/drafter",
                    "--tokenizer=checkpoints/tokenizer.json", "--held_out_prompts=1", "--policy=ddtree",
                    "--auto_budgets=0,4", "--max_new_tokens=8", "--compare", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["budget"] == "auto" and report["identical_to_ar"] is True and report["ar"]["rounds"] > 0
