"""int4_moe at large M through the Mosaic GPU block matmul (`int4_matmul_mgpu`), on the Triton kernels' weights
(`Int4Experts`, read as int4 positions: a bitcast, no second copy): route the pairs into blocks of
`config.block_tokens` tokens (XLA), gather x into the pairs' order by expert with its columns in the weights' position
order (each block reads a run of it, each expert's run aligned to 8 rows: `runs_by_expert`), one kernel for
h^T = silu(x W_gate^T) * (x W_up^T) (the gated product, bf16 out, as the Triton kernels' h), h^T's rows permuted into
down's position order (XLA), one kernel for down on it writing y [R, D] (tokens-major), then the weighted sum of each
token's pair rows (the Triton int4_moe's combine kernel, weighted; XLA on the CPU).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import int4_moe as ref
from pallas_kernels import int4_moe_triton as moe_triton
from pallas_kernels.int4_matmul_mgpu import (CONSUMERS, ROWS_PER_WG, START_MULTIPLE, MgpuMatmulConfig,
                                             int4_block_matmul)
from pallas_kernels.triton_call import LAUNCHERS, triton_call

XLA_GATHER = "xla_gather"      # int4_moe's combine in XLA (one row gather per slot), for the CPU
DENSE_PAIRS_PER_EXPERT = 40    # from here on the op's kernels are these (`prefers`): the GEMMs are dense


def fits(x, experts: ref.Int4Experts) -> bool:
    """Whether `int4_moe` takes these operands: bf16 x, and N of both GEMMs (I, D) whole tiles of 128 rows."""
    rows = CONSUMERS * ROWS_PER_WG
    return x.dtype == jnp.bfloat16 and experts.intermediate_size % rows == 0 and experts.hidden_size % rows == 0


def prefers(num_pairs: int, num_experts: int) -> bool:
    """Whether this op, not the Triton one, is int4_moe's kernel for this many (token, slot) pairs: from
    DENSE_PAIRS_PER_EXPERT pairs per routed expert on average (M >= 1920 at K2.6). Measured at K2.6 (kernels.md,
    "Sixteenth session"): M=4096 (85 per expert) 8.09 against 9.93 ms; M=2048 (43) 6.05 against 6.75; M=1024 (21)
    5.84 against 3.75; M <= 256 1.7-1.9x slower."""
    return num_pairs >= DENSE_PAIRS_PER_EXPERT * num_experts


def default_config(num_pairs: int, num_experts: int) -> MgpuMatmulConfig:
    """Tokens per block (wgmma's N) by the pairs per routed expert on average: 32 below 16 (one token still pads to
    32), 64 below 48 (M=2048 at K2.6: 6.05 ms), 96 from there (M=4096: 8.07 ms against 9.01 at 128 and 11.66 at 64,
    kernels.md, "Sixteenth session"). Under expert parallelism num_experts is the routing's (all devices'): `ops`
    passes the config so."""
    per_expert = num_pairs / num_experts
    return MgpuMatmulConfig(block_tokens=32 if per_expert < 16 else 64 if per_expert < 48 else 96)


@functools.partial(jax.jit, static_argnames=("config", "down_config", "combine", "a_in_shared"))
def int4_moe(x, experts: ref.Int4Experts, topk_ids, topk_weights, *, config: MgpuMatmulConfig | None = None,
             down_config: MgpuMatmulConfig | None = None, combine: str = moe_triton.LAUNCHER,
             a_in_shared: bool = False):
    """x bf16 [M, D], topk_ids [M, K] int, topk_weights [M, K] -> [M, D] bf16: `int4_moe_reference`'s semantics
    (ids outside [0, E) contribute nothing). config: gate_up's block matmul (None: `default_config`; its block_tokens
    the routing's; the gated product already holds two accumulators per warpgroup at 64 rows); down_config: down's
    (default: config with 128 rows per warpgroup, two accumulators of its one product, where D is a multiple of 256);
    combine: the Triton launcher (`triton_call.LAUNCHERS`) of the weighted sum of each token's pairs
    (`int4_moe_triton.combine_pairs`), or XLA_GATHER (`combine_pairs_xla`, the CPU's; ~10x slower on the H200);
    a_in_shared: `int4_block_matmul`'s (True for interpret mode)."""
    if combine not in (*LAUNCHERS, XLA_GATHER):
        raise ValueError(f"combine={combine!r} must be one of {(*LAUNCHERS, XLA_GATHER)}")
    d = experts.hidden_size
    config = config or default_config(topk_ids.size, experts.num_experts)
    if down_config is None:
        wide = d % (CONSUMERS * 2 * ROWS_PER_WG) == 0
        down_config = dataclasses.replace(config, rows_per_wg=(2 if wide else 1) * ROWS_PER_WG)
    if down_config.block_tokens != config.block_tokens:
        raise ValueError(f"down_config.block_tokens={down_config.block_tokens} must equal config.block_tokens="
                         f"{config.block_tokens} (one routing serves both)")
    if x.dtype != jnp.bfloat16 or x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"x must be bfloat16 [M, D={d}], got {x.dtype} {x.shape}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {topk_ids.shape} and topk_weights {topk_weights.shape} must both be "
                         f"[M={x.shape[0]}, top_k]")
    num_experts = experts.num_experts
    routing = ref.route_pairs(topk_ids, topk_weights, num_experts, config.block_tokens)
    tokens_of_rows, block_start = runs_by_expert(routing, topk_ids.shape[1], config.block_tokens)
    as_positions = lambda packed, scale: (ref.int4_positions(packed), scale.astype(jnp.bfloat16))   # the bitcast
    h_t = int4_block_matmul(ref.inputs_to_positions(x)[tokens_of_rows], routing.block_expert,
                            *as_positions(experts.gate_packed, experts.gate_scale),
                            as_positions(experts.up_packed, experts.up_scale), block_start, config=config,
                            a_in_shared=a_in_shared)                          # bf16 [I, R]
    y = int4_block_matmul(ref.inputs_to_positions(h_t, axis=0), routing.block_expert,
                          *as_positions(experts.down_packed, experts.down_scale), acts_k_major=True,
                          tokens_major_out=True, config=down_config, a_in_shared=a_in_shared)   # bf16 [R, D]
    pairs = (routing.pair_row_or_none(), y, topk_ids.shape, x.dtype, topk_weights.reshape(-1))   # one for both
    if combine == XLA_GATHER:
        return combine_pairs_xla(*pairs)
    return moe_triton.combine_pairs(functools.partial(triton_call, launcher=combine), *pairs)


def runs_by_expert(routing: ref.Routing, top_k: int, block_tokens: int):
    """The rows gate_up reads instead of a gather into block order: (tokens_of_rows int32 [M K + 8 E + block_tokens],
    block_start int32 [B]). Each expert's run of pairs starts at a multiple of START_MULTIPLE rows (the block matmul's
    alignment) and its blocks follow each other in it, so block b reads its block_tokens rows from block_start[b];
    rows between runs and past the last repeat token 0 and land in no pair's column."""
    num_pairs, num_experts = routing.pair_row.shape[0], routing.expert_pairs.shape[0]
    padded = -(-routing.expert_pairs // START_MULTIPLE) * START_MULTIPLE
    blocks = -(-routing.expert_pairs // block_tokens)
    e = jnp.minimum(routing.block_expert, num_experts - 1)
    block_of_run = jnp.arange(e.shape[0]) - (jnp.cumsum(blocks) - blocks)[e]
    block_start = jnp.where(routing.block_expert < num_experts,
                            (jnp.cumsum(padded) - padded)[e] + block_of_run * block_tokens, 0).astype(jnp.int32)
    rows = num_pairs + START_MULTIPLE * num_experts + block_tokens
    dest = jnp.where(routing.pair_ok, block_start[routing.pair_row // block_tokens] + routing.pair_row % block_tokens,
                     rows)                                             # other devices' pairs: dropped
    tokens_of_rows = jnp.zeros(rows, jnp.int32).at[dest].set(jnp.arange(num_pairs, dtype=jnp.int32) // top_k,
                                                             mode="drop")
    return tokens_of_rows, block_start


def combine_pairs_xla(pair_row, y, topk_shape: tuple[int, int], out_dtype, pair_weight):
    """`int4_moe_triton.combine_pairs` (weighted) in XLA: one gather of whole rows of y [R, D] per slot, added in slot
    order; a pair of row -1 adds nothing (its weight is not read)."""
    m, top_k = topk_shape
    ok = (pair_row >= 0).reshape(m, top_k)
    rows = jnp.where(ok, pair_row.reshape(m, top_k), 0)
    weights = jnp.where(ok, pair_weight.reshape(m, top_k).astype(jnp.float32), 0.0)
    out = jnp.zeros((m, y.shape[1]), jnp.float32)
    for slot in range(top_k):
        out = out + weights[:, slot, None] * jnp.where(ok[:, slot, None], y[rows[:, slot]].astype(jnp.float32), 0.0)
    return out.astype(out_dtype)
