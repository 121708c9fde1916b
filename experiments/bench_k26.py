"""Step times of the Kimi K2.6 target sharded over a mesh: AR decode steps and DDTree verify steps.

    # 8 x H200 (the full model: 61 layers, INT4 routed experts, tp=8 with expert parallelism)
    NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. python3 experiments/bench_k26.py \
        --layers=61 --mesh=tp=8 --time_budget_s=420 --append --out=experiments/results/k26/k26_x8.json
    # one H200: K2.6 shapes, fewer layers
    PYTHONPATH=. python3 experiments/bench_k26.py --layers=4 --mesh=tp=1 \
        --out=experiments/results/k26/k26_h200_4layers.json
    # CPU smoke run on 8 fake devices (a shrunken config; the times mean nothing)
    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python experiments/bench_k26.py --scale=tiny \
        --prefix=64 --budgets=4,8 --reps=2 --fast_compile --out=/tmp/k26_tiny.json
    # the full model compiled (not run) on 8 fake CPU devices: collectives, memory analysis, floors per case
    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python experiments/bench_k26.py --layers=61 \
        --mesh=tp=8 --compile_only --out=/tmp/k26_x8_compile.json

--append keeps the cases already in --out and runs the others (resume after the 10-minute limit); --time_budget_s
stops starting cases; the JSON is rewritten after every case.

What runs:
- The params are random and made on the devices in their shards (`sharding.init_in_shards`): nothing is ever whole
  on one device or the host; the INT4 routed experts are made directly in packed form by the MoE module's INT4 path.
  The script checks that every device holds exactly its shard of every param and records the bytes per device.
- The KV cache of each stream count holds --prefix rows of RANDOM latents per stream (unit normal, like the normed
  c_kv), written in place on the devices: a stand-in for a prefill of that length, which is only there to be read
  (attention's cost does not depend on the values). One real prefill of --prefill_tokens tokens (one stream per data
  group, from an empty cache) is timed as its own case.
- AR step: one target forward of T = 1 token per stream against the cache (its latent row written), argmax over the
  vocabulary. DDTree verify step: one forward of T = B + 1 nodes per stream of a random valid tree (each node sees its
  ancestors; positions prefix + depth), argmax per node. Drafting, tree build, accept and compaction are not in it.
- Time: wall clock of the compiled step with `jax.block_until_ready`, the cache donated and fed back, median of
  --reps calls after --warmup calls; and `step_ms_pipelined`: --reps calls issued one after another with one wait at
  the end, per call (the host may run ahead). Their gap is the per-call dispatch and wait that pipelining hides;
  equal values fit a host-bound step as well as a device-bound one, which the profile's busy time tells apart.
  --profile_dir also writes a profiler trace with one annotation per call ("k26|case|rep") and records each case's
  device span, busy time and longest kernels per step (`device_profile` in the JSON); the step loops' calls too
  ("<case> loop": per call of --loop_steps steps), where a span longer than the busy time is the device waiting.
- Bytes per device: the params and the cache each device actually holds, and `compiled.memory_analysis()`.
- Collectives: every all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute in the compiled HLO,
  counted by (op, dtype, elements); each distinct one is timed standalone on the mesh (a chain of 16 inside one
  jit, per-op time = call / 16); the estimate is the sum of count x time (serial: overlap with compute not counted).
- --exact=on,off runs each AR and verify case also with the target's batch-invariant forward (rows `exact: true`;
  the same inputs as the default row beside it): its cost at K2.6 shapes.
- Floors. Bytes a step must read: every param once except the embedding (a gather of M rows), the routed experts
  only as touched (expected distinct experts of M = S x T tokens, each choosing top-k of E uniformly at random), and
  each stream's latent cache rows once. Model floor = those bytes / (devices x --bandwidth_GBps): the issue's floor
  (about 33 GB per AR token at K2.6). Device floor = what one device must read under this layout (its shards of the
  dense params, the replicated q_a / kv_a projections, its touched local experts, the whole latent cache of its
  streams, since the cache is replicated over tp) / --bandwidth_GBps. Compute floor = FLOPs / (devices x
  --matmul_TFLOPs). Each fraction is floor / measured step time.
- Routing as it happened: the step also returns which routed experts each MoE layer picked (its `MoE.route` outputs,
  captured with `nnx.capture`), and the same floors are given again with that count in place of the uniform
  expectation (`floor_ms_routed`, `fraction_of_floor_routed`): random weights route the tokens of a step to fewer
  distinct experts than uniform choice would. Counted over all streams of the step: with data > 1 it bounds one data
  group's count from above.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import platform
import re
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from experiments.run_record import code_version
from experiments.timing import annotation_calls, wall_us
from kdtree_jax import cli
from kdtree_jax import config as config_lib
from kdtree_jax import model_dir, sharding
from kdtree_jax.cache import KVCache
from kdtree_jax.config import ModelConfig
from kdtree_jax.decode import DEVICE_LOOP_COMMAND_BUFFERS, pick_tokens
from kdtree_jax.model.layers import dtype_of
from kdtree_jax.model.moe import random_int4_experts
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.training.target_objective import expert_loads
from pallas_kernels import batch_invariant, int4_moe_triton, ops
from pallas_kernels.int4_moe import GROUP as INT4_GROUP, Int4Experts
from pallas_kernels.tree import random_tree_visible
from pallas_kernels.triton_call import LAUNCHERS

GB = 1e9
COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
CHAIN = 16  # collectives per standalone timing call
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}  # CPU smoke runs
# HLO element types of collectives -> the dtype they are timed with (pred as bytes); any other is timed as f32.
HLO_DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32, "s32": jnp.int32, "u32": jnp.uint32,
              "pred": jnp.uint8, "s8": jnp.int8, "u8": jnp.uint8}


# ----------------------------------------------------------------------------------------------------- config
def tiny_scale(cfg: ModelConfig) -> ModelConfig:
    """cfg shrunk for a CPU smoke run, K2.6's proportions kept loosely (hidden = 28 x 256 -> 256; 64 heads -> 8;
    384 experts top-8 -> 64 top-4; 61 layers -> 3, one dense), every split axis divisible by 8, INT4 groups whole."""
    return cfg.replace(name=f"{cfg.name}_tiny", vocab_size=2048, hidden_size=256, num_layers=3, num_heads=8,
                       q_lora_rank=64 if cfg.q_lora_rank else None, kv_lora_rank=64, qk_nope_head_dim=32,
                       qk_rope_head_dim=16, v_head_dim=32, intermediate_size=640, moe_intermediate_size=64,
                       num_experts=64, num_experts_per_tok=4, first_k_dense=min(cfg.first_k_dense, 1))


def bench_config(preset: str, scale: str, layers: int) -> ModelConfig:
    """The preset, shrunk when scale == 'tiny', with num_layers = layers when layers > 0."""
    if scale not in ("full", "tiny"):
        raise ValueError(f"--scale={scale!r} must be 'full' or 'tiny'")
    cfg = config_lib.preset(preset)
    if scale == "tiny":
        cfg = tiny_scale(cfg)
    if layers < 0:
        raise ValueError(f"--layers={layers} must be >= 0 (0 keeps the config's {cfg.num_layers})")
    if layers:
        cfg = cfg.replace(num_layers=layers, first_k_dense=min(cfg.first_k_dense, layers))
    return cfg


def bench_mesh(text: str):
    """--mesh as sharding.parse_mesh reads it; empty: every local device on tp."""
    return sharding.parse_mesh(text) or sharding.make_mesh(tp=jax.local_device_count())


# ------------------------------------------------------------------------------------------------------ floors
@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """Param bytes of a target by how a forward reads them: in total (each param once) and on one device."""

    experts: int  # routed experts of every MoE layer, all E
    experts_per_device: int
    resident: int  # every other param a forward reads whole (attention, dense / shared MLP, router, norms, lm_head)
    resident_per_device: int
    resident_params: int  # their element count (2 FLOPs per token each)
    embedding: int  # embed_tokens when not tied: a gather of M rows, not read whole
    embedding_per_device: int


def weight_bytes(cfg: ModelConfig, axis_sizes: dict) -> WeightBytes:
    """From the abstract model (no memory) and the sharding rules; axis_sizes: {"data": ..., "tp": ...}."""
    _, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
    sums = {"experts": [0, 0], "resident": [0, 0], "embedding": [0, 0]}
    resident_params = 0
    for path, variable in nnx.to_flat_state(state):
        leaf = variable.get_value()
        spec = sharding.param_spec(path, leaf.shape, axis_sizes)
        split = math.prod(axis_sizes[axis] for axis in spec if axis is not None)
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        axes = sharding.PARAM_AXES[path[-1]]
        if axes[0] == "experts" and len(axes) == 3:
            role = "experts"
        elif path[-1] == "embed_tokens" and not cfg.tie_word_embeddings:
            role = "embedding"
        else:
            role = "resident"
            resident_params += math.prod(leaf.shape)
        sums[role][0] += nbytes
        sums[role][1] += nbytes // split
    return WeightBytes(*sums["experts"], *sums["resident"], resident_params, *sums["embedding"])


def expected_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts hit by `tokens` tokens, each choosing top_k distinct experts uniformly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one forward of `nodes` tokens per stream over `streams` streams with `prefix` cached rows must do."""

    tokens: int  # M = streams x nodes
    experts_touched: float  # expected distinct routed experts per MoE layer
    weight_bytes: float  # resident params once + touched experts
    kv_bytes: float  # each stream's latent rows read once
    device_bytes: float  # one device under the layout: its resident shards + touched local experts + its streams' KV
    flops: float  # all devices together

    @property
    def model_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    def floors_s(self, devices: int, bandwidth: float, matmul: float) -> dict:
        """Seconds: model (bytes over all devices' bandwidth), device (one device's bytes), compute."""
        return {"model": self.model_bytes / (devices * bandwidth), "device": self.device_bytes / bandwidth,
                "compute": self.flops / (devices * matmul)}


def step_cost(cfg: ModelConfig, weights: WeightBytes, axis_sizes: dict, streams: int, nodes: int,
              prefix: int, experts_hit: float | None = None, device_experts: float | None = None) -> StepCost:
    """experts_hit: distinct routed experts per MoE layer as measured (default: the uniform expectation).
    device_experts: the distinct experts per MoE layer of the device the floor is for (default: the mean device's,
    experts_hit / tp); one device's share (--shard_of) gives the most loaded device's."""
    tp, data = axis_sizes[sharding.TP], axis_sizes[sharding.DATA]
    m = streams * nodes
    moe_layers = cfg.num_layers - cfg.first_k_dense
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if not moe_layers:
        touched = local_touched = 0.0
    elif experts_hit is None:
        touched, local_touched = expected_experts(e, k, m), expected_experts(e, k, m / data) / tp
    else:
        touched, local_touched = experts_hit, experts_hit / tp
    if device_experts is not None and moe_layers:
        local_touched = device_experts
    per_expert = weights.experts / max(moe_layers * e, 1)  # bytes of one expert of one layer
    row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * np.dtype(dtype_of(cfg.dtype)).itemsize * cfg.num_layers
    kv = streams * (prefix + nodes) * row
    expert_flops = m * k * moe_layers * 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    attention_flops = (2 * m * cfg.num_heads * (prefix + nodes) * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                       * cfg.num_layers)
    return StepCost(tokens=m, experts_touched=touched,
                    weight_bytes=weights.resident + touched * moe_layers * per_expert, kv_bytes=kv,
                    device_bytes=weights.resident_per_device + local_touched * moe_layers * per_expert + kv / data,
                    flops=2 * m * weights.resident_params + expert_flops + attention_flops)


# ------------------------------------------------------------------------------------------------- collectives
_COLLECTIVE = re.compile(rf"= (.*?) ({'|'.join(COLLECTIVE_OPS)})(-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def hlo_collectives(hlo: str) -> dict[tuple[str, str, int], int]:
    """{(op, dtype, elements of one result on one device): count} over every collective of compiled HLO text.

    A combined op (tuple result) counts each of its results. An async `-start` op of all-gather / collective-permute
    returns (operands, results[, scalar contexts]): only its results count; all-reduce-start returns its results.
    """
    counts: dict = {}
    for match in _COLLECTIVE.finditer(hlo):
        op, shapes = match.group(2), _SHAPE.findall(match.group(1))  # shapes: [(dtype, "d0,d1,...")]
        if match.group(3) and op in ("all-gather", "collective-permute"):
            shapes = [shape for shape in shapes if shape[1]]  # scalar contexts out
            shapes = shapes[len(shapes) // 2:]  # operands out
        for dtype, dims in shapes:
            key = (op, dtype, math.prod(int(d) for d in dims.split(",") if d))
            counts[key] = counts.get(key, 0) + 1
    return counts


def time_collective(mesh, op: str, dtype: str, elements: int, reps: int) -> float:
    """Seconds per `op` over tp whose result on each device has `elements` elements of HLO dtype `dtype`."""
    tp = sharding.tp_size(mesh)
    n = -(-max(elements, 1) // tp) * tp
    local = {"all-gather": n // tp, "reduce-scatter": n * tp}.get(op, n)

    def one(x):
        if op == "all-reduce":
            return jax.lax.psum(x, sharding.TP)
        if op == "all-gather":
            return jax.lax.all_gather(x, sharding.TP, tiled=True).reshape(tp, local).sum(0, dtype=x.dtype)
        if op == "reduce-scatter":
            return jnp.tile(jax.lax.psum_scatter(x, sharding.TP, tiled=True), tp)
        if op == "all-to-all":
            return jax.lax.all_to_all(x, sharding.TP, 0, 0, tiled=True)
        return jax.lax.ppermute(x, sharding.TP, [(i, (i + 1) % tp) for i in range(tp)])

    def chain(x):
        for _ in range(CHAIN):
            x = one(x)
        return x

    fn = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P(sharding.TP), out_specs=P(sharding.TP), check_vma=False))
    x = jax.device_put(jnp.ones((local * tp,), HLO_DTYPES.get(dtype, jnp.float32)),
                       NamedSharding(mesh, P(sharding.TP)))
    return wall_us(fn, [(x,)], reps, warmup=2) * 1e-6 / CHAIN


def collective_summary(counts: dict, seconds_each: dict | None = None) -> dict:
    """Count and bytes per device of a step's collectives (hlo_collectives' counts), with the estimated serial time
    when seconds_each ({(op, dtype, elements): seconds}, time_collective's) is given."""
    ops = []
    for (op, dtype, elements), count in sorted(counts.items()):
        itemsize = np.dtype(HLO_DTYPES.get(dtype, jnp.float32)).itemsize
        ops.append(dict(op=op, dtype=dtype, elements=elements, count=count, bytes=elements * itemsize))
        if seconds_each is not None:
            ops[-1]["us_each"] = seconds_each[(op, dtype, elements)] * 1e6
    summary = dict(count=sum(counts.values()), bytes=sum(o["count"] * o["bytes"] for o in ops), ops=ops)
    if seconds_each is not None:
        summary["ms"] = sum(o["count"] * o["us_each"] for o in ops) / 1e3
    return summary


# ------------------------------------------------------------------------------------ one device's share of tp
def parse_shard_of(text: str) -> int:
    """--shard_of: 'tp=N' -> N; '' -> 0 (no share: the whole model on --mesh)."""
    if not text:
        return 0
    name, _, value = text.partition("=")
    if name.strip() != sharding.TP or not value.strip().isdigit() or int(value) < 2:
        raise ValueError(f"--shard_of={text!r} is not 'tp=N' with N >= 2; write e.g. --shard_of=tp=8")
    return int(value)


def share_view(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config one device's share runs its code with: its heads and its vocabulary slice. Every other split size
    (MLP and shared-expert columns, experts held) the code reads from its params' shapes; the router still scores
    all cfg.num_experts experts."""
    return cfg.replace(num_heads=cfg.num_heads // tp, vocab_size=cfg.vocab_size // tp)


def _share_init(name: str, full_shape: tuple, shape: tuple, dtype):
    """A jitted key -> random param of the share's `shape`, drawn as the model draws the whole param `full_shape`:
    norms ones, the router's correction bias zeros, the embedding N(0, 0.02), every other weight a truncated
    normal over the whole param's fan-in (the dense weights' last axis, [out..., in]; o_proj [D, H, V]: heads x head
    dim; kv_b_proj [C, H, P + V]: its first axis; the bf16 expert stacks [E, in, out]: their second)."""
    if name == "weight":
        return jax.jit(lambda key: jnp.ones(shape, dtype))
    if name == "e_score_correction_bias":
        return jax.jit(lambda key: jnp.zeros(shape, dtype))
    fan_in = {"o_proj": math.prod(full_shape[1:]), "kv_b_proj": full_shape[0], "w_gate": full_shape[1],
              "w_up": full_shape[1], "w_down": full_shape[1]}.get(name, full_shape[-1])
    scale = 0.02 if name == "embed_tokens" else fan_in ** -0.5
    return jax.jit(lambda key: (jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32) * scale).astype(dtype))


def make_share_params(cfg: ModelConfig, tp: int, seed: int):
    """(graphdef, params, info): one device's params of a tp deployment of cfg, random, on this process's first device:
    every param split over tp by the engine's rules (sharding.PARAM_AXES) at its shard's shape, the replicated ones
    whole; the INT4 routed experts made in packed form as `sharding.init_in_shards` makes each device's E / tp.
    The graphdef is `share_view`'s."""
    start = time.perf_counter()
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(share_view(cfg, tp), nnx.Rngs(seed))))[0]
    _, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(seed))))
    axis_sizes = {sharding.DATA: 1, sharding.TP: tp}
    inits, int4_makers, int4_modules = {}, {}, {}
    key = jax.random.key(seed)
    for number, (path, variable) in enumerate(nnx.to_flat_state(state)):
        full = variable.get_value()
        if path[-1] in Int4Experts._fields:
            int4_modules.setdefault(path[:-1], {})[path[-1]] = variable
            continue
        spec = sharding.param_spec(path, full.shape, axis_sizes)
        shape = tuple(d // (tp if axis == sharding.TP else 1) for d, axis in zip(full.shape, spec))
        init = (path[-1], full.shape, shape, full.dtype)
        if init not in inits:
            inits[init] = _share_init(*init)
        variable.set_value(inits[init](jax.random.fold_in(key, number)))
    for number, (module, variables) in enumerate(int4_modules.items()):
        shapes = Int4Experts(*(variables[name].get_value().shape for name in Int4Experts._fields))
        if shapes not in int4_makers:
            int4_makers[shapes] = jax.jit(lambda key, s=shapes: random_int4_experts(
                nnx.Rngs(key), s.gate_packed[0] // tp, s.down_packed[1], s.gate_packed[1], INT4_GROUP))
        made = int4_makers[shapes](jax.random.fold_in(key, 10_000 + number))
        for name, value in made._asdict().items():
            variables[name].set_value(value)
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    return graphdef, state, dict(share_of_tp=tp, params=len(jax.tree.leaves(state)), total_bytes=nbytes,
                                 per_device_bytes=[nbytes], init_s=time.perf_counter() - start)


def share_collectives(cfg: ModelConfig, tp: int, streams: int, nodes: int, table: dict | None) -> dict:
    """The collectives one device of a tp deployment takes part in per step, which the share leaves out:
    an all-reduce of the hidden state [M, D] after attention and after the MLP / MoE of every layer
    (`model.parallel`), one for the vocab-parallel embedding lookup, and the two all-gathers of the argmax over the
    vocabulary slices (each device's best value and index per token, tp of each gathered). tests/test_bench_k26.py checks this count against the compiled tp
    step. table: {(op, dtype, elements): seconds} measured elsewhere (`collective_table`); each op takes the time
    of the measured op of its kind nearest in bytes."""
    m, dtype = streams * nodes, {"bfloat16": "bf16", "float32": "f32"}[cfg.dtype]
    counts = {("all-reduce", dtype, m * cfg.hidden_size): 2 * cfg.num_layers + 1,
              ("all-gather", "f32", m * tp): 1, ("all-gather", "s32", m * tp): 1}
    if not table:
        return dict(collective_summary(counts), modeled=True, tp=tp)
    nearest = {}
    for op, dt, elements in counts:
        size = elements * np.dtype(HLO_DTYPES[dt]).itemsize
        same = [(abs(math.log(max(e * np.dtype(HLO_DTYPES.get(d, jnp.float32)).itemsize, 1) / max(size, 1))), s)
                for (o, d, e), s in table.items() if o == op]
        nearest[(op, dt, elements)] = min(same)[1] if same else float("nan")
    return dict(collective_summary(counts, nearest), modeled=True, tp=tp)


def collective_table(path: str) -> dict:
    """{(op, dtype, elements): seconds} of every collective a bench_k26 JSON timed (its cases' `collectives.ops`,
    each op's median over the cases that timed it); {} for no path."""
    if not path:
        return {}
    with open(path) as fh:
        cases = json.load(fh)["cases"]
    times: dict = {}
    for case in cases:
        for o in case.get("collectives", {}).get("ops", []):
            if "us_each" in o:
                times.setdefault((o["op"], o["dtype"], o["elements"]), []).append(o["us_each"] * 1e-6)
    return {key: float(np.median(v)) for key, v in times.items()}


def most_loaded_experts(tokens: int, num_experts: int, top_k: int, tp: int, trials: int = 256, seed: int = 0) -> float:
    """The distinct experts of the most loaded of tp devices (num_experts / tp consecutive experts each) when
    `tokens` tokens each choose top_k distinct experts uniformly at random: mean over `trials` draws (the device a tp
    step waits for at each layer, and the experts the share computes)."""
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((trials, tokens, num_experts)), axis=-1)[..., :top_k].reshape(trials, -1)
    hit = np.zeros((trials, num_experts), bool)
    np.put_along_axis(hit, picks, True, axis=1)
    return float(hit.reshape(trials, tp, -1).sum(-1).max(-1).mean())


# --------------------------------------------------------------------------------------------- model and cache
def param_layout(params, mesh) -> dict:
    """Bytes of the params in total and on each device, after checking that every param lives on every device of
    the mesh, each holding exactly the shard its rule gives (raises RuntimeError otherwise)."""
    devices = {d.id for d in mesh.devices.flat}
    per_device = dict.fromkeys(sorted(devices), 0)
    total = count = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        shard_shape = NamedSharding(mesh, sharding.param_spec(path, x.shape, mesh.shape)).shard_shape(x.shape)
        held = {s.device.id: s.data.shape for s in x.addressable_shards}
        if set(held) != devices or set(held.values()) != {shard_shape}:
            raise RuntimeError(f"param {jax.tree_util.keystr(path)} {x.shape}: devices hold {held}, expected "
                               f"{shard_shape} on each of {sorted(devices)}")
        for s in x.addressable_shards:
            per_device[s.device.id] += s.data.nbytes
        total += x.nbytes
        count += 1
    return dict(params=count, total_bytes=total, per_device_bytes=list(per_device.values()))


def random_cache(cfg: ModelConfig, mesh, streams: int, capacity: int, filled: int, seed: int,
                 abstract: bool = False) -> KVCache:
    """A latent cache of `capacity` rows per stream, rows [0, filled) random (unit normal), lengths `filled`: a
    stand-in for a prefill of `filled` tokens, made in place on the devices (split over data, replicated over tp).
    abstract: only its shapes, dtypes and shardings (jax.ShapeDtypeStruct), nothing allocated."""
    dt = dtype_of(cfg.dtype)

    out = sharding.stream_sharding(mesh)
    rows = (jnp.arange(capacity) < filled)[None, :, None]

    def layer(key, width):   # one jit per width, called once per layer (one call for all 61 compiles for minutes)
        return jnp.where(rows, jax.random.normal(key, (streams, capacity, width), dt), jnp.zeros((), dt))

    makers = {w: jax.jit(functools.partial(layer, width=w), out_shardings=out)
              for w in (cfg.kv_lora_rank, cfg.qk_rope_head_dim)}
    make = (lambda w, key: makers[w].eval_shape(key)) if abstract else (lambda w, key: makers[w](key))
    keys = jax.random.split(jax.random.key(seed), 2 * cfg.num_layers)
    length = jax.ShapeDtypeStruct((streams,), jnp.int32, sharding=out) if abstract else \
        jax.device_put(jnp.full((streams,), filled, jnp.int32), out)
    return KVCache(tuple(make(cfg.kv_lora_rank, keys[2 * i]) for i in range(cfg.num_layers)),
                   tuple(make(cfg.qk_rope_head_dim, keys[2 * i + 1]) for i in range(cfg.num_layers)), length)


def block_inputs(rng: np.random.Generator, cfg: ModelConfig, kind: str, streams: int, nodes: int, prefix: int):
    """(tokens [S, T], positions [S, T], visible [S, T, T]) of one step: 'ar' (T = 1), 'verify' (a random tree of
    T nodes: each sees its ancestors, positions prefix + depth) or 'prefill' (causal, positions 0..T-1)."""
    tokens = rng.integers(0, cfg.vocab_size, (streams, nodes), dtype=np.int32)
    if kind == "prefill":
        visible = np.broadcast_to(np.tril(np.ones((nodes, nodes), bool)), (streams, nodes, nodes))
        return tokens, np.broadcast_to(np.arange(nodes, dtype=np.int32), (streams, nodes)), visible
    visible = random_tree_visible(rng, streams, nodes)
    return tokens, (prefix + visible.sum(-1) - 1).astype(np.int32), visible


def make_step(graphdef, params, mesh, exact: bool = False):
    """The jitted step (params, cache, tokens, positions, visible) -> (argmax tokens [S, T], cache, experts hit
    [num MoE layers, E] bool), cache donated; params in their shards, every per-stream array split over data. Lower it
    under jax.set_mesh(mesh). exact: the target's batch-invariant forward (`Transformer(..., exact=True)`)."""
    return _jit_step(functools.partial(_forward, graphdef, exact=exact), params, mesh, exact)


class StepLoop(NamedTuple):
    fn: Callable        # jitted, `make_step`'s signature and outputs
    steps: int          # steps per call


def make_step_loop(graphdef, params, mesh, steps: int, exact: bool = False) -> StepLoop:
    """A function of `make_step`'s signature running the step `steps` times in one `lax.while_loop` on the same
    input tokens (so each step routes as the waited step does), the cache fed forward: the decode loop's regime, where
    the host reads the loop's predicate after every iteration (it depends on the step's argmax tokens, so XLA cannot
    count the trips) and launches the next iteration's kernels then. Returns the last step's outputs. (Feeding the
    argmax tokens back instead made a verify step's 9 nodes mostly one token, hitting fewer experts.)"""
    def loop(params, cache, tokens, positions, visible):
        def body(carry):
            i, _, cache, _ = carry
            out, cache, hit = _forward(graphdef, params, cache, tokens, positions, visible, exact=exact)
            return i + 1, out, cache, hit

        def more(carry):
            return (carry[0] < steps) & (carry[1][0, 0] >= 0)

        first = _forward(graphdef, params, cache, tokens, positions, visible, exact=exact)
        _, tokens, cache, hit = lax.while_loop(more, body, (jnp.int32(1), *first))
        return tokens, cache, hit

    return StepLoop(_jit_step(loop, params, mesh, exact), steps)


def _forward(graphdef, params, cache, tokens, positions, visible, *, exact: bool = False):
    """One step: (argmax tokens [S, T], cache, experts hit [num MoE layers, E] bool)."""
    model = nnx.merge(graphdef, params)
    forward = nnx.capture(lambda m: m(tokens, positions, cache, visible, exact=exact), nnx.Intermediate,
                          method_outputs=nnx.Intermediate)
    fwd, intermediates = forward(model)
    hit = expert_loads(model, nnx.to_pure_dict(intermediates)) > 0
    return pick_tokens(fwd.logits, 0.0, None).astype(tokens.dtype), fwd.cache, hit


def _jit_step(fn, params, mesh, exact: bool):
    streams = sharding.stream_sharding(mesh)
    return jax.jit(fn, donate_argnums=(1,), out_shardings=(streams, streams, sharding.replicated(mesh)),
                   in_shardings=(sharding.param_shardings(params, mesh), streams, streams, streams, streams),
                   **batch_invariant.jit_options(exact))


# ----------------------------------------------------------------------------------------------------- one case
@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # "prefill" | "ar" | "verify"
    streams: int
    nodes: int  # T
    prefix: int  # committed rows each stream attends to
    exact: bool = False  # the batch-invariant forward (--exact)

    @property
    def budget(self) -> int:
        return self.nodes - 1 if self.kind == "verify" else 0

    @property
    def name(self) -> str:
        return f"{self.kind} S={self.streams} T={self.nodes}" + (" exact" if self.exact else "")


def run_case(case: Case, step, params, cache, mesh, cfg, weights, rng, timed_collectives, run: dict,
             step_loop=None):
    """Compile and inspect one case, then (unless run["compile_only"]) time it and its collectives; with
    `step_loop` (`make_step_loop`) also the step inside the decode loop's while loop.

    Returns (result row, the cache handed back by the last call: the donated one is gone)."""
    inputs = tuple(jax.device_put(a, sharding.stream_sharding(mesh))
                   for a in block_inputs(rng, cfg, case.kind, case.streams, case.nodes, case.prefix))
    loop_only = run.get("loop_only", False) and step_loop is not None
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = (step_loop.fn if loop_only else step).lower(params, cache, *inputs).compile(
            compiler_options=run["compiler_options"])
    share_tp, full_cfg = run.get("share_tp", 0), run.get("full_cfg", cfg)
    axis_sizes = {sharding.DATA: 1, sharding.TP: share_tp} if share_tp else dict(mesh.shape)
    devices = math.prod(axis_sizes.values())
    device_experts = (most_loaded_experts(case.streams * case.nodes, full_cfg.num_experts,
                                          full_cfg.num_experts_per_tok, share_tp) if share_tp else None)
    cost = step_cost(full_cfg, weights, axis_sizes, case.streams, case.nodes, case.prefix,
                     device_experts=device_experts)
    floors = cost.floors_s(devices, run["bandwidth"], run["matmul"])
    counts = hlo_collectives(compiled.as_text())
    row = dict(kind=case.kind, streams=case.streams, budget=case.budget, nodes=case.nodes, prefix=case.prefix,
               exact=case.exact, tokens=cost.tokens, compile_s=time.perf_counter() - start,
               experts_touched_per_layer=cost.experts_touched, model_bytes=cost.model_bytes,
               weight_bytes=cost.weight_bytes, kv_bytes=cost.kv_bytes, device_bytes=cost.device_bytes,
               flops=cost.flops, floor_ms={k: v * 1e3 for k, v in floors.items()},
               memory_per_device=_memory(compiled.memory_analysis()))
    if share_tp:
        row["device_experts_per_layer"] = device_experts
    if run["compile_only"]:
        return dict(row, collectives=collective_summary(counts)), cache

    state = {"cache": cache}

    def call():
        tokens, state["cache"], state["hit"] = compiled(params, state["cache"], *inputs)
        return tokens, state["cache"]

    if loop_only:       # the compiled function is the loop: its wall clock per step is the one time
        us = wall_us(call, [()], run["reps"], warmup=run["warmup"])
        profile_loop_calls(call, f"{case.name} loop", run)
        return _timed_row(row, case, cfg, weights, state, mesh, run, counts, timed_collectives, floors,
                          [us / 1e6 / step_loop.steps], float("nan"), dict(step_ms_in_loop=us / 1e3 / step_loop.steps))
    times = []
    for r in range(run["warmup"] + run["reps"]):
        with jax.profiler.TraceAnnotation(f"k26|{case.name}|{r}"):
            start = time.perf_counter()
            jax.block_until_ready(call())
            elapsed = time.perf_counter() - start
        if r >= run["warmup"]:
            times.append(elapsed)
    start = time.perf_counter()
    for _ in range(run["reps"]):       # issued without waiting between calls: the host may run ahead of the device
        call()
    jax.block_until_ready(state["cache"])
    pipelined_s = (time.perf_counter() - start) / run["reps"]
    loop_row = {}
    if step_loop is not None:
        try:
            state["cache"], loop_row = time_loop(step_loop, params, state["cache"], inputs, mesh, run,
                                                 f"{case.name} loop")
        except Exception as e:  # noqa: BLE001 - the loop's failure (e.g. out of memory) is a result; the step's stands
            loop_row = dict(loop_error=f"{type(e).__name__}: {str(e)[:2000]}")
            state["cache"] = None  # it may have been donated: the caller makes a new one
    return _timed_row(row, case, cfg, weights, state, mesh, run, counts, timed_collectives, floors, times,
                      pipelined_s, loop_row)


def _timed_row(row, case, cfg, weights, state, mesh, run, counts, timed_collectives, floors, times, pipelined_s,
               loop_row):
    """run_case's row completed with its times (seconds of the timed calls; the loop's fields), collectives,
    floors' fractions and the routing the last call recorded; and the cache handed back."""
    row.update(loop_row)
    step_s = float(np.median(times))
    share_tp, full_cfg = run.get("share_tp", 0), run.get("full_cfg", cfg)
    axis_sizes = {sharding.DATA: 1, sharding.TP: share_tp} if share_tp else dict(mesh.shape)
    devices = math.prod(axis_sizes.values())
    if share_tp:   # the share runs on one device: its deployment's collectives are modeled and timed apart
        collectives = share_collectives(full_cfg, share_tp, case.streams, case.nodes, run.get("collective_table"))
    else:
        for key in counts.keys() - timed_collectives.keys():
            timed_collectives[key] = time_collective(mesh, *key, run["reps"])
        collectives = collective_summary(counts, timed_collectives)
    if "ms" in collectives:
        collectives["fraction_of_step"] = collectives["ms"] / 1e3 / step_s
    hits = np.asarray(state["hit"])  # [num MoE layers, E] bool: the experts each MoE layer's tokens chose
    hit = hits.sum(axis=1)  # distinct experts per MoE layer
    local = hits.reshape(len(hits), share_tp, -1).sum(-1).max(-1) if share_tp and len(hits) else None
    routed = {k: v * 1e3 for k, v in step_cost(full_cfg, weights, axis_sizes, case.streams, case.nodes, case.prefix,
                                               float(hit.mean()) if hit.size else None,
                                               float(local.mean()) if local is not None else None)
              .floors_s(devices, run["bandwidth"], run["matmul"]).items()}
    if local is not None:
        row["device_experts_hit_per_layer"] = local.tolist()
    if not math.isnan(pipelined_s):
        row["step_ms_pipelined"] = pipelined_s * 1e3
    row.update(step_ms=step_s * 1e3, step_ms_min=min(times) * 1e3, step_ms_std=float(np.std(times)) * 1e3,
               reps=len(times), fraction_of_floor={k: v / step_s for k, v in floors.items()},
               experts_hit_per_layer=hit.tolist(), floor_ms_routed=routed,
               fraction_of_floor_routed={k: v / 1e3 / step_s for k, v in routed.items()},
               collectives=collectives, cache_bytes_per_device=sum(
                   s.data.nbytes for x in jax.tree.leaves(state["cache"]) for s in x.addressable_shards
                   if s.device == mesh.devices.flat[0]))
    return row, state["cache"]


def _memory(stats) -> dict:
    if stats is None:
        return {}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    return {f.removesuffix("_size_in_bytes"): int(getattr(stats, f)) for f in fields if hasattr(stats, f)}


# ------------------------------------------------------------------------------------------------------ output
def format_row(r: dict) -> str:
    case = f"{r['kind']:>7} S={r['streams']:<3d} B={r['budget']:<3d}" + (" exact" if r.get("exact") else "")
    if "compile_s" not in r:
        return f"{case} {r.get('skipped') or r.get('error')}"
    floor, coll = r["floor_ms"], r["collectives"]
    frac = r.get("fraction_of_floor", {})
    step = (f"step {r['step_ms']:9.3f} ms (pipelined {r.get('step_ms_pipelined', float('nan')):9.3f}, in a loop "
            f"{r.get('step_ms_in_loop', float('nan')):9.3f}; model floor "
            f"{frac['model']:6.1%}, device floor {frac['device']:6.1%})" if "step_ms" in r else "compiled only")
    if r.get("experts_hit_per_layer"):
        step += (f" | experts hit {np.mean(r['experts_hit_per_layer']):5.1f} (uniform "
                 f"{r['experts_touched_per_layer']:5.1f}), routed floor {r['fraction_of_floor_routed']['model']:6.1%}")
    if "loop_error" in r:
        step += f" | the loop failed: {r['loop_error'][:200]}"
    timed = f" ~{coll['ms']:7.3f} ms ({coll['fraction_of_step']:5.1%})" if "ms" in coll else ""
    return (f"{case} M={r['tokens']:<5d} | {step} | compile {r['compile_s']:5.1f} s | floors ms model "
            f"{floor['model']:7.3f} device {floor['device']:7.3f} compute {floor['compute']:7.3f} | read "
            f"{r['model_bytes'] / GB:7.2f} GB, {r['device_bytes'] / GB:6.2f} GB/dev | collectives {coll['count']:4d}, "
            f"{coll['bytes'] / 1e6:8.2f} MB/dev{timed} | temp {r['memory_per_device'].get('temp', 0) / GB:6.2f} GB")


def time_loop(step_loop: StepLoop, params, cache, inputs, mesh, run: dict, name: str) -> tuple[KVCache, dict]:
    """(the cache handed back, {step_ms_in_loop, loop_compile_s}) of a `make_step_loop` function: median of --reps
    waited calls after --warmup, each call's wall clock over its steps; then, profiling, `profile_loop_calls`."""
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = step_loop.fn.lower(params, cache, *inputs).compile(compiler_options=run["compiler_options"])
    compile_s = time.perf_counter() - start
    state = {"cache": cache}

    def call():             # the donated cache fed forward
        outputs = compiled(params, state["cache"], *inputs)
        state["cache"] = outputs[1]
        return outputs

    us = wall_us(call, [()], run["reps"], warmup=run["warmup"])
    profile_loop_calls(call, name, run)
    return state["cache"], dict(step_ms_in_loop=us / 1e3 / step_loop.steps, loop_compile_s=compile_s)


def profile_loop_calls(call, name: str, run: dict, calls: int = 3) -> None:
    """With --profile_dir: `calls` more waited calls of a step loop, each annotated "k26|<name>|<i>", so that
    `device_profile` reports the loop's own window, device span, busy time and kernels per call (all of its steps):
    a span longer than the busy time is the device idle inside the loop, between or within its steps."""
    if not run.get("profile"):
        return
    for i in range(calls):
        with jax.profiler.TraceAnnotation(f"k26|{name}|{i}"):
            jax.block_until_ready(call())


def print_floor(cfg: ModelConfig, axis_sizes: dict, prefix: int, run: dict, label: str) -> dict:
    """Print and return the AR floor (one token, one stream) of cfg on this layout."""
    cost = step_cost(cfg, weight_bytes(cfg, axis_sizes), axis_sizes, 1, 1, prefix)
    devices = math.prod(axis_sizes.values())
    floors = cost.floors_s(devices, run["bandwidth"], run["matmul"])
    print(f"AR floor, {label} ({cfg.num_layers} layers, {cfg.num_experts_per_tok} of {cfg.num_experts} experts per "
          f"token, prefix {prefix}): weights {cost.weight_bytes / GB:.2f} GB + KV {cost.kv_bytes / GB:.3f} GB read "
          f"per token = {floors['model'] * 1e3:.3f} ms over {devices} devices at {run['bandwidth'] / GB:.0f} GB/s "
          f"each; one device under this layout reads {cost.device_bytes / GB:.2f} GB = "
          f"{floors['device'] * 1e3:.3f} ms", flush=True)
    return dict(weight_bytes=cost.weight_bytes, kv_bytes=cost.kv_bytes, device_bytes=cost.device_bytes,
                floor_ms={k: v * 1e3 for k, v in floors.items()})


def device_profile(trace_dir: str, top: int = 100) -> dict:
    """Per case of the trace in trace_dir (--profile_dir), medians over its waited steps: the host's window (ms),
    the device span and busy time inside it, how long the window ran before the first device event
    (`before_device_ms`: the host's work before its first launch reached the GPU) and after the last
    (`after_device_ms`), the device events, the `top` longest kernels (mean ms per step) and the `top` host events by
    name (median over the steps of each name's total ms, nested events each counting, so that one slow call, such as
    the first warm-up's one-time work, hardly moves them): where a step's time goes. Warm-up calls count too."""
    out = {}
    for name, calls in annotation_calls(trace_dir, prefix="k26|").items():
        per_kernel: dict[str, list[float]] = {}
        per_host = [{} for _ in calls]
        for c, host_of_call in zip(calls, per_host):
            for kernel, us in c.events_us.items():
                per_kernel.setdefault(kernel, []).append(us)
            for line, event, _, us in c.timeline:
                if line != "device":
                    host_of_call[event[:80]] = host_of_call.get(event[:80], 0.0) + us
        first = [min(e[2] for e in c.timeline if e[0] == "device") for c in calls]
        kernels = {k: float(np.sum(v)) / len(calls) / 1e3 for k, v in per_kernel.items()}
        host = {k: float(np.median([h.get(k, 0.0) for h in per_host])) / 1e3 for k in set().union(*per_host)}
        out[name] = dict(window_ms=float(np.median([c.window_us for c in calls])) / 1e3,
                         span_ms=float(np.median([c.span_us for c in calls])) / 1e3,
                         busy_ms=float(np.median([sum(c.events_us.values()) for c in calls])) / 1e3,
                         before_device_ms=float(np.median(first)) / 1e3,
                         after_device_ms=float(np.median([c.window_us - f - c.span_us
                                                          for c, f in zip(calls, first)])) / 1e3,
                         device_events=float(np.median([c.events for c in calls])),
                         top_kernels_ms=dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:top]),
                         top_host_events_ms=dict(sorted(host.items(), key=lambda kv: -kv[1])[:top]))
    return out


# -------------------------------------------------------------------------------------------------------- main
def compiler_options(f) -> dict | None:
    """The steps' XLA compile options from the flags (--fast_compile, --command_buffers); None: XLA's defaults."""
    options = dict(FAST_COMPILE) if f.fast_compile else {}
    if f.command_buffers:
        options["xla_gpu_enable_command_buffer"] = f.command_buffers
    return options or None



def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """The script's flags (defined only when run as a script, so tests can import its functions)."""
    flags.DEFINE_string("config", "kimi_k2_6", f"model preset: {sorted(config_lib.PRESETS)}", flag_values=fv)
    flags.DEFINE_integer("layers", 0, "override num_layers (0: the config's; e.g. 61 on 8 GPUs, 4-8 on one H200)",
                         flag_values=fv)
    flags.DEFINE_string("mesh", "", "'tp=8' | 'data=2,tp=4' (empty: every local device on tp)", flag_values=fv)
    flags.DEFINE_list("streams", ["1", "8"], "stream counts S", flag_values=fv)
    flags.DEFINE_integer("prefix", 4096, "committed cache rows per stream (random latents)", flag_values=fv)
    flags.DEFINE_list("budgets", ["8", "16", "32", "64"], "DDTree budgets B (verify T = B + 1)", flag_values=fv)
    flags.DEFINE_integer("prefill_tokens", 512, "tokens of the one timed prefill (one stream per data group, empty "
                         "cache; 0: none)", flag_values=fv)
    flags.DEFINE_integer("reps", 10, "timed calls per case (median reported)", flag_values=fv)
    flags.DEFINE_integer("loop_steps", 8, "also time the step inside a while loop of this many steps, as the decode "
                         "loop runs it (`step_ms_in_loop`; 0: not)", flag_values=fv)
    flags.DEFINE_integer("warmup", 2, "untimed calls per case after compiling", flag_values=fv)
    flags.DEFINE_enum("scale", "full", ["full", "tiny"], "tiny: a shrunken config for a CPU smoke run", flag_values=fv)
    flags.DEFINE_float("bandwidth_GBps", 4300.0, "HBM bandwidth of one device for the floors (H200: ~4.3 TB/s copy)",
                       flag_values=fv)
    flags.DEFINE_float("matmul_TFLOPs", 780.0, "bf16 matmul rate of one device for the compute floor", flag_values=fv)
    flags.DEFINE_float("time_budget_s", 0.0, "start no new case after this many seconds (0: no limit)", flag_values=fv)
    flags.DEFINE_string("profile_dir", "", "also write a profiler trace of the timed calls here", flag_values=fv)
    flags.DEFINE_enum("moe_launcher", int4_moe_triton.LAUNCHER, LAUNCHERS,
                      "how the GPU's int4_moe kernels are launched (pallas_kernels/triton_call.py); 'ffi' can go into "
                      "XLA's command buffers with the fusions around it", flag_values=fv)
    flags.DEFINE_bool("compile_only", False, "abstract params and cache (nothing allocated): compile every case and "
                      "report its collectives, memory analysis and floors, no times (e.g. the full model on 8 fake "
                      "CPU devices)", flag_values=fv)
    flags.DEFINE_string("command_buffers", "", "XLA:GPU's command buffer types for the steps' compiles (the "
                        f"xla_gpu_enable_command_buffer option, e.g. {DEVICE_LOOP_COMMAND_BUFFERS!r}, the decode "
                        "loop's `DecodeSpec.device_loop` set: the loop's while as a CUDA graph); empty: XLA's default",
                        flag_values=fv)
    flags.DEFINE_bool("fast_compile", False, "compile the steps with XLA's cheap CPU passes (smoke runs only)",
                      flag_values=fv)
    flags.DEFINE_integer("seed", 0, "seed of params, cache, tokens and trees", flag_values=fv)
    flags.DEFINE_string("out", "experiments/results/k26/k26.json", "JSON results path (rewritten after every case)",
                        flag_values=fv)
    flags.DEFINE_bool("append", False, "keep the cases already measured in --out (same config, mesh and prefix) and "
                      "run only the others: resumes a run cut short, or splits one over several commands",
                      flag_values=fv)
    cli.define_overwrite(fv)
    flags.DEFINE_string("shard_of", "", "'tp=N': build and time on this one device what one device of a tp=N "
                        "deployment runs (its heads, MLP and shared-expert columns, vocabulary slice and E / N experts "
                        "under the full router, computing the pairs of the most loaded device; the replicated params "
                        "whole); the deployment's collectives are left out and reported apart, costed from "
                        "--collective_table", flag_values=fv)
    flags.DEFINE_string("collective_table", "experiments/results/k26/k26_x2_tp2_20layers.json",
                        "a bench_k26 JSON whose timed collectives cost --shard_of's ('' for counts and bytes only)",
                        flag_values=fv)
    flags.DEFINE_string("moe_tiling", "", "fields of the Triton int4_moe's tiling over its default for every call, "
                        "as field=integer pairs (0 / 1 for a boolean), e.g. gate_up_splits=2 or "
                        "fma=1,block_m=1,block_n=32 (`ops.set_int4_moe_tiling`; empty: the default tiling)",
                        flag_values=fv)
    flags.DEFINE_bool("dense_kernel", False, "the dense products of few rows through skinny_matmul "
                      "(`ops.set_dense_kernel`: q_a, kv_a, q_b with its norm, o_proj, the shared expert, the router, "
                      "the lm_head with the final norm) instead of XLA", flag_values=fv)
    flags.DEFINE_bool("router_kernel", False, "the MoE router's sigmoid, top-k and weights as one Triton kernel "
                      "(`ops.set_router_kernel`) instead of XLA's ops", flag_values=fv)
    flags.DEFINE_list("exact", ["off"], "the target's batch-invariant forward (DecodeSpec.exact): 'on', 'off', or "
                      "'on,off' to time every AR and verify case both ways, one after the other", flag_values=fv)
    flags.DEFINE_bool("loop_only", False, "time each case only inside the while loop (`step_ms_in_loop`; one "
                      "compile a case instead of two: the waited and pipelined calls are left out)", flag_values=fv)


def cases_from_flags(f, max_position: int, data: int) -> list[Case]:
    """The prefill (data streams, one per data group; the default forward) first, then AR and verify for each
    stream count, each in every --exact mode."""
    streams = [int(s) for s in f.streams]
    budgets = [int(b) for b in f.budgets]
    if not streams or min(streams) < 1 or min(budgets, default=1) < 1 or f.prefix < 0 or f.prefill_tokens < 0:
        raise ValueError(f"--streams {streams} and --budgets {budgets} must be positive, --prefix {f.prefix} and "
                         f"--prefill_tokens {f.prefill_tokens} non-negative")
    if f.loop_steps < 0:
        raise ValueError(f"--loop_steps {f.loop_steps} must be >= 0 (0: no timing in a loop)")
    if f.prefix + max(budgets, default=0) + 1 > max_position or f.prefill_tokens > max_position:
        raise ValueError(f"--prefix {f.prefix} + the largest tree ({max(budgets, default=0) + 1} nodes) or "
                         f"--prefill_tokens {f.prefill_tokens} passes the model's max_position_embeddings "
                         f"{max_position}; shorten them")
    cases = [Case("prefill", data, f.prefill_tokens, 0)] if f.prefill_tokens else []
    shapes = [("ar", 1)] + [("verify", b + 1) for b in budgets]
    modes = cli.on_off(f, "exact")
    for s in streams:
        cases += [Case(kind, s, nodes, f.prefix, exact) for kind, nodes in shapes for exact in modes]
    return cases


def case_key(row: dict) -> tuple:
    return row["kind"], row["streams"], row["nodes"], row.get("prefix"), row.get("exact", False)


def previous_results(path: str, meta: dict) -> dict | None:
    """The results at `path` when they are of the same config and mesh (--append), else None; raises on a mismatch."""
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        previous = json.load(fh)
    earlier = {"moe_launcher": "jax_triton", **previous["meta"]}      # runs before --moe_launcher used jax-triton
    for field in ("config", "mesh", "prefix", "moe_launcher"):
        if earlier[field] != json.loads(json.dumps(meta[field])):
            raise ValueError(f"--append: {path} holds a run with another {field} ({earlier[field]}); "
                             f"choose another --out or drop --append")
    return previous


def make_params(cfg: ModelConfig, mesh, seed: int, abstract: bool):
    """(graphdef, params, info): random params made in their shards (info: param_layout + init seconds), or with
    abstract only their shapes, dtypes and shardings (jax.ShapeDtypeStruct)."""
    if abstract:
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(seed))))
        params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                              sharding.param_shardings(state, mesh))
        return graphdef, params, dict(abstract=True)
    start = time.perf_counter()
    graphdef, params = nnx.split(sharding.init_in_shards(lambda rngs: Transformer(cfg, rngs), mesh, seed))
    jax.block_until_ready(params)
    return graphdef, params, dict(param_layout(params, mesh), init_s=time.perf_counter() - start)


def check(f) -> tuple[ModelConfig, object, list[Case], int, dict]:
    """(config, mesh, cases, the share's tp or 0, the int4_moe tiling's fields): every flag and the mesh checked
    before any param is made or anything compiled."""
    if f.config not in config_lib.PRESETS:
        cli.refuse(f, "config", f"is not a preset; choose one of {sorted(config_lib.PRESETS)}")
    for name, minimum in (("layers", 0), ("prefix", 0), ("prefill_tokens", 0), ("reps", 1), ("loop_steps", 0),
                          ("warmup", 0), ("bandwidth_GBps", 1e-3), ("matmul_TFLOPs", 1e-3), ("time_budget_s", 0)):
        cli.at_least(f, name, minimum)
    cli.seed(f)
    cli.int_list(f, "streams", 1)
    cli.int_list(f, "budgets", 1)
    if not f.out:
        cli.refuse(f, "out", "is empty; name the JSON file to write")
    cli.output_path(f, "out", may_exist=f.append)
    cfg = bench_config(f.config, f.scale, f.layers)
    with cli.about(f, "shard_of"):
        share_tp = parse_shard_of(f.shard_of)
    if share_tp and f.mesh not in ("", "tp=1"):
        cli.refuse(f, "mesh", f"--shard_of={f.shard_of} runs one device's share on this one device; drop --mesh")
    if share_tp and f.compile_only:
        cli.refuse(f, "compile_only", "is for a whole model on a mesh; --shard_of runs the share on this device")
    with cli.about(f, "moe_tiling"):        # run() sets it
        moe_tiling = cli.dataclass_fields(f, "moe_tiling", int4_moe_triton.TritonMoeConfig)
        ops.check_int4_moe_tiling(**moe_tiling)
    with cli.about(f, "mesh"):
        mesh = bench_mesh("tp=1" if share_tp else f.mesh)
        model_dir.check_mesh(cfg, mesh)
    if share_tp:  # the share's shapes follow the engine's rules: refuse a tp that does not divide them
        _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
        with cli.about(f, "shard_of"):
            for path, variable in nnx.to_flat_state(abstract):
                sharding.param_spec(path, variable.get_value().shape, {sharding.DATA: 1, sharding.TP: share_tp})
    cases = cases_from_flags(f, cfg.max_position_embeddings, mesh.shape[sharding.DATA])
    with cli.about(f, "streams"):
        for case in cases:
            sharding.check_streams(mesh, case.streams)
    return cfg, mesh, cases, share_tp, moe_tiling


def run(f) -> None:
    start = time.time()
    cfg, mesh, cases, share_tp, moe_tiling = check(f)
    int4_moe_triton.set_default_launcher(f.moe_launcher)
    ops.set_int4_moe_tiling(**moe_tiling)
    ops.set_dense_kernel(f.dense_kernel)
    ops.set_router_kernel(f.router_kernel)
    run = dict(reps=f.reps, warmup=f.warmup, bandwidth=f.bandwidth_GBps * GB, matmul=f.matmul_TFLOPs * 1e12,
               compiler_options=compiler_options(f), compile_only=f.compile_only, profile=bool(f.profile_dir),
               loop_only=f.loop_only, share_tp=share_tp, full_cfg=cfg,
               collective_table=collective_table(f.collective_table) if share_tp else {})
    axis_sizes = {sharding.DATA: 1, sharding.TP: share_tp} if share_tp else dict(mesh.shape)
    meta = dict(code=code_version(), jax=jax.__version__, backend=jax.default_backend(),
                devices=[str(d.device_kind) for d in mesh.devices.flat], mesh=axis_sizes, host=platform.node(),
                date=time.strftime("%Y-%m-%d %H:%M:%S"), config=dataclasses.asdict(cfg), scale=f.scale,
                prefix=f.prefix, moe_launcher=f.moe_launcher, command_buffers=f.command_buffers, reps=f.reps,
                warmup=f.warmup, loop_steps=f.loop_steps,
                shard_of=f.shard_of, loop_only=f.loop_only, exact=f.exact, dense_kernel=f.dense_kernel,
                router_kernel=f.router_kernel, moe_tiling=f.moe_tiling,
                collective_table=f.collective_table if share_tp else "",
                bandwidth_GBps=f.bandwidth_GBps, matmul_TFLOPs=f.matmul_TFLOPs, compile_only=f.compile_only,
                cache="random latents written in place (no prefill), lengths = prefix",
                env={k: os.environ.get(k) for k in ("XLA_FLAGS", "NCCL_NVLS_ENABLE", "XLA_PYTHON_CLIENT_MEM_FRACTION")})
    results = dict(meta=meta, runs=[], floors={}, weights={}, params={}, cases=[])
    previous = previous_results(f.out, meta) if f.append else None
    if previous is not None:  # keep what was measured; errors and skipped cases run again
        results["runs"] = previous.get("runs", [])
        results["cases"] = [c for c in previous["cases"] if "step_ms" in c]
    done = {case_key(c) for c in results["cases"]}
    results["runs"].append(dict(date=meta["date"], host=meta["host"]))

    def dump():
        os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
        with open(f.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)

    where = (f"one device's share of tp={share_tp}" if share_tp else f"mesh {axis_sizes}")
    print(f"{cfg.name}: {cfg.num_layers} layers, {cfg.expert_quant} experts, {cfg.dtype}; {where} on "
          f"{mesh.size} x {mesh.devices.flat[0].device_kind}", flush=True)
    results["floors"]["this_config"] = print_floor(cfg, axis_sizes, f.prefix, run, "this config")
    full = config_lib.preset(f.config)
    if f.scale == "full" and full.num_layers != cfg.num_layers:
        results["floors"]["full_model"] = print_floor(full, axis_sizes, f.prefix, run, f"full {full.name}")
    weights = weight_bytes(cfg, axis_sizes)
    results["weights"] = dataclasses.asdict(weights)

    if share_tp:
        graphdef, params, results["params"] = make_share_params(cfg, share_tp, f.seed)
    else:
        graphdef, params, results["params"] = make_params(cfg, mesh, f.seed, f.compile_only)
    if not f.compile_only:
        print(f"params made in {'the share' if share_tp else 'shards'} in {results['params']['init_s']:.1f} s: "
              f"{results['params']['total_bytes'] / GB:.2f} GB in total, per device "
              f"{[round(b / GB, 3) for b in results['params']['per_device_bytes']]} GB", flush=True)
    dump()

    view = share_view(cfg, share_tp) if share_tp else cfg  # the config the step's code runs with
    steps = {exact: make_step(graphdef, params, mesh, exact) for exact in (False, True)}
    step_loops = {exact: make_step_loop(graphdef, params, mesh, f.loop_steps, exact) if f.loop_steps else None
                  for exact in (False, True)}
    timed_collectives: dict = {}
    if f.profile_dir:
        jax.profiler.start_trace(f.profile_dir)
    try:
        cache, cache_key = None, None
        for case in cases:
            head = dict(kind=case.kind, streams=case.streams, budget=case.budget, nodes=case.nodes,
                        prefix=case.prefix, exact=case.exact)
            if case_key(head) in done:
                continue
            if f.time_budget_s and time.time() - start > f.time_budget_s:
                row = dict(head, skipped=f"time budget {f.time_budget_s:.0f} s spent")
            else:
                try:
                    if cache is None or (case.streams, case.prefix) != cache_key:
                        cache = None  # the previous cache's buffers go before the next is made
                        rows = case.nodes if case.kind == "prefill" else case.prefix + max(
                            c.nodes for c in cases if c.kind != "prefill")
                        cache = random_cache(view, mesh, case.streams, -(-rows // 128) * 128, case.prefix,
                                             f.seed + case.streams, abstract=f.compile_only)
                        cache_key = (case.streams, case.prefix)
                    rng = np.random.default_rng([f.seed, case.streams, case.nodes])  # --exact on / off: same inputs
                    row, cache = run_case(case, steps[case.exact], params, cache, mesh, view, weights, rng,
                                          timed_collectives, run,
                                          step_loops[case.exact] if case.kind != "prefill" else None)
                except Exception as e:  # noqa: BLE001 - a failed case (compile error, out of memory) is a result
                    row = dict(head, error=f"{type(e).__name__}: {str(e)[:2000]}")
                    cache, cache_key = None, None  # a donated cache may be gone: make a new one
            results["cases"].append(row)
            print(format_row(row), flush=True)
            dump()
    finally:
        if f.profile_dir:
            jax.profiler.stop_trace()
    if f.profile_dir:
        results["device_profile"] = device_profile(f.profile_dir)
        for name, p in results["device_profile"].items():
            print(f"{name:>24} | window {p['window_ms']:7.3f} ms: before the device {p['before_device_ms']:7.3f}, "
                  f"span {p['span_ms']:7.3f} (busy {p['busy_ms']:7.3f}), after {p['after_device_ms']:7.3f}")
    results["meta"]["wall_s"] = time.time() - start
    dump()
    print(f"wrote {f.out} in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    cli.script(define_flags, run)
