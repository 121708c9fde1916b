"""The Pallas-Triton kernel (tree-verify attention, the last on that backend) lowers to a valid Triton module for an
H200, on the CPU, before any GPU time is spent.

The calls are traced at Kimi K2.6 shapes (abstract arrays: nothing is allocated) and lowered for "cuda" under an
abstract mesh whose device is an NVIDIA H200; each Triton module the Pallas lowering builds is checked with the MLIR
verifier (the check that failed on the GPU in the first kernel run: an `scf.for` with mixed bound types). The hook
on `lower_jaxpr_to_triton_module` is jax-internal, pinned with jax==0.11.2.
"""
import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import pallas_call_registration

from kdtree_jax import config as config_lib
from pallas_kernels import tree_verify_attention as A
from triton_h200 import lower_for_h200, spec

K26 = config_lib.kimi_k2_6()
BF16, I32, F32 = jnp.bfloat16, jnp.int32, jnp.float32


@pytest.fixture
def verified(monkeypatch) -> list:
    """The Triton modules built (each verified) while the test lowers its calls."""
    lowering = pallas_call_registration.lowering
    original, built = lowering.lower_jaxpr_to_triton_module, []

    def verify(*args, **kwargs):
        result = original(*args, **kwargs)
        assert result.module.operation.verify()
        built.append(result.module)
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", verify)
    return built


@pytest.mark.parametrize("streams,nodes,heads,prefix", [(1, 1, 8, 4096), (1, 1, 8, 32768), (1, 4, 8, 4096),
                                                        (2, 16, 8, 4096), (1, 33, 64, 4096), (1, 1, 64, 4096)])
def test_tree_verify_attention_lowers(verified, streams, nodes, heads, prefix):
    """The default tiling of each query-tile size (16, 32, 64 rows) with and without split-K."""
    lat, rope, n = K26.kv_lora_rank, K26.qk_rope_head_dim, prefix + nodes
    args = (spec((streams, nodes, heads, lat), BF16), spec((streams, nodes, heads, rope), BF16),
            spec((streams, n, lat), BF16), spec((streams, n, rope), BF16), spec((streams,), I32),
            spec((streams, nodes, nodes), jnp.bool_))
    text = lower_for_h200(lambda *a: A.tree_verify_attention(*a, scale=K26.softmax_scale), *args)
    assert len(verified) == 1 and text.count("__gpu$xla.gpu.triton") == 1
