"""Triton's interpreter on the CPU for kernels written for jax-triton: `interpreter_call`, with `triton_call`'s
signature, runs a kernel on numpy copies of its operands, outputs filled with NaN first (so a finite output proves
every element was written). The process must start with TRITON_INTERPRET=1 (Triton decides at decoration, its own
library included). Triton's interpreter expects torch tensors; `_Tensor` is the part of their interface it uses
(pinned triton==3.6.0). The inline-PTX bf16 paths cannot run here, only the f32 ones.

Triton 3.6's interpreter holds a scalar as a 1-element array and turns a loop bound into an int with int(array),
which NumPy 2 refuses for an array that is not 0-d: `_patch_lang_tensor` below takes the element instead (a kernel
with a `for` loop over run-time bounds fails without it)."""
import jax.numpy as jnp
import numpy as np
from triton.runtime import interpreter as _interpreter

_TORCH_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.int32): "int32", np.dtype(np.uint16): "bfloat16",
                np.dtype(np.int64): "int64", np.dtype(np.int8): "int8", np.dtype(np.bool_): "bool"}


class _DType:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return "torch." + self.name

    __repr__ = __str__

    def __eq__(self, other):
        return str(self) == str(other)

    def __hash__(self):
        return hash(str(self))


class _Storage:
    def __init__(self, tensor):
        self.tensor = tensor

    def data_ptr(self):
        return self.tensor.array.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other):
        pass


class _Tensor:
    """A numpy array seen by Triton's interpreter as a CPU torch tensor (the interpreter reads and writes the memory
    at data_ptr() in place)."""

    def __init__(self, array, dtype_name=None):
        self.array = array
        self.dtype = _DType(dtype_name or _TORCH_NAMES[array.dtype])

    def data_ptr(self):
        return self.array.ctypes.data

    def untyped_storage(self):
        return _Storage(self)

    def new_empty(self, *args, **kwargs):
        return _Tensor(self.array, self.dtype.name)

    def set_(self, storage, offset, size, stride):
        self.array = storage.tensor.array
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return self.array.strides

    def copy_(self, other):
        pass


_patch_lang_tensor_of_triton = _interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _patch_lang_tensor_of_triton(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))   # one element, or an error


_interpreter._patch_lang_tensor = _patch_lang_tensor


def _tensor(array) -> _Tensor:
    array = np.ascontiguousarray(np.asarray(array))
    if array.dtype == jnp.bfloat16:
        return _Tensor(np.ascontiguousarray(array.view(np.uint16)), "bfloat16")
    return _Tensor(array)


def interpreter_call(*operands, kernel, out_shape, grid, num_warps=4, num_stages=1, **constexprs):
    """`triton_call` through Triton's interpreter: operands (arrays), out_shape (a ShapeDtypeStruct or a tuple of
    them) -> the outputs as jax arrays."""
    shapes = out_shape if isinstance(out_shape, tuple) else (out_shape,)
    outs = [np.full(s.shape, np.nan, np.float32).astype(s.dtype) if jnp.issubdtype(s.dtype, jnp.floating)
            else np.full(s.shape, -7, s.dtype) for s in shapes]
    out_tensors = [_tensor(o) for o in outs]
    args = [_tensor(a) for a in operands] + out_tensors
    kernel[grid](*args, **constexprs)
    results = tuple(jnp.asarray(t.array) for t in out_tensors)
    return results if isinstance(out_shape, tuple) else results[0]

