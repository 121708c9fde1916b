"""The "ffi" launcher's handler (pallas_kernels/triton_ffi_launch.cc) on the CPU: it builds with the host's compiler
against jaxlib's FFI headers, and the attributes the lowering writes (a Triton cubin as a string, its hash, the grid,
warps and shared memory) decode in the handler's binding after XLA has parsed the program: the call is run on the
CPU backend, where the only operand the handler cannot decode is the CUDA stream.

What is left for the GPU (tests/test_kernels_gpu.py, experiments/kernels/kernels_moe.py): the module load, the launch and the
command buffers.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pallas_kernels import int4_moe_triton as MT
from pallas_kernels import triton_ffi
from pallas_kernels.triton_call import kernel_source

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler to build the handler")

# The combine kernel of int4_moe through triton_call(launcher="ffi"), lowered and run on the CPU backend with the
# handler registered there under the launcher's target name.
_RUN_ON_CPU = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax.interpreters import mlir
    from pallas_kernels import int4_moe_triton as MT, triton_call as TC, triton_ffi
    mlir.register_lowering(TC.triton_kernel_call_p, TC._triton_kernel_lowering, platform="cpu")
    triton_ffi.register(platform="cpu")
    rows, hidden = jnp.arange(16, dtype=jnp.int32), 2048
    y = jax.random.normal(jax.random.key(0), (16, hidden), jnp.bfloat16)
    call = lambda r, y: TC.triton_call(r, y, kernel=MT._combine_kernel, out_shape=jax.ShapeDtypeStruct(
        (2, hidden), jnp.bfloat16), grid=(2, 2), num_warps=4, num_stages=1, launcher="ffi", TOP_K=8, HIDDEN=hidden,
        BD=1024)
    try:
        jax.block_until_ready(jax.jit(call)(rows, y))
    except Exception as e:
        print("HANDLER SAID:", e)
""")


def test_the_handler_decodes_every_attribute_the_lowering_writes(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", KDTREE_BUILD_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", _RUN_ON_CPU], capture_output=True, text=True, env=env, timeout=600,
                         check=False)
    said = run.stdout + run.stderr
    assert "HANDLER SAID:" in said, said[-3000:]
    # Operand 0 is the stream (no GPU context on the CPU); an attribute of the wrong name or type would be listed too.
    assert "bad operands at: 0)" in said and "GPU context is not available" in said, said[-3000:]
    assert list(tmp_path.glob("libkdtree_triton_ffi-*.so")), "the handler library was not built"


def test_the_library_is_built_once_per_source_and_jaxlib(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_BUILD_DIR", str(tmp_path))
    first = triton_ffi.library_path()
    mtime = first.stat().st_mtime_ns
    assert triton_ffi.library_path() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]      # no partial build left behind


def test_a_missing_compiler_is_named_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(RuntimeError, match="found no C\\+\\+ compiler.*set CXX, or launch with launcher='jax_triton'"):
        triton_ffi.library_path()


def test_an_unwritable_build_directory_is_named_with_the_fix(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("KDTREE_BUILD_DIR", str(blocker / "build"))
    with pytest.raises(RuntimeError, match="not writable.*set KDTREE_BUILD_DIR"):
        triton_ffi.library_path()


def test_triton_without_a_cache_directory_compiles_into_the_build_directory(tmp_path, monkeypatch):
    """TRITON_CACHE_DIR set empty (jax-triton 0.3.1 does it on import) makes Triton's own compile fail ("Could not
    create or locate cache dir"); the launcher gives that compile a cache under the build directory and leaves the
    setting as it was, also when two threads compile at once (the setting is the process's)."""
    import threading

    import triton

    monkeypatch.setenv("KDTREE_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    compiled = {}

    def compile_combine(hidden: int):
        source = kernel_source(MT._combine_kernel, ("*i32", "*bf16", "*bf16"),
                               (("TOP_K", int, 8), ("HIDDEN", int, hidden), ("BD", int, 1024)))
        compiled[hidden] = triton_ffi.compile_cubin(source, num_warps=4, num_stages=1, compute_capability=90)

    threads = [threading.Thread(target=compile_combine, args=(hidden,)) for hidden in (2048, 3072)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(compiled) == [2048, 3072]
    assert all(c.cubin.startswith(b"\x7fELF") and c.name == "_combine_kernel" for c in compiled.values())
    assert list((tmp_path / "triton").iterdir()) and os.environ["TRITON_CACHE_DIR"] == ""
    assert "dir" not in vars(triton.knobs.cache)
