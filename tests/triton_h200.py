"""Compile a Triton kernel for the H200 (sm_90) on any machine, as jax-triton would on the GPU."""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H200 = GPUTarget("cuda", 90, 32)


def compile_for_h200(kernel, pointers: dict, constants: dict, num_warps: int, num_stages: int):
    """Triton's compile of `kernel` to PTX and SASS for sm_90: `pointers` {name: '*dtype'} in the kernel's argument
    order, 16-byte aligned (jax-triton passes its buffers so), then `constants` {name: value} (constexpr)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
    signature = dict(pointers, **{name: "constexpr" for name in constants})
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs), target=H200,
                          options=dict(num_warps=num_warps, num_stages=num_stages))
