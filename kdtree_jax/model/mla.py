"""Multi-head latent attention (DeepSeek-V3 MLA) with a naive and an absorbed path over the latent KV cache.

Per token the cache keeps c_kv [C] (after kv_a_layernorm) and k_rope [R] (after RoPE); C = kv_lora_rank, R =
qk_rope_head_dim. Weights (the products' stored [out..., in], HF's Linear layout, `layers.project`):
  q_a_proj [Q, D], q_a_norm [Q], q_b_proj [H, P+R, Q]   (or q_proj [H, P+R, D] when q_lora_rank is None)
  kv_a_proj [C+R, D], kv_a_norm [C], o_proj [D, H, V]
and kv_b_proj [C, H, P+V] (the absorbed path's per-head operand, stored [in, H, out]), with P = qk_nope_head_dim and
V = v_head_dim. kv_b_proj splits into W_UK [C, H, P] and W_UV [C, H, V].
Naive: decompress every cached row to per-head K/V. Absorbed (decode, tree verify): q_lat = q_nope . W_UK^T lives in
the C-wide latent space, scores = q_lat . c_kv + q_rope . k_rope, out_lat = p . c_kv, out = out_lat . W_UV.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kdtree_jax.cache import write_rows
from kdtree_jax.config import ModelConfig
from kdtree_jax.model.layers import RMSNorm, dtype_of, fused_norm, init_weight, project
from kdtree_jax.model.rope import apply_rope
from kdtree_jax.model.parallel import STREAMS, TP, head_parallel, head_parallel_product, per_device, tp_size
from pallas_kernels import batch_invariant, ops
from pallas_kernels.tree_verify_attention import block_attention_mask

ON_HEADS = P(STREAMS, None, TP, None)   # [S, T, H, *]: the exact products' per-head activations under a mesh
Q_HEADS_W = P(TP, None, None)           # q_proj / q_b_proj [H, P + R, *]: split on heads
KV_B_W = P(None, TP, None)              # kv_b_proj [C, H, P + V]: split on heads


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = dtype_of(cfg.dtype)
        d, h, c, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = init_weight(rngs, (cfg.q_lora_rank, d), d, dt)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps, dt)
            self.q_b_proj = init_weight(rngs, (h, cfg.qk_head_dim, cfg.q_lora_rank), cfg.q_lora_rank, dt)
        else:
            self.q_proj = init_weight(rngs, (h, cfg.qk_head_dim, d), d, dt)
        self.kv_a_proj = init_weight(rngs, (c + r, d), d, dt)
        self.kv_a_norm = RMSNorm(c, cfg.latent_norm_eps, dt)
        self.kv_b_proj = init_weight(rngs, (c, h, cfg.qk_nope_head_dim + cfg.v_head_dim), c, dt)
        self.o_proj = init_weight(rngs, (d, h, cfg.v_head_dim), h * cfg.v_head_dim, dt)
        self.cfg = cfg

    def queries(self, x, positions, *, exact: bool = False, input_norm=None):
        """x [S, T, D], positions [S, T] -> q_nope [S, T, H, P], q_rope [S, T, H, R] (rotated). exact: every row's
        sums in one order (`batch_invariant.matmul`, on each device's shards under a mesh: q_a replicated, q_b split
        on heads), with input_norm (an RMSNorm, or None) applied to x in the first product's prologue."""
        if exact:
            q = self._exact_queries(x, input_norm)
        elif self.cfg.q_lora_rank:
            q = project(project(x, self.q_a_proj[...]), self.q_b_proj[...], norm=self.q_a_norm)
        else:
            q = project(x, self.q_proj[...])
        p = self.cfg.qk_nope_head_dim
        return q[..., :p], apply_rope(q[..., p:], positions, self.cfg)

    def _exact_queries(self, x, input_norm):
        """`queries`' products in the exact mode -> q [S, T, H, P + R] (`parallel.per_device`; the norms' weights,
        replicated, closed over)."""
        def heads(y, w, **norm):
            return batch_invariant.matmul(y, w.reshape(-1, w.shape[-1]), **norm).reshape(*y.shape[:-1], *w.shape[:-1])
        if self.cfg.q_lora_rank:      # q_a_norm in q_b's product
            def local(x, q_a, q_b):
                q = batch_invariant.matmul(x, q_a, **fused_norm(input_norm))
                return heads(q, q_b, **fused_norm(self.q_a_norm))
            args, specs = (x, self.q_a_proj[...], self.q_b_proj[...]), (P(STREAMS), P(), Q_HEADS_W)
        else:
            def local(x, q_proj):
                return heads(x, q_proj, **fused_norm(input_norm))
            args, specs = (x, self.q_proj[...]), (P(STREAMS), Q_HEADS_W)
        return per_device(local, args, specs, ON_HEADS)

    def latents(self, x, positions, *, exact: bool = False, input_norm=None):
        """x [S, T, D] -> c_kv [S, T, C] (normed), k_rope [S, T, R] (rotated): what the cache stores. input_norm:
        as in `queries` (exact only; kv_a and its norm on each device's streams under a mesh)."""
        c = self.cfg.kv_lora_rank
        if exact:
            def local(x, kv_a):
                kv = batch_invariant.matmul(x, kv_a, **fused_norm(input_norm))
                return self.kv_a_norm(kv[..., :c], exact=True), kv[..., c:]
            c_kv, k_rope = per_device(local, (x, self.kv_a_proj[...]), (P(STREAMS), P()), (P(STREAMS), P(STREAMS)))
        else:
            kv = project(x, self.kv_a_proj[...])
            c_kv, k_rope = self.kv_a_norm(kv[..., :c]), kv[..., c:]
        return c_kv, apply_rope(k_rope, positions, self.cfg)

    def __call__(self, x, positions, c_cache, r_cache, prefix_len, visible, *, plan=None, absorbed: bool = True,
                 exact: bool = False, input_norm=None, residual=None):
        """One block of T tokens per stream.

        x [S, T, D]; positions [S, T]; c_cache [S, N, C], r_cache [S, N, R]; prefix_len [S]; visible [S, T, T];
        plan: the forward's `parallel.attention_plan` (the absorbed path's; None: made in this call).
        The block's latents are written to rows prefix_len .. prefix_len+T-1, then every token attends to the
        stream's prefix and to its visible block rows. Returns (out [S, T, D], c_cache, r_cache).
        exact: every token row's result independent of the block and the other streams (`batch_invariant`; the
        absorbed path); input_norm: the layer's input RMSNorm, not yet applied to x, fused into q_a's and kv_a's
        products; residual [S, T, D]: added to out in o_proj's epilogue (exact only: the default path takes x normed
        and leaves the residual to its caller).
        """
        cfg = self.cfg
        if exact:
            return self._exact(x, positions, c_cache, r_cache, prefix_len, visible, plan, input_norm, residual)
        if input_norm is not None or residual is not None:
            raise ValueError("MLA: input_norm and residual are fused in the exact path only; pass x normed and add "
                             "the residual to out")
        c_new, r_new = self.latents(x, positions)
        c_cache = write_rows(c_cache, c_new, prefix_len)
        r_cache = write_rows(r_cache, r_new, prefix_len)
        q_nope, q_rope = self.queries(x, positions)
        w_uk = self.kv_b_proj[..., :cfg.qk_nope_head_dim]  # [C, H, P]
        w_uv = self.kv_b_proj[..., cfg.qk_nope_head_dim:]  # [C, H, V]
        if absorbed:
            q_lat = jnp.einsum("sthp,chp->sthc", q_nope, w_uk)
            attention = functools.partial(ops.tree_verify_attention, scale=cfg.softmax_scale)
            out_lat = head_parallel(attention, q_lat, q_rope.astype(q_lat.dtype), c_cache, r_cache, prefix_len,
                                    visible, plan)
            out = jnp.einsum("sthc,chv->sthv", out_lat, w_uv)
        else:
            out = naive_attention(q_nope, q_rope, c_cache, r_cache, w_uk, w_uv,
                                  block_attention_mask(prefix_len, visible, c_cache.shape[1]), cfg.softmax_scale)
        o_proj = self.o_proj[...]                                                       # [D, H, V]
        out = project(out.astype(x.dtype).reshape(*out.shape[:-2], -1), o_proj.reshape(o_proj.shape[0], -1))
        return out, c_cache, r_cache

    def _exact(self, x, positions, c_cache, r_cache, prefix_len, visible, plan, input_norm, residual):
        """The absorbed path with `batch_invariant`'s products and attention."""
        cfg = self.cfg
        c_new, r_new = self.latents(x, positions, exact=True, input_norm=input_norm)
        c_cache = write_rows(c_cache, c_new, prefix_len)
        r_cache = write_rows(r_cache, r_new, prefix_len)
        q_nope, q_rope = self.queries(x, positions, exact=True, input_norm=input_norm)
        kv_b, nope = self.kv_b_proj[...], cfg.qk_nope_head_dim                        # [C, H, P + V]
        q_lat = per_device(functools.partial(batch_invariant.absorbed_head_matmul, nope=nope, key=True),
                           (q_nope, kv_b), (ON_HEADS, KV_B_W), ON_HEADS)                     # [S, T, H, C]
        attention = lambda *args: batch_invariant.attention(*args[:-1], scale=cfg.softmax_scale)  # noqa: E731
        out_lat = head_parallel(attention, q_lat, q_rope.astype(q_lat.dtype), c_cache, r_cache, prefix_len, visible,
                                plan)
        out = per_device(functools.partial(batch_invariant.absorbed_head_matmul, nope=nope, key=False),
                         (out_lat, kv_b), (ON_HEADS, KV_B_W), ON_HEADS)                      # [S, T, H, V]
        o_proj = self.o_proj[...]                                                       # [D, H, V]
        if tp_size(jax.sharding.get_abstract_mesh()) == 1:   # the residual in the product's epilogue
            def local(out, o_proj, *residual):
                return batch_invariant.matmul(out.reshape(*out.shape[:-2], -1), o_proj.reshape(o_proj.shape[0], -1),
                                              residual=residual[0] if residual else None)
            residual = () if residual is None else (residual,)
            out = per_device(local, (out.astype(x.dtype), o_proj, *residual),
                             (P(STREAMS), P(), *(P(STREAMS),) * len(residual)), P(STREAMS))
            return out, c_cache, r_cache
        product = functools.partial(batch_invariant.matmul, out_dtype=jnp.float32)
        out = head_parallel_product(product, out.astype(x.dtype), o_proj)                  # f32, over all heads
        out = out.astype(x.dtype) if residual is None else batch_invariant.add_residual(residual, out, x.dtype)
        return out, c_cache, r_cache


def naive_attention(q_nope, q_rope, c_cache, r_cache, w_uk, w_uv, mask, scale):
    """Decompress the latents to per-head K/V and attend. mask [S, T, N] -> [S, T, H, V] in f32."""
    f32 = jnp.float32
    k_nope = jnp.einsum("snc,chp->snhp", c_cache.astype(f32), w_uk.astype(f32))
    v = jnp.einsum("snc,chv->snhv", c_cache.astype(f32), w_uv.astype(f32))
    scores = (jnp.einsum("sthp,snhp->sthn", q_nope.astype(f32), k_nope)
              + jnp.einsum("sthr,snr->sthn", q_rope.astype(f32), r_cache.astype(f32))) * scale
    scores = jnp.where(mask[:, :, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("sthn,snhv->sthv", probs, v)
