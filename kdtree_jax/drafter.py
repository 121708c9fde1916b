"""DFlash block-diffusion drafter (DESIGN.md section 4).

One forward drafts a whole block: the input is [bonus, MASK x (L-1)] at positions p .. p+L-1 and the output is the
L-1 per-position logits for positions p+1 .. p+L-1. The target's hidden states from `target_layer_ids` are
concatenated, projected (fc) and RMS-normed into one context feature per committed token; every drafter layer turns
that feature into extra keys/values (cached across rounds, one row per committed token). Attention inside the block is
non-causal. The drafter shares the target's embedding and lm_head (frozen; passed in, never copied).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kdtree_jax.cache import write_first_rows, write_rows
from kdtree_jax.config import DrafterConfig, ModelConfig
from kdtree_jax.model.layers import GatedMLP, RMSNorm, dtype_of, init_weight, project
from kdtree_jax.model.rope import plain_inv_frequencies, rotate_pairs


class DrafterCache(NamedTuple):
    """Context keys/values per drafter layer, [S, N, H_kv, hd] each; row j = committed token j (target cache rows)."""

    k: tuple
    v: tuple


class DrafterLayer(nnx.Module):
    """A pre-norm decoder layer: attention over [context K/V, block K/V] (non-causal), then a gated MLP.

    Grouped-query attention when cfg.kv_heads < cfg.num_heads: query head h reads K/V head h // (H / H_kv).
    Projections ([out..., in], `layers.project`): q_proj [H, hd, D], k_proj / v_proj [H_kv, hd, D], o_proj
    [D, H, hd]; q_norm / k_norm over hd.
    """

    def __init__(self, cfg: DrafterConfig, dtype, rngs: nnx.Rngs):
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.q_proj = init_weight(rngs, (h, hd, d), d, dtype)
        self.k_proj = init_weight(rngs, (kvh, hd, d), d, dtype)
        self.v_proj = init_weight(rngs, (kvh, hd, d), d, dtype)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.o_proj = init_weight(rngs, (d, h, hd), h * hd, dtype)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.mlp = GatedMLP(d, cfg.intermediate_size, dtype, rngs)
        self.cfg = cfg

    def _rope(self, x, positions):
        return rotate_pairs(x, positions, plain_inv_frequencies(self.cfg.head_dim, self.cfg.rope_theta))

    def keys_values(self, x, positions):
        """x [S, T, D] -> k, v [S, T, H_kv, hd] (k normed and rotated)."""
        k = self.k_norm(project(x, self.k_proj[...]))
        return self._rope(k, positions), project(x, self.v_proj[...])

    def __call__(self, x, positions, ctx_k, ctx_v, ctx_len):
        """x [S, L, D] block, positions [S, L]; ctx_k/ctx_v [S, N, H_kv, hd] with ctx_len [S] valid rows."""
        h = self.input_layernorm(x)
        q = self._rope(self.q_norm(project(h, self.q_proj[...])), positions)
        k_blk, v_blk = self.keys_values(h, positions)
        k = jnp.concatenate([ctx_k.astype(k_blk.dtype), k_blk], axis=1)  # [S, N+L, H_kv, hd]
        v = jnp.concatenate([ctx_v.astype(v_blk.dtype), v_blk], axis=1)
        rows = jnp.arange(k.shape[1])
        n = ctx_k.shape[1]
        allowed = (rows[None, :] < ctx_len[:, None]) | (rows[None, :] >= n)  # [S, N+L]
        f32 = jnp.float32
        s, t, heads, hd = q.shape
        q = q.reshape(s, t, self.cfg.kv_heads, heads // self.cfg.kv_heads, hd)  # [S, L, H_kv, G, hd]
        scores = jnp.einsum("stkgd,snkd->stkgn", q.astype(f32), k.astype(f32)) * hd ** -0.5
        scores = jnp.where(allowed[:, None, None, None, :], scores, -jnp.inf)
        attn = jnp.einsum("stkgn,snkd->stkgd", jax.nn.softmax(scores, axis=-1), v.astype(f32))
        attn = attn.reshape(s, t, heads, hd).astype(x.dtype)
        o_proj = self.o_proj[...]
        x = x + project(attn.reshape(s, t, -1), o_proj.reshape(o_proj.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nnx.Module):
    def __init__(self, cfg: DrafterConfig, target_cfg: ModelConfig, rngs: nnx.Rngs):
        cfg.check_fits(target_cfg)
        dt = dtype_of(target_cfg.dtype)
        feat = len(cfg.target_layer_ids) * cfg.hidden_size
        self.fc = init_weight(rngs, (cfg.hidden_size, feat), feat, dt)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.layers = nnx.List([DrafterLayer(cfg, dt, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.cfg = cfg

    def context_features(self, hidden):
        """hidden: tuple of the target layers' outputs [S, T, D] (target_layer_ids order) -> [S, T, D]."""
        return self.hidden_norm(project(jnp.concatenate(hidden, axis=-1), self.fc[...]))

    def context_kv(self, hidden, positions):
        """Per-layer context K/V of T committed tokens: tuples of [S, T, H_kv, hd]."""
        feat = self.context_features(hidden)
        kv = [layer.keys_values(feat, positions) for layer in self.layers]
        return tuple(k for k, _ in kv), tuple(v for _, v in kv)

    def init_cache(self, num_streams: int, capacity: int) -> DrafterCache:
        shape = (num_streams, capacity, self.cfg.kv_heads, self.cfg.head_dim)
        dt = self.fc[...].dtype
        return DrafterCache(tuple(jnp.zeros(shape, dt) for _ in self.layers),
                            tuple(jnp.zeros(shape, dt) for _ in self.layers))

    def extend_cache(self, cache: DrafterCache, hidden, positions, offsets, count=None) -> DrafterCache:
        """Write the context K/V of new committed tokens (hidden [S, T, D] per target layer) at rows offsets[s]...;
        count [S]: only the first count[s] rows of each stream (the rest are dropped), default all T."""
        k_new, v_new = self.context_kv(hidden, positions)
        if count is None:
            write = write_rows
        else:
            write = lambda c, x, o: write_first_rows(c, x, o, count)  # noqa: E731
        return DrafterCache(tuple(write(c, k, offsets) for c, k in zip(cache.k, k_new)),
                            tuple(write(c, v, offsets) for c, v in zip(cache.v, v_new)))

    def draft(self, embed, lm_head, bonus, start, cache: DrafterCache, ctx_len):
        """Draft logits [S, L-1, V] (f32) for positions start+1 .. start+L-1 of the block [bonus, MASK...].

        embed: tokens [S, L] -> [S, L, D] (the target's); lm_head: final-normed [S, L, D] -> logits (the target's).
        bonus [S]; start [S] the bonus position; cache rows < ctx_len [S] are the committed context.
        """
        size = self.cfg.block_size
        block = jnp.full((bonus.shape[0], size), self.cfg.mask_token_id, jnp.int32).at[:, 0].set(bonus)
        positions = start[:, None] + jnp.arange(size)[None, :]
        return self.block_logits(embed, lm_head, block, positions, cache, ctx_len)[:, 1:]

    def block_logits(self, embed, lm_head, block, positions, cache: DrafterCache, ctx_len):
        """All L logits of a block [S, L] at positions [S, L] (training uses this directly)."""
        x = embed(block)
        for layer, k, v in zip(self.layers, cache.k, cache.v):
            x = layer(x, positions, k, v, ctx_len)
        return lm_head(self.norm(x))
