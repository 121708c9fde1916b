"""Run one int4_moe kernel at K2.6 shapes a few times, for a profiler (Nsight Compute) to attach to.

    ncu --clock-control none --kernel-name regex:'gate_up|down' --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 experiments/profile_moe.py --kernel=triton --tokens=8

`--launcher=xla` runs the Triton kernels through XLA's Triton custom call instead of jax-triton (kernels.md,
"Launching Triton kernels").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from absl import flags

from pallas_kernels.triton_call import LAUNCHERS

from experiments.kernels_moe import INT4_KERNELS, moe_routing, moe_shapes, random_experts
from kdtree_jax import cli

flags.DEFINE_enum("kernel", "triton", sorted(INT4_KERNELS), "which int4_moe")
flags.DEFINE_integer("tokens", 8, "tokens M")
flags.DEFINE_integer("calls", 3, "calls of the kernel (the first compiles)")
flags.DEFINE_enum("launcher", None, LAUNCHERS, "the Triton kernel's launcher (default: int4_moe_triton.LAUNCHER)")
F = flags.FLAGS


def main(_):
    shape, _ = moe_shapes(quick=False)
    experts = random_experts(jax.random.key(3), shape["experts"], shape["hidden"], shape["inter"])
    ids, w = moe_routing(jax.random.key(4), F.tokens, shape["experts"], shape["top_k"])
    x = jax.random.normal(jax.random.key(5), (F.tokens, shape["hidden"]), jnp.bfloat16)
    if F.launcher and F.kernel != "triton":
        cli.fail(f"--launcher applies to --kernel=triton, not {F.kernel}")
    launch = {"launcher": F.launcher} if F.launcher else {}
    kernel = jax.jit(functools.partial(INT4_KERNELS[F.kernel], **launch))
    for _ in range(F.calls):
        jax.block_until_ready(kernel(x, experts, ids, w))
    print(f"ran {F.kernel} int4_moe ({F.launcher or 'default launcher'}) at M={F.tokens} {F.calls} times")


if __name__ == "__main__":
    cli.run(main)
