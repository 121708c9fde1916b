"""The H200 on any machine: a Triton kernel compiled for sm_90 as Triton does on the GPU (`compile_for_h200`), and a
JAX function lowered for CUDA under an abstract mesh of H200s (`lower_for_h200`)."""
import jax
import triton
from triton.backends.compiler import GPUTarget
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels.triton_call import kernel_source

H200 = GPUTarget("cuda", 90, 32)


def compile_for_h200(kernel, pointers: dict, constants: dict, num_warps: int, num_stages: int):
    """Triton's compile of `kernel` to PTX and SASS for sm_90: `pointers` {name: '*dtype'} in the kernel's argument
    order, 16-byte aligned (jax-triton passes its buffers so), then `constants` {name: value} (constexpr)."""
    assert list(pointers) == kernel.arg_names[:len(pointers)], (list(pointers), kernel.arg_names)
    source = kernel_source(kernel, tuple(pointers.values()),
                           tuple(sorted((name, type(value), value) for name, value in constants.items())))
    return triton.compile(source, target=H200, options=dict(num_warps=num_warps, num_stages=num_stages))


def h200_mesh(shape: tuple[int, ...] = (1,), axes: tuple[str, ...] = ("tp",)) -> AbstractMesh:
    """An abstract mesh of NVIDIA H200s (nothing allocated, no GPU needed)."""
    return AbstractMesh(shape, axes, abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                                     platform="cuda"))


def lower_for_h200(fn, *args, mesh: AbstractMesh | None = None) -> str:
    """StableHLO text of jit(fn)(*args) (ShapeDtypeStructs) lowered for CUDA under `mesh` (default one H200)."""
    with jax.sharding.use_abstract_mesh(mesh or h200_mesh()):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)
