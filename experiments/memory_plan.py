"""Bytes per device of a sharded DDTree deployment, from the config and the mesh (DESIGN.md section 5).

  python experiments/memory_plan.py                                   # Kimi K2.6 (INT4 experts), 8 x H200, B = 64
  python experiments/memory_plan.py --streams=32 --context=65536 --markdown

Weights: every param of the model's own abstract state, divided as the PartitionSpecs of kdtree_jax.sharding divide it
(so the plan is the layout the engine runs), summed by category; the drafter is replicated. Cache: the MLA latent
cache (C + R values per token per layer) is replicated over tp and split over data, as is the drafter's context K/V;
tree slots are the rows past the committed length that one round may touch (Decoder.validate's depth + tree rows).
Activations: an estimate of the live transient buffers of one verify step (B + 1 tokens per stream), as the engine's
code materializes them with the Pallas kernels on the GPU (no attention score matrix); persistent buffers plus the
largest phase. XLA fuses and reuses buffers, so read it as a budget, not a measurement.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from absl import flags
from flax import nnx

from kdtree_jax import cli
from kdtree_jax import config as config_lib
from kdtree_jax import sharding
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.layers import dtype_of
from kdtree_jax.model.transformer import Transformer
from pallas_kernels.int4_moe import Int4Experts
from pallas_kernels.int4_moe_triton import default_config

H200_HBM_BYTES = 143771 * 2 ** 20  # what nvidia-smi reports per H200 on the lent machines (KINDS.md)
GIB = 2 ** 30

ROUTED = ("w_gate", "w_up", "w_down") + Int4Experts._fields


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device. weights and activations by category; cache and tree slots in total."""

    weights: dict
    kv_bytes_per_token: int  # target latent cache + drafter context K/V, per token, on one device
    streams_per_device: int
    context: int  # committed cache rows per stream
    cache: int
    tree_rows: int  # rows per stream past the committed length
    tree_slots: int
    activations: dict
    hbm: int

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.cache + self.tree_slots + sum(self.activations.values())

    @property
    def max_context(self) -> int:
        """Committed rows per stream that fit in HBM beside everything else (at this stream count)."""
        free = self.hbm - (self.total - self.cache)
        return max(free, 0) // (self.streams_per_device * self.kv_bytes_per_token)

    def rows(self) -> list[tuple[str, int]]:
        rows = [(f"weights: {k}", v) for k, v in self.weights.items()]
        rows.append(("weights: total", sum(self.weights.values())))
        rows.append((f"KV cache: {self.streams_per_device} streams x {self.context} rows x "
                     f"{self.kv_bytes_per_token} B/token", self.cache))
        rows.append((f"tree slots: {self.streams_per_device} streams x {self.tree_rows} rows", self.tree_slots))
        rows += [(f"activations: {k}", v) for k, v in self.activations.items()]
        rows.append(("total", self.total))
        rows.append(("HBM", self.hbm))
        rows.append(("headroom", self.hbm - self.total))
        return rows


def weight_bytes(cfg: config_lib.ModelConfig, axis_sizes: dict) -> dict:
    """Target param bytes per device by category, from the abstract model and sharding.param_spec."""
    _, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
    out: dict = {}
    for path, leaf in nnx.to_flat_state(state):
        spec = sharding.param_spec(path, leaf.shape, axis_sizes)
        split = math.prod(axis_sizes[a] for a in spec if a is not None)
        category = _category(tuple(k for k in path if isinstance(k, str)))
        out[category] = out.get(category, 0) + _nbytes(leaf) // split
    return out


def _category(names: tuple) -> str:
    leaf = names[-1]
    if leaf in ("embed_tokens", "lm_head"):
        return leaf
    if "self_attn" in names:
        return "attention (MLA)"
    if "shared" in names:
        return "shared experts"
    if leaf in ("gate", "e_score_correction_bias"):
        return "router"
    if leaf in ROUTED:
        return "routed experts"
    return "dense MLP" if "mlp" in names else "norms"


def drafter_bytes(dcfg: config_lib.DrafterConfig, cfg: config_lib.ModelConfig) -> int:
    _, state = nnx.split(nnx.eval_shape(lambda: Drafter(dcfg, cfg, nnx.Rngs(0))))
    return sum(_nbytes(leaf) for _, leaf in nnx.to_flat_state(state))


def _nbytes(leaf) -> int:
    return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def memory_plan(cfg: config_lib.ModelConfig, *, tp: int = 8, data: int = 1, streams: int = 64, context: int = 8192,
                budget: int = 64, block_size: int = 16, drafter: config_lib.DrafterConfig | None = None,
                hbm: int = H200_HBM_BYTES) -> MemoryPlan:
    """The plan of `streams` streams of `context` committed rows each, DDTree with budget B and block size L."""
    sizes = dict(tp=tp, data=data, streams=streams, context=context, block_size=block_size - 1, budget=budget + 1)
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
        raise ValueError(f"sizes {bad} (block_size and budget shifted by 1 / -1) must be positive: tp, data, streams, "
                         f"context >= 1, budget >= 0, block_size >= 2")
    if streams % data:
        raise ValueError(f"{streams} streams do not divide over data = {data}")
    axis_sizes = {sharding.DATA: data, sharding.TP: tp}
    act = np.dtype(dtype_of(cfg.dtype)).itemsize
    weights = weight_bytes(cfg, axis_sizes)
    kv = cfg.cache_bytes_per_token_per_layer * cfg.num_layers
    if drafter is not None:
        weights["drafter (replicated)"] = drafter_bytes(drafter, cfg)
        kv += drafter.num_layers * 2 * drafter.kv_heads * drafter.head_dim * act
    s = streams // data
    depth = block_size - 1
    tree_rows = depth + max(budget, depth) + 1
    return MemoryPlan(weights=weights, kv_bytes_per_token=kv, streams_per_device=s, context=context,
                      cache=s * context * kv, tree_rows=tree_rows, tree_slots=s * tree_rows * kv,
                      activations=verify_activations(cfg, tp, s, budget, block_size, drafter), hbm=hbm)


def verify_activations(cfg: config_lib.ModelConfig, tp: int, streams: int, budget: int, block_size: int,
                       drafter: config_lib.DrafterConfig | None) -> dict:
    """Live transient bytes of one round on one device: the persistent buffers plus the largest phase."""
    act = np.dtype(dtype_of(cfg.dtype)).itemsize
    f32 = 4
    m = streams * (budget + 1)  # verify tokens on this device
    d, h = cfg.hidden_size, cfg.num_heads // tp
    hidden = len(drafter.target_layer_ids) if drafter is not None else 0
    pairs = m * cfg.num_experts_per_tok
    local_experts = cfg.num_experts // tp
    block_m = default_config(pairs, local_experts).block_m  # the int4 kernel sees every pair, local or not
    rows = (-(-pairs // block_m) + min(local_experts, pairs)) * block_m
    phases = {
        "attention": m * h * (cfg.qk_head_dim + 2 * cfg.kv_lora_rank + cfg.v_head_dim) * act + m * d * act,
        "routed experts (INT4 kernel)": (m * cfg.num_experts * 2 * f32 + rows * (cfg.moe_intermediate_size + d) * act
                                         + m * d * act),
        "dense MLP": 2 * m * (cfg.intermediate_size // tp) * act + m * d * act,
        "verify logits": m * (cfg.vocab_size // tp) * f32,
        "draft logits (gathered for the tree build)": streams * (block_size - 1) * cfg.vocab_size * f32,
    }
    largest = max(phases, key=phases.get)
    return {f"residual stream + {hidden} drafter features": (2 + hidden) * m * d * act,
            f"peak phase: {largest}": phases[largest]}


def format_table(plan: MemoryPlan, markdown: bool = False) -> str:
    if markdown:
        lines = ["| item | bytes per device | GiB |", "| --- | ---: | ---: |"]
        lines += [f"| {name} | {value:,} | {value / GIB:.2f} |" for name, value in plan.rows()]
    else:
        width = max(len(name) for name, _ in plan.rows())
        lines = [f"{name:<{width}}  {value:>18,}  {value / GIB:8.2f} GiB" for name, value in plan.rows()]
    lines.append(f"max committed rows per stream at {plan.streams_per_device} streams per device: "
                 f"{plan.max_context:,}")
    return "\n".join(lines)


FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    def d(define, name, default, help_text):
        define(name, default, help=help_text, flag_values=fv)
    d(flags.DEFINE_string, "config", "kimi_k2_6", f"model preset: {sorted(config_lib.PRESETS)}")
    d(flags.DEFINE_integer, "tp", 8, "tp axis of the mesh")
    d(flags.DEFINE_integer, "data", 1, "data axis of the mesh (hosts)")
    d(flags.DEFINE_integer, "streams", 64, "concurrent streams (all hosts)")
    d(flags.DEFINE_integer, "context", 8192, "committed cache rows per stream (prompt + generated)")
    d(flags.DEFINE_integer, "budget", 64, "DDTree budget B (non-root tree nodes; 0: ar)")
    d(flags.DEFINE_integer, "block_size", 16, "drafter block size L")
    d(flags.DEFINE_integer, "drafter_layers", 2, "layers of the assumed drafter (0: no drafter); K2.6's is not "
      "defined yet")
    d(flags.DEFINE_integer, "drafter_heads", 32, "heads of the assumed drafter")
    d(flags.DEFINE_integer, "drafter_head_dim", 128, "head dim of the assumed drafter")
    d(flags.DEFINE_bool, "markdown", False, "print a markdown table")


def check(f) -> tuple[config_lib.ModelConfig, config_lib.DrafterConfig | None]:
    """(target config, assumed drafter config or None) from the flags, every size checked before any model is
    built; a mesh that does not divide the model's split axes is refused here too."""
    if f.config not in config_lib.PRESETS:
        cli.refuse(f, "config", f"is not a preset; choose one of {sorted(config_lib.PRESETS)}")
    for name, minimum in (("tp", 1), ("data", 1), ("streams", 1), ("context", 1), ("budget", 0), ("block_size", 2),
                          ("drafter_layers", 0), ("drafter_heads", 1), ("drafter_head_dim", 2)):
        cli.at_least(f, name, minimum)
    if f.streams % f.data:
        cli.refuse(f, "streams", f"must be a multiple of --data={f.data} (streams are split over data)")
    if f.drafter_head_dim % 2:
        cli.refuse(f, "drafter_head_dim", "must be even (RoPE turns pairs of dims)")
    cfg = config_lib.preset(f.config)
    drafter = None
    if f.drafter_layers:
        last = cfg.num_layers - 1
        drafter = config_lib.DrafterConfig(
            hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_layers=f.drafter_layers,
            block_size=f.block_size, target_layer_ids=tuple(sorted({1, cfg.num_layers // 2, last})),
            mask_token_id=0, num_heads=f.drafter_heads, head_dim=f.drafter_head_dim,
            intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_norm_eps)
    with cli.about(f, "tp"):
        for path, shape in _param_shapes(cfg).items():
            sharding.param_spec(path, shape, {sharding.DATA: f.data, sharding.TP: f.tp})
    return cfg, drafter


@functools.lru_cache(maxsize=4)
def _param_shapes(cfg: config_lib.ModelConfig) -> dict:
    _, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
    return {path: leaf.shape for path, leaf in nnx.to_flat_state(state)}


def run(f) -> None:
    cfg, drafter = check(f)

    def plan_for(streams):
        return memory_plan(cfg, tp=f.tp, data=f.data, streams=streams, context=f.context,
                           budget=f.budget, block_size=f.block_size, drafter=drafter)

    plan = plan_for(f.streams)
    print(f"{cfg.name} ({cfg.expert_quant} experts, {cfg.dtype}) on data={f.data} x tp={f.tp}, "
          f"{f.streams} streams, B={f.budget}, L={f.block_size}")
    print(format_table(plan, f.markdown))
    print("max committed rows per stream by stream count (same mesh, B, L): " + ", ".join(
        f"{n}: {plan_for(n).max_context:,}" for n in (8, 16, 32, 64, 128, 256) if n % f.data == 0))


if __name__ == "__main__":
    cli.script(define_flags, run)
