"""The "ffi" launcher of `triton_call`: Triton 3.6 compiles the kernel to a cubin at lowering time, and the program
calls it through this project's XLA FFI handler (`triton_ffi_launch.cc`: one cuLaunchKernel on XLA's stream, the
module loaded in XLA's initialize stage, declared command-buffer compatible).

The device code is the one jax-triton launches (Triton's own compile, not XLA's Triton pipeline, which made the int4_moe
kernels 2-3x slower), and the launch is a typed FFI custom call that XLA may record into a CUDA graph with the
fusions around it, where jax-triton 0.3.1's legacy custom call (`triton_kernel_call`, api_version 2) cuts the graph.
What XLA does with it (the XLA that jax 0.11 pins; experiments/notes/kernels.md, "Twelfth session"): command buffers
take FUSION and CUSTOM_CALL thunks by default, a typed FFI call only when its execute handler carries the
command-buffer trait, legacy calls never, and only runs of at least 5 such thunks; the initialize stage runs on every
execution, before any capture, on XLA's stream; under the profiler command buffers are off.

    target_name()               the custom call target, its handler registered for CUDA on first use
    compile_cubin(source, ...)  Triton's compile for an sm_XY GPU: CompiledCubin(name, cubin, shared_mem, hash)

The handler library is compiled from `triton_ffi_launch.cc` with the host's C++ compiler ($CXX, else c++) against
jaxlib's FFI headers, once per source and jaxlib version, into $KDTREE_BUILD_DIR (default ~/.cache/kdtree_jax). It
opens the CUDA driver with dlopen, so it builds on machines without CUDA (tests lower programs for an H200 there).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import shlex
import shutil
import subprocess
import tempfile
import threading

import jax
import jaxlib

TARGET = "kdtree_triton_launch"
_COMPILE_LOCK = threading.Lock()
SOURCE = pathlib.Path(__file__).with_name("triton_ffi_launch.cc")


@dataclasses.dataclass(frozen=True)
class CompiledCubin:
    """A Triton kernel compiled for one GPU: its entry `name`, the `cubin` bytes, `shared_mem` (dynamic shared memory
    bytes per program), `num_warps` (of the compiled kernel: the block is 32 * num_warps threads) and `cubin_hash` (the
    handler's key for the loaded module: the first 8 bytes of the cubin's SHA-256, as a signed int64)."""
    name: str
    cubin: bytes
    shared_mem: int
    num_warps: int
    cubin_hash: int


def compile_cubin(source, num_warps: int, num_stages: int, compute_capability: int) -> CompiledCubin:
    """Triton's compile of `source` (a triton.compiler.ASTSource) for sm_<compute_capability>, with the checks that
    the handler can launch it. Needs Triton, not a GPU."""
    import triton   # noqa: PLC0415 (Triton is only needed where a kernel is lowered)
    from triton.backends.compiler import GPUTarget   # noqa: PLC0415

    with _COMPILE_LOCK, triton.knobs.cache.scope():     # the scope saves and restores process-wide settings
        if not triton.knobs.cache.dir:      # importing jax-triton sets TRITON_CACHE_DIR empty: Triton's compile fails
            triton.knobs.cache.dir = str(writable_build_directory() / "triton")
        compiled = triton.compile(source, target=GPUTarget("cuda", compute_capability, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
    meta = compiled.metadata
    for field in ("global_scratch_size", "profile_scratch_size"):
        if getattr(meta, field):
            raise NotImplementedError(f"{meta.name} needs {getattr(meta, field)} bytes of Triton's "
                                      f"{field.removesuffix('_size').replace('_', ' ')}, which the 'ffi' launcher "
                                      "does not allocate: launch it with launcher='jax_triton'")
    if meta.num_ctas != 1 or meta.launch_cooperative_grid or meta.launch_pdl:
        raise NotImplementedError(f"{meta.name} was compiled for clusters, a cooperative grid or programmatic "
                                  "dependent launch, which the 'ffi' launcher does not set up: launch it with "
                                  "launcher='jax_triton'")
    binary = compiled.asm["cubin"]
    digest = int.from_bytes(hashlib.sha256(binary).digest()[:8], "little", signed=True)
    return CompiledCubin(meta.name, binary, int(meta.shared), int(meta.num_warps), digest)


def target_name() -> str:
    """TARGET, its handler registered (initialize and execute stages) on the first call where JAX has a CUDA backend;
    a program lowered for an H200 on a machine without one (tests) only names it."""
    try:
        jax.devices("cuda")
    except RuntimeError:
        return TARGET
    register(platform="CUDA")
    return TARGET


@functools.lru_cache(maxsize=None)
def register(platform: str, target: str = TARGET) -> None:
    """Registers the handler library's two stages as `target` for `platform` (once per pair)."""
    library = ctypes.cdll.LoadLibrary(str(library_path()))
    jax.ffi.register_ffi_target(
        target, {"initialize": jax.ffi.pycapsule(library.KdtreeTritonInitialize),
                 "execute": jax.ffi.pycapsule(library.KdtreeTritonLaunch)}, platform=platform, api_version=1)


def build_directory() -> pathlib.Path:
    """$KDTREE_BUILD_DIR, else ~/.cache/kdtree_jax: the handler library and, where Triton has no cache directory of
    its own, Triton's compile cache."""
    return pathlib.Path(os.environ.get("KDTREE_BUILD_DIR") or pathlib.Path.home() / ".cache" / "kdtree_jax")


def writable_build_directory() -> pathlib.Path:
    """`build_directory()`, created; a clear error where it cannot be written."""
    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as e:
        raise RuntimeError(f"the 'ffi' Triton launcher writes its handler and compile cache into {directory}, "
                           f"which is not writable ({e}): set KDTREE_BUILD_DIR to a writable directory") from e
    return directory


def library_path() -> pathlib.Path:
    """The handler library for this source and jaxlib, compiled on first use (atomic: concurrent builds are safe)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + jaxlib.__version__.encode()).hexdigest()[:16]
    path = build_directory() / f"libkdtree_triton_ffi-{key}.so"
    if path.exists():
        return path
    compiler = shlex.split(os.environ.get("CXX") or "c++")
    if shutil.which(compiler[0]) is None:
        raise RuntimeError(f"the 'ffi' Triton launcher compiles {SOURCE.name} on first use and found no C++ compiler "
                           f"({compiler[0]!r}): install one (g++), set CXX, or launch with launcher='jax_triton'")
    with tempfile.NamedTemporaryFile(dir=writable_build_directory(), suffix=".so", delete=False) as partial:
        pass
    command = [*compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", str(SOURCE),
               "-o", partial.name, "-ldl"]
    build = subprocess.run(command, capture_output=True, text=True, check=False)
    if build.returncode:
        os.unlink(partial.name)
        raise RuntimeError(f"building the 'ffi' Triton launcher failed ({' '.join(command)}):\n{build.stderr[-4000:]}")
    os.replace(partial.name, path)
    return path
