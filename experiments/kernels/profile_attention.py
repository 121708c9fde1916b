"""Run one tree-verify attention kernel on one bench case a few times, for a profiler (Nsight Compute) to attach to.

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --kernel-name regex:tree_verify_attention_mgpu \
        --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python3 experiments/kernels/profile_attention.py --kernel=mosaic_gpu --heads=8 --prefix=32768 --nodes=16

The inputs are those of `bench_kernels.py`'s attention section (experiments/kernels/kernels_attention.py). Without
`XLA_PYTHON_CLIENT_PREALLOCATE=false` ncu saves and restores JAX's whole memory pool (~105 GiB on an H200) around every
replay pass, over a minute per profiled kernel. Stall samples per SASS line: `experiments/kernels/ncu_stalls.py`.

`--kernel=flashmla --flashmla=DIR` runs FlashMLA's dense decode (`experiments/peers/flashmla.py`, built by
`build_flashmla.sh`) on the same inputs instead, its scheduler's metadata made by the first call and reused, so that
one ncu run can profile both kernels at one shape (`--kernel-name regex:splitkv` for FlashMLA's).
"""
from __future__ import annotations

import jax
import numpy as np
from absl import flags
from jax.experimental.pallas import mosaic_gpu as plgpu

from experiments.kernels.kernels_attention import K26_SCALE, attention_inputs
from experiments.peers import flashmla
from kdtree_jax import cli
from pallas_kernels import tree_verify_attention_mgpu as attn_mgpu
from pallas_kernels import tree_verify_attention_triton as attn_triton

KERNELS = {"mosaic_gpu": attn_mgpu.tree_verify_attention, "triton": attn_triton.tree_verify_attention}
flags.DEFINE_enum("kernel", "mosaic_gpu", [*sorted(KERNELS), "flashmla"],
                  "which attention kernel (its whole op), or FlashMLA's dense decode (the peer)")
flags.DEFINE_integer("streams", 1, "streams S")
flags.DEFINE_integer("heads", 8, "heads H")
flags.DEFINE_integer("prefix", 32768, "committed cache rows N per stream")
flags.DEFINE_integer("nodes", 16, "tree nodes T")
flags.DEFINE_integer("calls", 3, "calls of the op (the first compiles)")
flags.DEFINE_bool("combine_in_kernel", False, "mosaic_gpu only: the split-K partials joined in the kernel")
flags.DEFINE_list("skip", [], "diagnostic, with --combine_in_kernel (its results then wrong): parts of the in-kernel "
                  "combine left out, to time the rest: 'join' (the programs' join of the partials), 'wait' (their "
                  "semaphore wait)")
flags.DEFINE_list("registers", [], "mosaic_gpu only: registers per consumer and per producer thread (e.g. 240,24; "
                  "default the kernel's REGISTERS)")
flags.DEFINE_string("flashmla", None, "--kernel=flashmla: directory holding the flashmla_decode extension "
                    "(build_flashmla.sh's OUT_DIR)")
F = flags.FLAGS


def skip_parts(parts: list[str]) -> None:
    """Leave the named parts of the in-kernel combine out of the kernel traced next (this process only)."""
    if set(parts) - {"join", "wait"}:
        raise ValueError(f"--skip={parts}: only 'join' and 'wait'")
    if parts and not F.combine_in_kernel:
        raise ValueError("--skip: for --combine_in_kernel")
    if "join" in parts:
        attn_mgpu._combine_units = lambda *args, **kwargs: None
    if "wait" in parts:
        plgpu.semaphore_wait = lambda *args, **kwargs: None


def run_flashmla(args) -> None:
    """F.calls FlashMLA calls on the op's inputs args (the first also makes the scheduler's metadata)."""
    try:
        import torch   # noqa: PLC0415 (the peer's framework, only on the GPU machine)
        fm = flashmla.load(F.flashmla)
    except ImportError as e:
        cli.fail(f"--kernel=flashmla needs PyTorch and FlashMLA's extension (--flashmla={F.flashmla}): {e}")
    peer_inputs = flashmla.inputs(torch, args)
    _, _, meta, splits = flashmla.decode(fm, peer_inputs, K26_SCALE)
    for _ in range(F.calls - 1):
        flashmla.decode(fm, peer_inputs, K26_SCALE, meta, splits)
    torch.cuda.synchronize()


def main(_):
    case = dict(streams=F.streams, heads=F.heads, prefix=F.prefix, nodes=F.nodes)
    if (F.kernel == "flashmla") != (F.flashmla is not None):
        raise ValueError(f"--kernel={F.kernel} --flashmla={F.flashmla}: --flashmla=DIR goes with --kernel=flashmla "
                         "and only with it")
    if F.kernel == "flashmla" and (F.registers or F.combine_in_kernel or F.skip):
        raise ValueError("--registers, --combine_in_kernel and --skip are options of --kernel=mosaic_gpu")
    args = attention_inputs(jax.random.key(0), case, np.random.default_rng(0))
    if F.kernel == "flashmla":
        run_flashmla(args)
        print(f"ran FlashMLA's dense decode on {case} {F.calls} times")
        return
    options = {}
    if F.registers:
        if F.kernel != "mosaic_gpu" or len(F.registers) != 2:
            raise ValueError(f"--registers={F.registers}: two numbers (consumer, producer), for --kernel=mosaic_gpu")
        options["registers"] = tuple(int(n) for n in F.registers)
    if F.combine_in_kernel:
        if F.kernel != "mosaic_gpu":
            raise ValueError("--combine_in_kernel: for --kernel=mosaic_gpu")
        options["combine_in_kernel"] = True
    skip_parts(F.skip)
    op = jax.jit(lambda *a: KERNELS[F.kernel](*a, scale=K26_SCALE, **options))
    for _ in range(F.calls):
        jax.block_until_ready(op(*args))
    print(f"ran {F.kernel} tree_verify_attention on {case} {F.calls} times")


if __name__ == "__main__":
    cli.run(main)
