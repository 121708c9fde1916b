"""FlashMLA's sm90 dense decode (bf16) as a peer of the tree-verify attention op: its extension loaded from
`build_flashmla.sh`'s output, the op's inputs in FlashMLA's layout, and one call. Used by
experiments/kernels/attention_flashmla.py (timing) and experiments/kernels/profile_attention.py (Nsight Compute).

FlashMLA attends the prefix and the T nodes under its causal mask, which is the ancestor mask of a chain of T nodes
(`chain_visible`); its page block is the op's cache block (PAGE rows).
"""
from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np

PAGE = 64          # FlashMLA's page block size (its only one), the op's cache block
LATENT = 512       # the value width FlashMLA takes (the c_kv part of a 576-wide cache row)


def load(directory: str):
    """The `flashmla_decode` extension built into directory; ImportError naming the fix if it is not there."""
    sys.path.insert(0, os.path.abspath(directory))
    try:
        import flashmla_decode   # noqa: PLC0415 (built on the GPU machine, not a dependency)
    except ImportError as e:
        raise ImportError(f"no flashmla_decode extension in {directory} ({e}); build it with "
                          "experiments/peers/build_flashmla.sh SRC_TARBALL OUT_DIR") from e
    return flashmla_decode


def chain_visible(streams: int, nodes: int) -> np.ndarray:
    """visible [S, T, T]: node i sees nodes 0..i, the tree FlashMLA's causal mask describes."""
    return np.broadcast_to(np.tril(np.ones((nodes, nodes), bool)), (streams, nodes, nodes))


def inputs(torch, args) -> tuple:
    """The op's inputs (q_lat [S, T, H, 512], q_rope [S, T, H, 64], c_kv [S, N', 512], k_rope [S, N', 64],
    prefix_len [S], ...) as FlashMLA's, on the GPU: q [S, T, H, 576], a paged cache [S N' / 64, 64, 1, 576]
    (stream s in blocks s N' / 64 onwards), seqlens [S] = prefix_len + T and the block table [S, N' / 64]."""
    q_lat, q_rope, c_kv, k_rope, prefix_len = args[:5]
    streams, rows = c_kv.shape[:2]
    q = jnp.concatenate([q_lat, q_rope], axis=-1)
    cache = jnp.concatenate([c_kv, k_rope], axis=-1).reshape(streams * rows // PAGE, PAGE, 1, -1)
    q, cache = (torch.from_numpy(np.asarray(x).view(np.uint16)).view(torch.bfloat16).cuda() for x in (q, cache))
    blocks = torch.arange(cache.shape[0], dtype=torch.int32, device="cuda").reshape(streams, rows // PAGE)
    seqlens = torch.tensor(np.asarray(prefix_len) + q.shape[1], dtype=torch.int32, device="cuda")
    return q, cache, seqlens, blocks


def decode(fm, peer_inputs: tuple, scale: float, meta=None, splits=None) -> tuple:
    """One FlashMLA call on `inputs`' tuple: (out [S, T, H, 512], lse, scheduler metadata, split offsets). Without
    meta and splits FlashMLA's scheduler kernel makes them first; a decode step makes them once and passes them."""
    q, cache, seqlens, blocks = peer_inputs
    return fm.dense_decode_fwd(q, cache, LATENT, seqlens, blocks, scale, True, meta, splits)
