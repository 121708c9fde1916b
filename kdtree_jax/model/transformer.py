"""The DeepSeek-V3 / Kimi K2.x decoder: embedding, MLA + (dense | MoE) layers, final norm, lm_head."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kdtree_jax.cache import KVCache, init_cache
from kdtree_jax.config import ModelConfig
from kdtree_jax.model.layers import GatedMLP, RMSNorm, dtype_of, fused_norm, init_weight, project
from kdtree_jax.model.mla import MLA
from kdtree_jax.model.moe import MoE
from kdtree_jax.model.parallel import STREAMS, TP, attention_plan, per_device, vocab_parallel_embed
from pallas_kernels import batch_invariant


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rngs: nnx.Rngs):
        dt = dtype_of(cfg.dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.self_attn = MLA(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        if layer_id < cfg.first_k_dense:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dt, rngs)
        else:
            self.mlp = MoE(cfg, rngs)

    def __call__(self, x, positions, c_cache, r_cache, prefix_len, visible, plan, absorbed, exact):
        norm = self.input_layernorm
        if exact:                              # the norm in q_a's and kv_a's products, the residual in o_proj's
            x, c_cache, r_cache = self.self_attn(x, positions, c_cache, r_cache, prefix_len, visible, plan=plan,
                                                 absorbed=absorbed, exact=True, input_norm=norm, residual=x)
        else:
            h, c_cache, r_cache = self.self_attn(norm(x), positions, c_cache, r_cache, prefix_len, visible, plan=plan,
                                                 absorbed=absorbed)
            x = x + h
        return x + self.mlp(self.post_attention_layernorm(x, exact=exact), exact=exact), c_cache, r_cache


class ForwardOutput(NamedTuple):
    logits: jnp.ndarray  # [S, T, V] f32
    cache: KVCache  # rows prefix_len .. prefix_len+T-1 written; `length` unchanged (the caller commits)
    hidden: tuple  # outputs of the requested layers, each [S, T, D]


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = dtype_of(cfg.dtype)
        embed = jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32) * 0.02
        self.embed_tokens = nnx.Param(embed.astype(dt))
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        if not cfg.tie_word_embeddings:
            self.lm_head = init_weight(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.hidden_size, dt)
        self.cfg = cfg

    def embed(self, tokens):
        """tokens [S, T] -> [S, T, D] (vocab-parallel under a mesh: `parallel.vocab_parallel_embed`)."""
        return vocab_parallel_embed(self.embed_tokens[...], tokens)

    def logits(self, hidden, *, exact: bool = False, norm: RMSNorm | None = None):
        """final-normed hidden [S, T, D] -> logits [S, T, V] in f32. norm: applied to hidden first (the forward passes
        its final norm, which the lm_head's kernel fuses: `project`)."""
        w = self.embed_tokens[...] if self.cfg.tie_word_embeddings else self.lm_head[...]   # [V, D]
        if exact:            # on each device's streams and vocabulary slice under a mesh
            def local(hidden, w):
                return batch_invariant.matmul(hidden, w, out_dtype=jnp.float32, **fused_norm(norm))
            return per_device(local, (hidden, w), (P(STREAMS), P(TP)), P(STREAMS, None, TP))
        return project(hidden, w, norm=norm, out_dtype=jnp.float32)

    def __call__(self, tokens, positions, cache: KVCache, visible, *, absorbed: bool = True,
                 hidden_layers: tuple = (), exact: bool = False) -> ForwardOutput:
        """Run a block of T tokens per stream against the cache (prefill chunk, AR step or tree verify).

        tokens, positions [S, T]; visible [S, T, T] bool (which block tokens each token sees besides the prefix).
        hidden_layers: ids of layers whose outputs to return (the drafter's context features).
        exact: each token row's cache latents, hidden states and logits bitwise independent of T, of the tree it
        sits in and of the other streams (`pallas_kernels.batch_invariant`; needs absorbed).
        """
        if exact and not absorbed:
            raise ValueError("exact=True needs the absorbed attention (absorbed=True)")
        x = self.embed(tokens)
        plan = attention_plan(cache.length, visible, self.cfg.num_heads) if absorbed else None   # once, all layers
        c_all, r_all, hidden = list(cache.c_kv), list(cache.k_rope), []
        for i, layer in enumerate(self.layers):
            x, c_all[i], r_all[i] = layer(x, positions, c_all[i], r_all[i], cache.length, visible, plan, absorbed,
                                          exact)
            if i in hidden_layers:
                hidden.append(x)
        logits = self.logits(x, exact=exact, norm=self.norm)
        return ForwardOutput(logits, KVCache(tuple(c_all), tuple(r_all), cache.length), tuple(hidden))

    def causal(self, tokens, *, absorbed: bool = True, hidden_layers: tuple = ()) -> ForwardOutput:
        """A causal forward of tokens [S, T] from an empty cache of capacity T (training, equivalence checks)."""
        s, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
        visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (s, t, t))
        return self(tokens, positions, init_cache(self.cfg, s, t), visible, absorbed=absorbed,
                    hidden_layers=hidden_layers)
