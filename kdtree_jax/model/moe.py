"""Sparse MoE: sigmoid router with selection-only correction bias, routed experts, shared expert.

Router (DeepSeek-V3 `noaux_tc`, n_group = 1): scores = sigmoid(x . W_gate) in f32; the top-k experts are chosen by
scores + e_score_correction_bias; their weights are the UNBIASED scores, normalised to sum 1 (norm_topk_prob), times
routed_scaling_factor.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kdtree_jax.config import ModelConfig
from kdtree_jax.model.layers import GatedMLP, dtype_of, gated_mlp, init_weight, project
from pallas_kernels.int4_layout import NIBBLES_PER_WORD
from kdtree_jax.model.parallel import STREAMS, expert_parallel, per_device
from pallas_kernels import batch_invariant, ops
from pallas_kernels.int4_moe import Int4Experts
from pallas_kernels.router_topk import router_topk_reference


def route(x, gate_w, bias, cfg: ModelConfig, *, exact: bool = False):
    """x [M, D], gate_w [E, D], bias [E] -> (ids [M, k] int32, weights [M, k] f32): the product in f32 (exact:
    `batch_invariant.matmul`), then the sigmoid, the top-k and the weights (`router_topk_reference`, or its one-kernel
    form where `ops.router_takes` and no mesh shards the call: `ops.unpartitioned`)."""
    x32, w32 = x.astype(jnp.float32), gate_w.astype(jnp.float32)
    if exact:                # on each device's tokens under a mesh (the router is replicated)
        logits = per_device(batch_invariant.matmul, (x32, w32), (P(STREAMS), P()), P(STREAMS))
    else:
        logits = project(x32, w32)
    args = (logits, bias.astype(jnp.float32), cfg.num_experts_per_tok)
    kw = dict(normalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
    if ops.unpartitioned() and ops.router_takes():
        return ops.router_topk(*args, **kw)
    return router_topk_reference(*args, **kw)


def routed_experts(x, w_gate, w_up, w_down, ids, weights):
    """Grouped GEMM over experts (sort by expert, ragged_dot, unsort, weighted sum).

    x [M, D]; w_gate, w_up [E, D, I]; w_down [E, I, D]; ids [M, k]; weights [M, k] -> [M, D] in x.dtype.
    An id outside [0, E) (an expert held by another device under expert parallelism) contributes zero: such pairs sort
    past the last group, which ragged_dot leaves out (their rows come back zero) instead of loading an expert with them.
    """
    num_experts = w_gate.shape[0]
    m, k = ids.shape
    flat = ids.reshape(-1)
    local = (flat >= 0) & (flat < num_experts)
    flat = jnp.where(local, flat, num_experts)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    xs = x[order // k]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, group_sizes, preferred_element_type=jnp.float32))
    h = h * jax.lax.ragged_dot(xs, w_up, group_sizes, preferred_element_type=jnp.float32)
    y = jax.lax.ragged_dot(h.astype(x.dtype), w_down, group_sizes, preferred_element_type=jnp.float32)
    y = jnp.zeros_like(y).at[order].set(y).reshape(m, k, -1)
    w = jnp.where(local, weights.reshape(-1), 0.0).reshape(m, k)
    return jnp.einsum("mkd,mk->md", y, w).astype(x.dtype)


class MoE(nnx.Module):
    """Routed experts (bf16 [E, D, I] / [E, I, D], or INT4) plus the shared expert(s)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = dtype_of(cfg.dtype)
        d, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.gate = init_weight(rngs, (e, d), d, jnp.float32)
        self.e_score_correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32))
        if cfg.expert_quant == "int4":
            experts = random_int4_experts(rngs, e, d, i, cfg.quant_group_size)
            for name, value in experts._asdict().items():
                setattr(self, name, nnx.Param(value))
        else:
            self.w_gate = init_weight(rngs, (e, d, i), d, dt)
            self.w_up = init_weight(rngs, (e, d, i), d, dt)
            self.w_down = init_weight(rngs, (e, i, d), i, dt)
        self.shared = GatedMLP(d, i * cfg.num_shared_experts, dt, rngs) if cfg.num_shared_experts else None
        self.cfg = cfg

    def int4_experts(self) -> Int4Experts:
        return Int4Experts(*(getattr(self, name)[...] for name in Int4Experts._fields))

    def experts(self, x, ids, weights, *, with_shared: bool = True, exact: bool = False):
        """The routed experts (INT4 through `ops.int4_moe`) plus, with_shared, the shared expert(s): x [M, D],
        ids / weights [M, k] -> [M, D].

        Under a mesh with tp > 1 (jax.set_mesh) they run expert-parallel, the shared expert's columns split, with one
        psum for both: `parallel.expert_parallel`. exact: every token's sums in one order, whatever shares its
        experts (`batch_invariant.routed_experts`, `batch_invariant.gated_mlp`).
        """
        if exact:
            return self._exact_experts(x, ids, weights, with_shared)
        if self.cfg.expert_quant == "int4":
            experts = self.int4_experts()
            local = lambda x, e, i, w: ops.int4_moe(x, e, i, w.astype(jnp.float32),  # noqa: E731
                                                    routed_experts=self.cfg.num_experts)
        else:
            experts = (self.w_gate[...], self.w_up[...], self.w_down[...])
            local = lambda x, e, i, w: routed_experts(x, *e, i, w)  # noqa: E731
        shared = (gated_mlp, self.shared.weights()) if with_shared and self.shared is not None else None
        return expert_parallel(local, x, experts, ids, weights, shared, routed_experts=self.cfg.num_experts)

    def _exact_experts(self, x, ids, weights, with_shared: bool):
        if self.cfg.expert_quant == "int4":
            experts = self.int4_experts()

            def expert_weights(experts, e):                 # the kernel layout [out, in] -> [in, out], f32
                one = jax.tree.map(lambda a: a[e][None], experts)
                return tuple(w[0].T for w in one.dequantize())
        else:
            experts = (self.w_gate[...], self.w_up[...], self.w_down[...])
            expert_weights = lambda experts, e: tuple(w[e] for w in experts)  # noqa: E731

        def local(x, experts, ids, weights):
            held = jax.tree.leaves(experts)[0].shape[0]
            int4 = self.cfg.expert_quant == "int4"
            return batch_invariant.routed_experts(x, lambda e: expert_weights(experts, e), held, ids, weights,
                                                  stacked=None if int4 else experts, int4=experts if int4 else None)

        shared = (batch_invariant.gated_mlp, self.shared.weights()) if with_shared and self.shared is not None else None
        return expert_parallel(local, x, experts, ids, weights, shared, routed_experts=self.cfg.num_experts,
                               in_device_order=True)

    def route(self, flat, *, exact: bool = False):
        """flat [M, D] -> (ids [M, k] int32, weights [M, k] f32). A method, so that `nnx.capture(...,
        method_outputs=nnx.Intermediate)` records each layer's routing (training's expert loads, bench_k26)."""
        return route(flat, self.gate[...], self.e_score_correction_bias[...], self.cfg, exact=exact)

    def __call__(self, x, *, exact: bool = False):
        """x [S, T, D] -> [S, T, D]. exact: every token row's result independent of the others (`batch_invariant`)."""
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = self.route(flat, exact=exact)
        return self.experts(flat, ids, weights, exact=exact).reshape(x.shape)


def random_int4_experts(rngs: nnx.Rngs, num_experts: int, hidden: int, inter: int, group: int) -> Int4Experts:
    """Random INT4 experts made directly in packed form (any int32 word is 8 valid nibbles), repacked once.

    Scales give each weight a std of about fan_in^-0.5, like the bf16 init.
    """
    def linear(out_dim, in_dim):
        packed = jax.random.bits(rngs.params(), (num_experts, out_dim, in_dim // NIBBLES_PER_WORD), jnp.uint32)
        scale = jnp.full((num_experts, out_dim, in_dim // group), in_dim ** -0.5 / 4.6, jnp.bfloat16)
        return jax.lax.bitcast_convert_type(packed, jnp.int32), scale

    gate, up, down = linear(inter, hidden), linear(inter, hidden), linear(hidden, inter)
    return Int4Experts.from_compressed_tensors(*gate, *up, *down)
