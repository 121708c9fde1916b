"""Run one int4_moe kernel at K2.6 shapes a few times, for a profiler (Nsight Compute) to attach to.

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --kernel-name regex:'gate_up|down' \
        --launch-skip 2 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats python3 experiments/kernels/profile_moe.py --kernel=triton --tokens=8

JAX's pool is not preallocated because ncu saves and restores every allocation around each replay pass: otherwise
the whole pool (kernels.md, "Twenty-fourth session").

`--kernel=mosaic` runs the Mosaic GPU block matmul's int4_moe (`int4_moe_mgpu`; its kernels are named
int4_block_matmul_kernel). `--launcher=xla` runs the Triton kernels through XLA's Triton custom call instead of
jax-triton (kernels.md, "Launching Triton kernels").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from absl import flags

from pallas_kernels import int4_moe_mgpu
from pallas_kernels.int4_matmul_mgpu import MgpuMatmulConfig
from pallas_kernels.int4_moe_triton import TritonMoeConfig
from pallas_kernels.triton_call import LAUNCHERS

from experiments.kernels.kernels_moe import INT4_KERNELS, moe_routing, moe_shapes, random_experts
from kdtree_jax import cli

MOSAIC = "mosaic"
flags.DEFINE_enum("kernel", "triton", sorted(INT4_KERNELS) + [MOSAIC], "which int4_moe")
flags.DEFINE_integer("tokens", 8, "tokens M")
flags.DEFINE_integer("calls", 3, "calls of the kernel (the first compiles)")
flags.DEFINE_enum("launcher", None, LAUNCHERS, "the Triton kernel's launcher (default: int4_moe_triton.LAUNCHER)")
flags.DEFINE_list("tiling", [], "the kernel's config as field=value pairs: TritonMoeConfig's, e.g. "
                  "block_n=64,num_stages=3 (default: default_config), or with --kernel=mosaic MgpuMatmulConfig's for "
                  "both GEMMs, e.g. cluster=2,block_tokens=96 (down keeps 128 rows per warpgroup unless rows_per_wg "
                  "is given)")
flags.DEFINE_integer("experts", 0, "experts E (0: K2.6's 384); fewer keep the profiler's memory save and restore "
                     "short (each call touches only its M x top-k experts' weights either way)")
flags.DEFINE_integer("touched", 0, "route each token's first N of its top-k slots to experts held here and the "
                     "rest to ids outside [0, E) (experts of other devices, which int4_moe drops): one device's share "
                     "of expert parallelism, e.g. --experts=48 --touched=3 for the tp=8 share at M = 1 (its most "
                     "loaded device holds ~2.6 of a token's 8 experts); 0: every slot held here")
F = flags.FLAGS


def main(_):
    shape, _ = moe_shapes(quick=False)
    num_experts = F.experts or shape["experts"]
    if num_experts < shape["top_k"]:
        cli.fail(f"--experts={num_experts}: top-{shape['top_k']} routing needs at least {shape['top_k']} experts")
    if not 0 <= F.touched <= shape["top_k"]:
        cli.fail(f"--touched={F.touched}: a token has {shape['top_k']} slots; give 0 (all held here) to "
                 f"{shape['top_k']}")
    if (F.launcher and F.kernel != "triton") or (F.tiling and F.kernel == "reference"):
        cli.fail(f"--launcher applies to --kernel=triton, --tiling to triton and {MOSAIC}, not {F.kernel}")
    launch = {"launcher": F.launcher} if F.launcher else {}
    if F.tiling:
        config_type = MgpuMatmulConfig if F.kernel == MOSAIC else TritonMoeConfig
        launch["config"] = config_type(**cli.dataclass_fields(F, "tiling", config_type))
    experts = random_experts(jax.random.key(3), num_experts, shape["hidden"], shape["inter"])
    ids, w = moe_routing(jax.random.key(4), F.tokens, num_experts, shape["top_k"])
    if F.touched:
        ids = ids.at[:, F.touched:].set(num_experts)
    x = jax.random.normal(jax.random.key(5), (F.tokens, shape["hidden"]), jnp.bfloat16)
    if F.kernel == MOSAIC:
        config = launch.get("config")                                   # None: the op's default_config
        down = config if any(p.startswith("rows_per_wg=") for p in F.tiling) else None    # else down's default
        kernel = functools.partial(int4_moe_mgpu.int4_moe, config=config, down_config=down)
    else:
        kernel = jax.jit(functools.partial(INT4_KERNELS[F.kernel], **launch))
    for _ in range(F.calls):
        jax.block_until_ready(kernel(x, experts, ids, w))
    print(f"ran {F.kernel} int4_moe ({F.launcher or 'default launcher'}, {launch.get('config', 'default tiling')}) "
          f"at M={F.tokens} over {num_experts} experts ({F.touched or shape['top_k']} of each token's "
          f"{shape['top_k']} held here) {F.calls} times")


if __name__ == "__main__":
    cli.run(main)
