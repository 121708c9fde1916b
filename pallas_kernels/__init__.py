"""Pallas kernels (Triton lowering on the GPU, interpret mode on the CPU) with their pure-JAX references.

The model calls them through `pallas_kernels.ops`, which picks the kernel or the reference.
"""
import warnings

# Pallas announces at every Triton lowering that this backend is deprecated. It is the project's chosen GPU baseline
# (DESIGN.md section 6), so the warning is silenced here, in one place, for the whole package.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)
