"""The INT4 layout (pallas_kernels/int4_layout.py) against words computed by hand and against the compressed-tensors
library's own packer (tests/fixtures/int4_pack_quantized.safetensors, written by tests/fixtures/make_int4_fixture.py):
round trips through our own inverse cannot tell a wrong nibble order from the right one, these can."""
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from pallas_kernels import int4_layout

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "int4_pack_quantized.safetensors")

# value k = 8j + i lives in word j, bits [4i, 4i + 4), stored as q + 8: the first value is the lowest nibble.
HAND_WORDS = [
    ([-8, -7, -6, -5, -4, -3, -2, -1], 0x76543210),
    ([7, 6, 5, 4, 3, 2, 1, 0], 0x89ABCDEF - 2**32),
    ([0, 0, 0, 0, 0, 0, 0, 0], 0x88888888 - 2**32),
    ([1, 0, 0, 0, 0, 0, 0, 0], 0x88888889 - 2**32),
    ([0, 0, 0, 0, 0, 0, 0, -8], 0x08888888),
]


@pytest.mark.parametrize("q,word", HAND_WORDS)
def test_hand_computed_words(q, word):
    packed = int4_layout.pack_int4(np.asarray([q], np.int8))
    assert packed.dtype == np.int32 and packed.tolist() == [[word]]
    np.testing.assert_array_equal(np.asarray(int4_layout.unpack_int4(np.asarray([[word]], np.int32))), [q])


@pytest.fixture(scope="module")
def library():
    return load_file(FIXTURE)


def test_pack_equals_compressed_tensors(library):
    np.testing.assert_array_equal(int4_layout.pack_int4(library["q"]), library["weight_packed"])
    np.testing.assert_array_equal(np.asarray(int4_layout.unpack_int4(library["weight_packed"])), library["q"])
    assert library["weight_shape"].tolist() == [list(library["q"].shape[1:])] * library["q"].shape[0]


def test_dequantize_equals_compressed_tensors(library):
    packed, scale = library["weight_packed"], jnp.asarray(library["weight_scale"])
    np.testing.assert_array_equal(np.asarray(int4_layout.dequantize_int4(packed, scale, dtype=jnp.float32)),
                                  library["weight"])
    np.testing.assert_array_equal(np.asarray(int4_layout.dequantize_int4(packed, scale, dtype=jnp.bfloat16)),
                                  np.asarray(jnp.asarray(library["decompressed"])))
