"""The device mesh and where every array lives on it (DESIGN.md section 5).

One mesh, axes ("data", "tp"), both of type Auto (XLA's SPMD partitioner carries the shardings set at the jit boundary
through the unchanged model code):
  tp    tensor and expert parallelism inside a host: attention heads (q_b_proj / q_proj, kv_b_proj, o_proj), the
        intermediate dim of the dense and shared MLPs, the routed experts (expert parallelism over the leading E axis,
        bf16 stacks and INT4 packed/scale arrays alike), the vocabulary of embed_tokens and lm_head.
  data  streams: the leading S axis of the caches, the tokens and every per-stream array of the decode loop.
Everything else is replicated over tp: the MLA latent cache (each device attends over it with its own heads), the
norms, q_a_proj and kv_a_proj, the router (every device routes the replicated hidden state itself) and the whole
drafter. A decoder layer then needs two collectives: one all-reduce after attention (o_proj's heads) and one after
the MoE (routed experts and the shared expert's slice summed before it), `model.parallel`.

A param's PartitionSpec follows from its own name: PARAM_AXES gives its logical axes (one per dim), RULES maps a logical
axis to a mesh axis. The routed experts run under `jax.shard_map` (`model.parallel.expert_parallel`): every device
applies its local experts to all tokens and one psum over tp adds the partial outputs; no expert weight ever leaves its
device.
"""
from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from kdtree_jax.model.moe import random_int4_experts
from kdtree_jax.model.parallel import DATA, MESH_AXES, TP, tp_size
from pallas_kernels.int4_moe import GROUP as INT4_GROUP, Int4Experts


# Logical axes of every target param, by the param's own name (the last name of its path).
PARAM_AXES: dict[str, tuple] = {
    "embed_tokens": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "weight": ("norm",),  # every RMSNorm
    "q_a_proj": ("q_lora", "embed"),  # the dense products' weights: [out..., in]
    "q_b_proj": ("heads", "qk_head_dim", "q_lora"),
    "q_proj": ("heads", "qk_head_dim", "embed"),
    "kv_a_proj": ("kv_latent", "embed"),
    "kv_b_proj": ("kv_lora", "heads", "kv_head_dim"),  # the absorbed attention's operand: [in, heads, out]
    "o_proj": ("embed", "heads", "v_head_dim"),
    "gate_proj": ("mlp", "embed"),  # dense MLP and shared expert(s)
    "up_proj": ("mlp", "embed"),
    "down_proj": ("embed", "mlp"),
    "gate": ("router", "embed"),  # the router: replicated, so that every device routes its tokens with no collective
    "e_score_correction_bias": ("router",),
    "w_gate": ("experts", "embed", "expert_mlp"),
    "w_up": ("experts", "embed", "expert_mlp"),
    "w_down": ("experts", "expert_mlp", "embed"),
    **{name: ("experts", "int4_rows", "int4_cols") for name in Int4Experts._fields},
}

# Logical axis -> mesh axis; a logical axis not named here is never split.
RULES: dict[str, str] = {"vocab": TP, "heads": TP, "mlp": TP, "experts": TP, "streams": DATA}


# ----------------------------------------------------------------------------------------------- the mesh

def make_mesh(tp: int = 1, data: int = 1, devices=None) -> Mesh:
    """A ("data", "tp") mesh over the first data * tp devices (default jax.devices(), every host's)."""
    for name, size in ((DATA, data), (TP, tp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name}={size!r} must be a positive integer")
    devices = list(jax.devices() if devices is None else devices)
    if data * tp > len(devices):
        raise ValueError(f"a mesh of data={data} x tp={tp} needs {data * tp} devices but {len(devices)} are "
                         f"available; shrink the mesh (or set XLA_FLAGS=--xla_force_host_platform_device_count=N "
                         f"before jax starts, for N fake CPU devices)")
    return jax.make_mesh((data, tp), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:data * tp])


def parse_mesh(text: str) -> Mesh | None:
    """'tp=8' | 'data=2,tp=4' -> the mesh (unnamed axes have size 1); '' -> None (one device, no mesh)."""
    if not text.strip():
        return None
    sizes = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES or not value.strip().isdigit() or name in sizes:
            raise ValueError(f"mesh {text!r}: {part!r} is not 'axis=size' with axis one of {MESH_AXES} (each once); "
                             f"write e.g. 'tp=8' or 'data=2,tp=4'")
        sizes[name] = int(value)
    return make_mesh(tp=sizes.get(TP, 1), data=sizes.get(DATA, 1))


def under_mesh(mesh: Mesh, fn: Callable) -> Callable:
    """fn, called (and so traced) with jax.set_mesh(mesh) active: the mesh `expert_parallel` reads."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with jax.set_mesh(mesh):
            return fn(*args, **kwargs)
    return call


# ----------------------------------------------------------------------------------------------- params

def param_spec(path: tuple, shape: tuple, axis_sizes: Mapping[str, int]) -> P:
    """PartitionSpec of the target param at `path` (state keys, e.g. ("layers", 1, "mlp", "w_gate")).

    axis_sizes: the mesh's {"data": ..., "tp": ...}. Raises ValueError when a split axis does not divide.
    """
    spec, problems = _param_spec(path, shape, axis_sizes)
    if problems:
        raise ValueError(_divide_message(problems, axis_sizes))
    return spec


def param_shardings(params, mesh: Mesh):
    """The NamedSharding of every param of a target state (nnx.State or pure dict), same tree.

    Raises one ValueError naming every logical axis (heads, experts, vocab, mlp) that the mesh does not divide.
    """
    problems: dict = {}

    def one(path, leaf):
        spec, bad = _param_spec(path, leaf.shape, mesh.shape)
        problems.update(bad)
        return NamedSharding(mesh, spec)

    shardings = jax.tree_util.tree_map_with_path(one, params)
    if problems:
        raise ValueError(_divide_message(problems, mesh.shape))
    return shardings


def shard_params(params, mesh: Mesh):
    """device_put every target param into its shards (a no-op for params already placed so)."""
    return jax.device_put(params, param_shardings(params, mesh))


def replicate(tree, mesh: Mesh):
    """device_put a pytree (the drafter's params) whole onto every device of the mesh."""
    return jax.device_put(tree, replicated(mesh))


def restore_shardings(mesh: Mesh) -> Callable[[tuple, jax.ShapeDtypeStruct], NamedSharding]:
    """The `shardings` argument of checkpoint.restore_target: orbax reads each device's shard only."""
    return lambda path, shape: NamedSharding(mesh, param_spec(path, shape.shape, mesh.shape))


def import_placer(mesh: Mesh) -> Callable[[tuple, np.ndarray], jax.Array]:
    """The `place` argument of hf_import.load_hf_checkpoint: each device receives its own slice of the host array."""
    def place(path, host):
        sharding = NamedSharding(mesh, param_spec(path, host.shape, mesh.shape))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return place


def _names(path) -> tuple[str, ...]:
    """The string keys of a state path (jax key entries or plain keys), e.g. ("layers", "mlp", "w_gate")."""
    keys = (getattr(k, "key", getattr(k, "idx", k)) for k in path if not isinstance(k, jax.tree_util.GetAttrKey))
    return tuple(k for k in keys if isinstance(k, str))


def _param_spec(path, shape, axis_sizes) -> tuple[P, dict]:
    names = _names(path)
    where = "/".join(names)
    if not names or names[-1] not in PARAM_AXES:
        raise ValueError(f"param {where or path!r} has no sharding rule; add its name to sharding.PARAM_AXES")
    axes = PARAM_AXES[names[-1]]
    if len(axes) != len(shape):
        raise ValueError(f"param {where} has shape {tuple(shape)} but sharding.PARAM_AXES names {len(axes)} axes "
                         f"{axes}; update the rule for {names[-1]!r}")
    return _logical_spec(axes, shape, axis_sizes, where)


def _logical_spec(axes, shape, axis_sizes, where: str) -> tuple[P, dict]:
    """(PartitionSpec, {(logical axis, size, mesh axis): where} for every split that does not divide)."""
    spec, problems = [], {}
    for axis, size in zip(axes, shape):
        mesh_axis = RULES.get(axis)
        n = axis_sizes.get(mesh_axis, 1) if mesh_axis else 1
        if size % n:
            problems[(axis, size, mesh_axis)] = where
        spec.append(mesh_axis if n > 1 else None)
    return P(*spec), problems


def _divide_message(problems: dict, axis_sizes) -> str:
    lines = [f"{axis} = {size} (e.g. {where}) is not divisible by {mesh_axis} = {axis_sizes[mesh_axis]}"
             for (axis, size, mesh_axis), where in sorted(problems.items())]
    return ("the mesh does not divide the model: " + "; ".join(lines)
            + "; choose a mesh axis size that divides every one of these")


# ----------------------------------------------------------------------------------------------- streams

def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def stream_sharding(mesh: Mesh, axis: int = 0) -> NamedSharding:
    """Arrays whose dim `axis` is the stream axis S, split over data (caches [S, N, ...], tokens [S, T], ...)."""
    return NamedSharding(mesh, P(*([None] * axis), RULES["streams"]))


def check_streams(mesh: Mesh, num_streams: int) -> None:
    data = mesh.shape[DATA]
    if num_streams % data:
        raise ValueError(f"{num_streams} streams do not divide over the mesh's data axis ({DATA} = {data}); "
                         f"pass a multiple of {data} prompts or use a mesh with a smaller data axis")


# ----------------------------------------------------------------------------------------------- random params

def init_in_shards(make_model: Callable, mesh: Mesh, seed: int = 0):
    """make_model(nnx.Rngs(seed)) (a target model) with random params made on the devices, each in its shards.

    No param is ever whole on one device or on the host, so a model larger than one device (Kimi K2.6 on 8 GPUs) can
    be made for benchmarks. The model's own initializers run in one jit whose out_shardings are `param_shardings`:
    with jax's partitionable threefry, XLA generates on each device only its slice. The INT4 routed experts are left
    out of that jit (XLA drops their unused computation), since their one-time repack is a lax.map over the expert
    axis that the partitioner would run whole on every device; instead, one MoE layer at a time, each device makes its
    own E / tp experts under a shard_map with the MoE module's INT4 path (`random_int4_experts`, a key per tp index).
    The values therefore differ from make_model(nnx.Rngs(seed)) on one device; shapes, dtypes and shardings do not.
    """
    int4 = lambda path, _: path[-1] in Int4Experts._fields  # noqa: E731
    graphdef, int4_state, rest = nnx.split(nnx.eval_shape(lambda: make_model(nnx.Rngs(seed))), int4, ...)
    rest = jax.jit(lambda: nnx.split(make_model(nnx.Rngs(seed)), int4, ...)[2],
                   out_shardings=param_shardings(rest, mesh))()
    modules: dict = {}
    for path, variable in nnx.to_flat_state(int4_state):
        modules.setdefault(path[:-1], {})[path[-1]] = variable
    tp, makers = tp_size(mesh), {}

    def maker(shapes: Int4Experts, specs: Int4Experts):
        """One jitted shard_map per distinct expert shape: each device makes its E / tp experts."""
        if (shapes, specs) not in makers:
            def local(key):
                # tp = 1 leaves the expert axis unsplit (spec None): the key must not vary over tp then
                rngs = nnx.Rngs(jax.random.fold_in(key, jax.lax.axis_index(TP)) if tp > 1 else key)
                return random_int4_experts(rngs, shapes.gate_packed[0] // tp, shapes.down_packed[1],
                                           shapes.gate_packed[1], INT4_GROUP)
            makers[(shapes, specs)] = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=specs))
        return makers[(shapes, specs)]

    for number, (module, variables) in enumerate(modules.items()):
        shapes = Int4Experts(*(variables[name].get_value().shape for name in Int4Experts._fields))
        specs = Int4Experts(*(param_spec(module + (name,), shape, mesh.shape)
                              for name, shape in zip(Int4Experts._fields, shapes)))
        made = maker(shapes, specs)(jax.random.fold_in(jax.random.key(seed), number))
        for name, value in made._asdict().items():
            if value.shape != getattr(shapes, name):
                raise ValueError(f"{'/'.join(map(str, module))}/{name}: made {value.shape}, the model holds "
                                 f"{getattr(shapes, name)}; random_int4_experts and the model disagree")
            variables[name].set_value(value)
    return nnx.merge(graphdef, int4_state, rest)
