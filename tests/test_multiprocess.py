"""The multi-host path on the CPU: two processes with one device each, joined by jax.distributed (what an 8-GPU node
run as one process per GPU, or several hosts, does), decode exactly what one process with two devices decodes.

Both runs are experiments/generate.py on a random tiny target with a tp=2 mesh, ddtree (kernels: pure-JAX references,
as `auto` picks on the CPU). The processes exchange data over gloo, XLA's CPU collectives.
"""
import json
import os
import socket
import subprocess
import sys

from conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--config=tiny", "--init=random", "--policy=ddtree", "--budget=8", "--block_size=6", "--prompt=5,9,14,3,8",
        "--prompt=11,2", "--max_new_tokens=8", "--mesh=tp=2", "--tokenizer=none"]


def generate(out, *extra, env=None, wait=True):
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "generate.py"), *ARGS, f"--out={out}", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.communicate(timeout=600) if wait else proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_decode_what_one_process_decodes(tmp_path):
    base = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    one = tmp_path / "one.json"
    stdout, _ = generate(one, env=dict(base, XLA_FLAGS=f"{FAST_COMPILE} --xla_force_host_platform_device_count=2"))
    assert one.exists(), stdout[-3000:]
    two = tmp_path / "two.json"
    coordinator = f"--coordinator=127.0.0.1:{free_port()}"
    procs = [generate(two if i == 0 else tmp_path / "unused.json", coordinator, "--num_processes=2",
                      f"--process_id={i}", env=base, wait=False) for i in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    single, joined = json.loads(one.read_text()), json.loads(two.read_text())
    assert joined["tokens"] == single["tokens"]
    assert not (tmp_path / "unused.json").exists()  # only process 0 writes
