#!/bin/bash
# Builds FlashMLA's sm90 dense decode (bf16) into a Python extension, `flashmla_decode`, the peer of
# experiments/kernels/attention_flashmla.py. FlashMLA is not a dependency of the project and nothing here downloads it:
# bring its sources as a tarball of FlashMLA's csrc/ with CUTLASS's include/ and tools/util/include/ under
# csrc/cutlass/ (FlashMLA 9241ae3 and its CUTLASS submodule, 147f567, were measured), e.g. from local clones:
#
#   mkdir src && git -C FlashMLA archive HEAD csrc | tar x -C src
#   mkdir -p src/csrc/cutlass && git -C cutlass archive 147f567 include tools/util/include | tar x -C src/csrc/cutlass
#   tar czf .peers/flashmla_src.tar.gz -C src csrc
#
# Usage (on a Hopper GPU machine with nvcc and PyTorch): build_flashmla.sh SRC_TARBALL OUT_DIR
# OUT_DIR then holds flashmla_decode*.so; put it on PYTHONPATH.
set -euo pipefail
tarball=${1:?usage: build_flashmla.sh SRC_TARBALL OUT_DIR}
out=${2:?usage: build_flashmla.sh SRC_TARBALL OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out/src" "$out/obj"
tar xzf "$tarball" -C "$out/src"
src="$out/src/csrc"
flags=(-O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -DFLASH_MLA_DISABLE_FP16 -Wno-deprecated-declarations
       -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__
       -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math
       -gencode arch=compute_90a,code=sm_90a -Xcompiler -fPIC)
includes=(-I"$src" -I"$src/kerutils/include" -I"$src/sm90" -I"$src/cutlass/include" -I"$src/cutlass/tools/util/include")
objects=()
for unit in sm90/decode/dense/instantiations/bf16.cu smxx/decode/combine/combine.cu \
            smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu; do
  obj="$out/obj/$(basename "${unit%.cu}").o"
  objects+=("$obj")
  [ -s "$obj" ] && continue      # built by an earlier run into the same OUT_DIR
  nvcc "${flags[@]}" "${includes[@]}" -c "$src/$unit" -o "$obj" &
done
wait
for obj in "${objects[@]}"; do [ -s "$obj" ] || { echo "build_flashmla.sh: $obj was not built" >&2; exit 1; }; done
python3 - "$here/flashmla_binding.cpp" "$out" "$src" "${objects[@]}" <<'PY'
import os
import sys
from torch.utils import cpp_extension
binding, out, src, *objects = sys.argv[1:]
cpp_extension.load(name="flashmla_decode", sources=[binding], build_directory=out, verbose=False,
                   extra_cflags=["-O3", "-std=c++20", "-DFLASH_MLA_DISABLE_FP16"],
                   extra_include_paths=[src, f"{src}/kerutils/include", f"{src}/sm90", f"{src}/cutlass/include",
                                        os.path.join(cpp_extension.CUDA_HOME, "include", "cccl")],  # CUDA 13's libcu++
                   extra_ldflags=objects, with_cuda=True)
print(f"build_flashmla.sh: built {out}/flashmla_decode.so")
PY
