"""The model's shard_map regions: expert-parallel routed experts, head-parallel tree-verify attention (with its
per-forward plan, `attention_plan`, made for each device's heads), the vocab-parallel embedding lookup, and for the
exact mode o_proj and the dense MLP with their partial sums added in device order (`sum_in_device_order`) and its
other kernels on each device's shards (`per_device`).

The mesh has axes ("data", "tp") (`kdtree_jax.sharding` builds it and places the params). The model code calls
`expert_parallel` and `head_parallel` unconditionally; under a mesh with tp > 1 (`jax.set_mesh`) they wrap the
kernel in a `jax.shard_map` over the shards the params already have, under a data mesh in one over each device's
streams (`per_device`), and without a mesh they call it directly.

The shard_maps check varying manual axes (check_vma, jax's default): the Triton kernels state theirs
(`pallas_kernels.triton_call`), and Mosaic GPU's `plgpu.kernel` traces its body with the check off (both lower inside
`head_parallel`: tests/test_attention_kernel.py). One exception, `_check_vma()`: a kernel run in Pallas' interpret
mode (the CPU tests) is evaluated by jax 0.11.2's HLO interpreter, which mixes the kernel's own constants (no varying
axes) with the blocks of varying operands and fails its own check ("Primitive pad requires varying manual axes to
match"); the compiled GPU kernels never take that path.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import ops

DATA, TP = "data", "tp"
MESH_AXES = (DATA, TP)
STREAMS = "streams"     # in `per_device`'s specs: the stream axis (data where it divides the streams)
MLP_SPECS = (P(TP, None), P(TP, None), P(None, TP))  # gate / up [I, D], down [D, I]: the intermediate axis split


def tp_size(mesh) -> int:
    """Size of the tp axis of a mesh (concrete or abstract); 1 for no mesh."""
    return 1 if mesh is None or mesh.empty else dict(mesh.shape).get(TP, 1)


def expert_parallel(local_moe: Callable, x, experts, ids, weights, shared=None, routed_experts: int | None = None,
                    in_device_order: bool = False):
    """The MoE's expert work in one collective: the routed experts, expert-parallel over tp when the current mesh
    (jax.set_mesh) has tp > 1, plus the shared expert(s).

    local_moe(x [M, D], experts, ids [M, k], weights [M, k]) -> [M, D] must give an id outside [0, E_held) zero
    weight. experts: a pytree of arrays whose leading axis is the expert (E_held of them). shared: None, or
    (mlp, (gate [I, D], up [I, D], down [D, I])) with mlp(x, gate, up, down) -> [M, D]: the shared expert(s), whose I
    axis is split over tp like the dense MLP's. routed_experts: the experts the ids are drawn from (default E_held).

    Under a mesh with tp > 1 each device holds E / tp experts and I / tp shared columns (the shards the params
    already have), sees every token (replicated over tp; split over data when M divides), shifts the ids by its first
    expert, adds its routed and shared partial outputs in f32 and takes ONE psum over tp in x's dtype (bf16 for a
    bf16 model: half the bytes of an f32 sum; an f32 model sums in f32). Without such a mesh: local_moe + mlp,
    summed in f32 (under a data mesh on each device's tokens: `per_device`). in_device_order (the exact mode): the
    devices' f32 partials are gathered and added in device order (`sum_in_device_order`) instead of a psum of the
    sum, then rounded to x's dtype.

    One device's share of a tp deployment without a mesh (`experts` holds fewer than routed_experts, as bench_k26's
    --shard_of builds it): the share computes the pairs of the device that holds the most of the step's distinct
    experts (`most_loaded_first`), the device a tp deployment waits for at this layer; its psum is left out (the
    caller reports the collectives apart).
    """
    tp = tp_size(jax.sharding.get_abstract_mesh())
    held = jax.tree.leaves(experts)[0].shape[0]

    def local(x, experts, ids, weights, shared_params, first):
        out = local_moe(x, experts, ids - first, weights).astype(jnp.float32)
        if shared is not None:
            out = out + shared[0](x, *shared_params).astype(jnp.float32)
        return out

    shared_params = () if shared is None else tuple(shared[1])
    if tp == 1:                                # on each device's tokens under a data mesh
        routed = routed_experts or held
        first = most_loaded_first(ids, held, routed) if routed > held else 0
        return per_device(lambda *args: local(*args, first).astype(x.dtype), (x, experts, ids, weights, shared_params),
                          (P(STREAMS), P(), P(STREAMS), P(STREAMS), P()), P(STREAMS))
    experts_here = _split_count(held, tp, "experts", "routed experts")
    shared_specs = () if shared is None else MLP_SPECS

    def on_device(x, experts, ids, weights, shared_params):
        first = jax.lax.axis_index(TP) * experts_here
        out = local(x, experts, ids, weights, shared_params, first)
        if in_device_order:
            return sum_in_device_order(out, tp).astype(x.dtype)
        return jax.lax.psum(out.astype(x.dtype), TP)

    return per_device(on_device, (x, experts, ids, weights, shared_params),
                      (P(STREAMS), P(TP), P(STREAMS), P(STREAMS), shared_specs), P(STREAMS))


def sum_in_device_order(partial, tp: int):
    """Inside a shard_map over tp (of size tp): every device's partial (f32) added in device order, ((p_0 + p_1) +
    p_2) + ..., the same on every device. A psum of the partials (NCCL's ring) adds an element's terms in an order
    set by the element's offset in the buffer, so a row summed among other rows (a tree verify) and alone (an AR
    step) could round differently; this order depends on nothing but tp. The partials travel as one psum of a
    [tp, ...] buffer that holds each device's partial in its own slot and zeros elsewhere (a sum of one value and
    zeros is that value in any order): tp times the bytes of the plain psum."""
    slots = jnp.zeros((tp, *partial.shape), partial.dtype).at[jax.lax.axis_index(TP)].set(partial)
    parts = jax.lax.psum(slots, TP)
    total = parts[0]
    for d in range(1, tp):
        total = total + parts[d]
    return total


def _sum_of_partials(partial: Callable, x, weights, x_spec: tuple, weight_specs: tuple):
    """Inside a shard_map over tp (streams on data where they divide it): partial(x, *weights) -> f32 [S, T, D] on
    each device's shards, the partials added in device order (`sum_in_device_order`) -> [S, T, D] f32. x_spec: x's
    spec after its stream axis; weight_specs: one per weight."""
    tp = tp_size(jax.sharding.get_abstract_mesh())
    return per_device(lambda x, *w: sum_in_device_order(partial(x, *w), tp), (x, *weights),
                      (P(STREAMS, *x_spec), *weight_specs), P(STREAMS))


def mlp_parallel(mlp: Callable, x, gate, up, down):
    """The dense MLP with its intermediate columns split over tp, the devices' partial outputs added in device order
    (the exact mode; `sum_in_device_order`). mlp(x, gate, up, down, out_dtype) -> [..., D]; x [S, T, D], gate / up
    [I, D], down [D, I] -> [S, T, D] in x's dtype. Without a mesh with tp > 1: mlp in x's dtype (on each device's
    streams: `per_device`)."""
    tp = tp_size(jax.sharding.get_abstract_mesh())
    if tp == 1:
        return per_device(lambda *a: mlp(*a, None), (x, gate, up, down), (P(STREAMS), P(), P(), P()), P(STREAMS))
    _split_count(gate.shape[0], tp, "intermediate", "MLP columns")

    def partial(x, gate, up, down):
        return mlp(x, gate, up, down, jnp.float32)
    return _sum_of_partials(partial, x, (gate, up, down), (), MLP_SPECS).astype(x.dtype)


def head_parallel_product(product: Callable, x, w):
    """o_proj over heads split on tp, its sum over the heads in an order that depends on tp alone (the exact mode).

    x [S, T, H, V], w [D, H, V], product(a [S, T, K], b [D, K]) -> [S, T, D] f32 with K the (local) heads x V ->
    [S, T, D] f32. Under a mesh with tp > 1 (where `MLA._exact` calls it; otherwise o_proj is one product with the
    residual in its epilogue) each device multiplies its H / tp heads (the shards x and w already have) and the
    partials are added in device order (`sum_in_device_order`)."""
    tp = tp_size(jax.sharding.get_abstract_mesh())
    _split_count(x.shape[2], tp, "heads", "attention heads")

    def partial(x, w):
        return product(x.reshape(*x.shape[:-2], -1), w.reshape(w.shape[0], -1))
    return _sum_of_partials(partial, x, (w,), (None, TP, None), (P(None, TP, None),))


def per_device(fn: Callable, args: tuple, in_specs: tuple, out_specs):
    """fn(*args) on each device's shards: a shard_map over every axis of the current mesh when it has more than one
    device, else fn(*args). For kernels, which GSPMD cannot partition: the exact mode's run only where nothing is
    left to partition (`ops.exact_kernels_take`; outside a shard_map under tp or data their XLA references run, 5-22x
    slower at K2.6's shapes), and under a data mesh the attention and the experts of both modes. Not inside a
    shard_map over only some axes (a ValueError). Specs as shard_map's, with STREAMS for the stream axis: data where
    it divides args[0]'s first dim (the streams, or the tokens of [S T, D]), else unsplit. What fn computes from
    operands replicated over an axis stays replicated over it (each device computes it, as GSPMD would); a
    replicated param (a norm's weight) may be closed over instead of passed."""
    if ops.unpartitioned():                    # no mesh, one device, or inside a shard_map over every axis
        return fn(*args)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.manual_axes:
        raise ValueError(f"parallel.per_device inside a shard_map over {sorted(mesh.manual_axes)} only: call it "
                         "outside, or inside a shard_map over every mesh axis")
    streams = _stream_axis(mesh, args[0].shape[0])

    def resolve(spec):
        return P(*(streams if axis == STREAMS else axis for axis in spec))
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    in_specs, out_specs = jax.tree.map(resolve, (in_specs, out_specs), is_leaf=is_spec)
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=_check_vma())(*args)


def most_loaded_first(ids, held: int, routed: int):
    """The first expert id of the device, among routed / held devices of `held` consecutive experts each, that holds
    the most distinct experts of ids [M, k] (ties: the most pairs, then the lowest device). Scalar int32."""
    devices = routed // held
    flat = ids.reshape(-1)
    distinct = jnp.zeros((routed,), jnp.int32).at[flat].set(1).reshape(devices, held).sum(axis=1)
    pairs = jnp.zeros((devices,), jnp.int32).at[flat // held].add(1)
    return (jnp.argmax(distinct * (flat.size + 1) + pairs) * held).astype(jnp.int32)


def attention_plan(prefix_len, visible, num_heads: int):
    """`ops.tree_verify_plan` for a forward's `head_parallel` calls of num_heads heads: built for the heads each
    device attends for (num_heads / tp under a mesh with tp > 1), once per forward, outside the shard_map."""
    tp = tp_size(jax.sharding.get_abstract_mesh())
    return ops.tree_verify_plan(prefix_len, visible, num_heads=_split_count(num_heads, tp, "heads", "attention heads"))


def head_parallel(attention: Callable, q_lat, q_rope, c_kv, k_rope, prefix_len, visible, plan=None):
    """Tree-verify attention with its heads split over tp when the current mesh has tp > 1.

    attention(q_lat [S, T, H, C], q_rope [S, T, H, R], c_kv [S, N, C], k_rope [S, N, R], prefix_len [S],
    visible [S, T, T], plan) -> [S, T, H, C]; plan: `attention_plan`'s, or None. A Pallas call cannot be partitioned
    by XLA, so without this every device would gather all H heads and attend for all of them; under shard_map each
    device attends for its own H / tp heads over the replicated latent cache, and no collective is needed (o_proj is
    split on heads too). Streams stay split over data when it divides S (`per_device`; with tp = 1 each device
    attends for all heads of its streams).
    """
    _split_count(q_lat.shape[2], tp_size(jax.sharding.get_abstract_mesh()), "heads", "attention heads")
    per_head = P(STREAMS, None, TP, None)
    return per_device(attention, (q_lat, q_rope, c_kv, k_rope, prefix_len, visible, plan),
                      (per_head, per_head) + (P(STREAMS),) * 5, per_head)


def vocab_parallel_embed(table, tokens):
    """Rows of the embedding table, split on its vocab axis over tp when the current mesh has tp > 1.

    table [V, D], tokens [S, T] int -> [S, T, D]. Left to XLA, a lookup of a single token (an AR step at one stream)
    becomes a dynamic slice of the vocab-split table, which the GPU partitioner serves by all-gathering the whole
    table: 2.35 GB and 5 ms per step for K2.6 at tp=2 on 2 x H200 (experiments/notes/sharding.md). Here each device
    looks the tokens up in its own V / tp rows (zero rows for the others' tokens) and one psum over tp adds them:
    S x T x D values on the wire. Streams stay split over data when it divides S.
    """
    mesh = jax.sharding.get_abstract_mesh()
    tp = tp_size(mesh)
    if tp == 1:
        return jnp.take(table, tokens, axis=0)
    rows_here = _split_count(table.shape[0], tp, "vocab", "vocabulary entries")
    streams = P(_stream_axis(mesh, tokens.shape[0]))

    def local(table, tokens):
        ids = tokens - jax.lax.axis_index(TP) * rows_here
        mine = (ids >= 0) & (ids < rows_here)
        rows = jnp.take(table, jnp.where(mine, ids, 0), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], rows, jnp.zeros_like(rows)), TP)

    return jax.shard_map(local, in_specs=(P(TP), streams), out_specs=streams)(table, tokens)


def _split_count(count: int, tp: int, name: str, what: str) -> int:
    """count / tp, or a ValueError naming the axis that tp does not divide."""
    if count % tp:
        raise ValueError(f"{name} = {count} is not divisible by {TP} = {tp}; choose a {TP} size that divides the "
                         f"number of {what}")
    return count // tp


def _stream_axis(mesh, num_streams: int) -> str | None:
    """The mesh axis that splits the streams: data, when the mesh has one that divides them; else none."""
    data = dict(mesh.shape).get(DATA, 1)
    return DATA if data > 1 and num_streams % data == 0 else None


def _check_vma() -> bool:
    """False only while the kernels run in interpret mode (see the module docstring)."""
    return not ops.interprets()
