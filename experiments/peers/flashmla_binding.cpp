// The one entry of FlashMLA's extension that experiments/kernels/attention_flashmla.py times: its sm90 dense decode
// (bf16), declared by FlashMLA's own api/dense_decode.h. Built by build_flashmla.sh.
#include <pybind11/pybind11.h>

#include "api/dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
