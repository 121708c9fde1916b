"""The ("data", "tp") mesh on 8 fake CPU devices: sharded == single-device, collectives, sharded loading, guard rails.

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before jax starts and the rest of the suite keeps its
single device, so `test_on_8_cpu_devices` runs this file again in a child pytest process with the flag set; the tests
below run only there (skipped in the parent, which reports the child's output on failure).
"""
import importlib.util
import os
import re
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import OracleDrafter, causal_logits, rel_err, run_in_child
from kdtree_jax import checkpoint, config, hf_import, sharding
from kdtree_jax.cache import init_cache
from kdtree_jax.decode import DecodeSpec, Decoder
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer
from pallas_kernels import batch_invariant, ops

DEVICES = 8
IN_CHILD = os.environ.get("KDTREE_SHARDING_CHILD") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# heads, experts, vocab and both MLP widths divide 8; float32 so that only the reduction order differs.
CFG = config.tiny().replace(num_heads=8, num_experts=16)
BLOCK = 6
PROMPTS = [[5, 9, 14, 3, 8, 1, 7, 22, 40], [11, 2], [4, 60, 4, 61, 4], [7]]  # ragged; 4 streams split over data=2

on_devices = pytest.mark.skipif(not IN_CHILD, reason="runs in the 8-device child process (test_on_8_cpu_devices)")


@pytest.mark.skipif(IN_CHILD, reason="this is the child")
def test_on_8_cpu_devices():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    run_in_child(__file__, dict(XLA_FLAGS=flags, KDTREE_SHARDING_CHILD="1"), "test_on_8_cpu_devices")


@pytest.fixture(scope="module")
def models():
    assert len(jax.devices()) == DEVICES
    target = Transformer(CFG, nnx.Rngs(0))
    return target, Drafter(config.tiny_drafter(CFG, BLOCK), CFG, nnx.Rngs(1))


def sharded_forward(model, mesh, tokens):
    """The causal forward of `model` with its params in their shards -> (logits, lowered text, compiled HLO, params)."""
    graphdef, params = nnx.split(model)
    params = sharding.shard_params(params, mesh)
    fn = jax.jit(lambda p, t: causal_logits(nnx.merge(graphdef, p), t))
    with jax.set_mesh(mesh):
        lowered = fn.lower(params, tokens)
    compiled = lowered.compile()
    return compiled(params, tokens), lowered.as_text(), compiled.as_text(), params


def collectives(hlo: str, op: str) -> list[str]:
    """Result shapes (e.g. 'f32[16,64,32]'; each element of a combined tuple) of every `op` in compiled HLO text."""
    shapes = []
    for match in re.finditer(rf"= ([^=]*?) {op}(?:-start)?\(", hlo):
        shapes += re.findall(r"\w+\[[\d,]*\]", match.group(1))
    return shapes


def full_shapes_of_split_params(params) -> set[str]:
    """HLO shape strings of every param that the mesh splits: none may ever be gathered whole."""
    out = set()
    for _, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if any(a is not None for a in x.sharding.spec):
            dtype = {"float32": "f32", "bfloat16": "bf16", "int32": "s32"}[str(x.dtype)]
            out.add(f"{dtype}[{','.join(map(str, x.shape))}]")
    return out


@on_devices
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_forward_equals_single_device(models, tp):
    target, _ = models
    tokens = jax.random.randint(jax.random.key(tp), (2, 9), 0, CFG.vocab_size)
    expect = jax.jit(lambda t: causal_logits(target, t))(tokens)
    got, _, hlo, params = sharded_forward(target, sharding.make_mesh(tp=tp), tokens)
    assert rel_err(got, expect) < 1e-5
    attn, moe = params["layers"][1]["self_attn"], params["layers"][1]["mlp"]
    assert {s.data.shape for s in attn["q_b_proj"][...].addressable_shards} == {(8 // tp, 24, 32)}
    assert {s.data.shape for s in moe["w_down"][...].addressable_shards} == {(16 // tp, 32, 64)}
    assert "all-reduce" in hlo


@on_devices
@pytest.mark.parametrize("quant", ["bf16", "int4"])
def test_step_collectives_psum_and_no_weight_gather(models, quant):
    """tp=8: one psum per MoE layer (XLA may fuse it with the shared expert's all-reduce into one tuple all-reduce)
    and one for the vocab-parallel embedding lookup; the only all-gather is the router's scores; no split param is
    ever gathered whole."""
    model = models[0] if quant == "bf16" else Transformer(CFG.replace(expert_quant="int4"), nnx.Rngs(2))
    tokens = jax.random.randint(jax.random.key(7), (2, 9), 0, CFG.vocab_size)
    expect = jax.jit(lambda t: causal_logits(model, t))(tokens)
    got, lowered, hlo, params = sharded_forward(model, sharding.make_mesh(tp=8), tokens)
    assert rel_err(got, expect) < 1e-5
    moe_layers = CFG.num_layers - CFG.first_k_dense
    assert lowered.count("stablehlo.all_reduce") == moe_layers + 1  # the shard_maps' psums, before XLA partitions
    m, d = tokens.size, CFG.hidden_size
    assert collectives(hlo, "all-reduce").count(f"f32[{m},{d}]") >= moe_layers
    gathered = set(collectives(hlo, "all-gather"))
    assert gathered <= {f"f32[{m},{CFG.num_experts}]"}, gathered  # the router's scores, split by expert, at most
    assert not gathered & full_shapes_of_split_params(params)


@on_devices
def test_decode_equals_single_device_token_for_token(models):
    target, drafter = models
    max_new = 10
    expect = Decoder(target).generate(PROMPTS, DecodeSpec(max_new_tokens=max_new)).tokens
    tp8 = Decoder(target, drafter, mesh=sharding.make_mesh(tp=8))
    for policy in ("ar", "chain", "ddtree"):
        spec = DecodeSpec(policy=policy, budget=8, block_size=BLOCK, max_new_tokens=max_new)
        assert tp8.generate(PROMPTS, spec).tokens == expect, policy
    assert {s.data.shape for s in tp8.target_params["embed_tokens"][...].addressable_shards} == {(64, 64)}
    mixed = Decoder(target, drafter, mesh=sharding.parse_mesh("data=2,tp=4"))
    spec = DecodeSpec(policy="ddtree", budget=8, block_size=BLOCK, max_new_tokens=max_new)
    assert mixed.generate(PROMPTS, spec).tokens == expect


@on_devices
def test_exact_mode_under_tensor_parallelism_equals_ar_on_the_same_mesh():
    """bf16, the exact mode on data=2,tp=4 (o_proj's, the dense MLP's and the MoE's partial sums added in device
    order, not by a psum): greedy ddtree == ar on the same mesh token for token, with an oracle drafter (multi-token
    rounds: accepted tree rows compacted into the cache). The single-device exact tests cover chain and a random
    drafter (test_exact.py)."""
    cfg = CFG.replace(dtype="bfloat16")
    target = Transformer(cfg, nnx.Rngs(0))
    mesh = sharding.parse_mesh("data=2,tp=4")
    truth = Decoder(target, mesh=mesh).generate(PROMPTS, DecodeSpec(max_new_tokens=24, exact=True)).tokens
    seqs = np.zeros((len(PROMPTS), 64), np.int32)
    for i, (p, out) in enumerate(zip(PROMPTS, truth)):
        seqs[i, :len(p) + len(out)] = p + out
    decoder = Decoder(target, OracleDrafter(config.tiny_drafter(cfg, BLOCK), seqs), mesh=mesh)
    spec = DecodeSpec(policy="ddtree", budget=8, block_size=BLOCK, max_new_tokens=24, exact=True)
    result = decoder.generate(PROMPTS, spec)
    assert result.tokens == truth and result.taus[result.taus > 0].mean() > 1.5


@on_devices
def test_exact_partials_travel_in_slots_and_are_added_in_device_order(models):
    """The exact forward under tp=4: o_proj's and the MoE's partials travel in their devices' slots (f32 [tp, M, D],
    one value and zeros per element: exact in any order) and are added in device order, as are the dense MLP's; no
    all-reduce sums the partials themselves."""
    target = Transformer(CFG.replace(dtype="bfloat16"), nnx.Rngs(0))
    mesh = sharding.make_mesh(tp=4)
    graphdef, params = nnx.split(target)
    params = sharding.shard_params(params, mesh)
    tokens = np.asarray([[5, 9, 14, 3]], np.int32)
    positions = np.arange(4, dtype=np.int32)[None]
    visible = np.tril(np.ones((4, 4), bool))[None]

    def forward(p, t):
        model = nnx.merge(graphdef, p)
        return model(t, positions, init_cache(model.cfg, 1, 4), visible, exact=True).logits
    with jax.set_mesh(mesh):
        hlo = jax.jit(forward).lower(params, tokens).compile().as_text()
    d = CFG.hidden_size
    summed = collectives(hlo, "all-reduce")
    slotted = [s for s in summed if s.startswith("f32[4,") and s.endswith(f",{d}]")]
    assert len(slotted) >= 2 * CFG.num_layers - CFG.first_k_dense, summed
    others = [s for s in summed if s.endswith(f",{d}]") and s not in slotted]
    assert others == [f"f32[1,4,{d}]"], summed   # the embedding lookup's psum (a row and zeros; CPU's all-reduce in f32)


@on_devices
@pytest.mark.parametrize("mesh_text", ["tp=4", "data=2,tp=4", "data=4"])
def test_decode_with_every_kernel_in_interpret_mode_equals_one_device(mesh_text):
    """Every Pallas kernel the model calls, in Pallas' interpret mode, under a mesh: tree-verify attention per head
    group inside its shard_map (data=4: per stream, `parallel.per_device`), tree build and accept in the loop (int4_moe per expert group runs its reference:
    its Triton kernel has no interpret mode). ar, chain and ddtree (ragged
    batch, INT4 experts, an oracle drafter so that rounds accept several nodes and branch) give one device's greedy
    tokens (pure-JAX references). Failed before the kernels stated their varying axes."""
    cfg = CFG.replace(expert_quant="int4", num_layers=2)
    target = Transformer(cfg, nnx.Rngs(3))
    max_new = 6
    truth = Decoder(target).generate(PROMPTS, DecodeSpec(max_new_tokens=max_new + BLOCK)).tokens
    sequences = np.zeros((len(PROMPTS), 32), np.int32)
    for i, (prompt, out) in enumerate(zip(PROMPTS, truth)):
        sequences[i, :len(prompt) + len(out)] = prompt + out
    decoder = Decoder(target, OracleDrafter(config.tiny_drafter(cfg, BLOCK), sequences),
                      mesh=sharding.parse_mesh(mesh_text))
    with ops.implementation("kernel", interpret=True):
        for policy in ("ar", "chain", "ddtree"):
            got = decoder.generate(PROMPTS, DecodeSpec(policy=policy, budget=8, block_size=BLOCK,
                                                       max_new_tokens=max_new))
            assert got.tokens == [t[:max_new] for t in truth], policy
            if policy == "ddtree":
                assert got.taus[got.taus > 0].mean() > 1.5  # the accept walk goes past the root


@on_devices
def test_compiled_kernels_trace_inside_shard_map_with_vma_checks():
    """The GPU path's contract, checked on the CPU by tracing (no lowering): with the compiled (not interpreted)
    Pallas kernels, the shard_maps keep check_vma on, and tree-verify attention states how its outputs vary over the
    mesh. Before the kernels stated their varying axes, this raised 'manual_axis_type on jax.ShapeDtypeStruct must not be
    None', as the first 2 x H200 run did. (int4_moe's Triton kernel does not trace without a CUDA jaxlib; off the GPU
    the reference runs in its place. Its wrapper, `pallas_kernels.triton_call`, states the varying axes the same way;
    it ran inside the expert-parallel shard_map on 2 x H200: experiments/notes/sharding.md.)"""
    model = Transformer(CFG.replace(expert_quant="int4", num_layers=2), nnx.Rngs(4))
    graphdef, params = nnx.split(model)
    mesh = sharding.parse_mesh("data=2,tp=4")
    params = sharding.shard_params(params, mesh)
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, CFG.vocab_size)
    with ops.implementation("kernel", interpret=False), jax.set_mesh(mesh):
        traced = jax.jit(lambda p, t: causal_logits(nnx.merge(graphdef, p), t)).trace(params, tokens)
    text = str(traced.jaxpr)
    assert "tree_verify_attention" in text


def _assert_only_own_shards(params, mesh, reference):
    """Every param lives on all mesh devices, each holding exactly its slice of `reference` (a pure dict)."""
    flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, expect in jax.tree_util.tree_flatten_with_path(reference)[0]:
        x = flat[path]
        spec = sharding.param_spec(path, x.shape, mesh.shape)
        assert x.sharding.spec == spec, path
        assert len(x.addressable_shards) == DEVICES
        for shard in x.addressable_shards:
            assert shard.data.shape == x.sharding.shard_shape(x.shape), path
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(expect)[shard.index], err_msg=str(path))


@on_devices
def test_hf_import_places_each_shard_on_its_device(tmp_path, models):
    target, _ = models
    mesh = sharding.make_mesh(tp=8)
    directory = hf_import.export_hf_checkpoint(target, str(tmp_path / "hf"))
    loaded = hf_import.load_hf_checkpoint(directory, dtype=CFG.dtype, place=sharding.import_placer(mesh),
                                          progress=False)
    reference = nnx.to_pure_dict(nnx.state(target, nnx.Param))
    _assert_only_own_shards(nnx.to_pure_dict(nnx.state(loaded, nnx.Param)), mesh, reference)
    w_gate = loaded.layers[1].mlp.w_gate[...]
    assert {s.data.shape for s in w_gate.addressable_shards} == {(2, CFG.hidden_size, CFG.moe_intermediate_size)}


@on_devices
def test_orbax_restore_into_shards_int4(tmp_path):
    model = Transformer(CFG.replace(expert_quant="int4", num_layers=2), nnx.Rngs(5))
    mesh = sharding.parse_mesh("data=2,tp=4")
    path = checkpoint.save(str(tmp_path / "ckpt"), model)
    restored = checkpoint.restore_target(path, shardings=sharding.restore_shardings(mesh))
    reference = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    _assert_only_own_shards(nnx.to_pure_dict(nnx.state(restored, nnx.Param)), mesh, reference)
    packed = restored.layers[1].mlp.gate_packed[...]
    assert packed.sharding.shard_shape(packed.shape)[0] == CFG.num_experts // 4


@on_devices
@pytest.mark.parametrize("tp", [1, 4])
def test_init_in_shards_int4_experts(tp):
    """Random params made in their shards (bench_k26): each device makes its E / tp experts; tp = 1 leaves them whole."""
    cfg = CFG.replace(expert_quant="int4", num_layers=2)
    model = sharding.init_in_shards(lambda rngs: Transformer(cfg, rngs), sharding.make_mesh(tp=tp), seed=3)
    packed = model.layers[1].mlp.gate_packed[...]
    expect = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(3))).layers[1].mlp.gate_packed.get_value()
    assert packed.shape == expect.shape and packed.dtype == expect.dtype
    assert packed.sharding.shard_shape(packed.shape)[0] == cfg.num_experts // tp
    assert len(np.unique(np.asarray(packed))) > 1


@on_devices
def test_mesh_that_does_not_divide_raises(models):
    target, drafter = models
    bad = config.tiny().replace(num_heads=4, num_experts=12, vocab_size=500, intermediate_size=100)
    with pytest.raises(ValueError) as err:
        Decoder(Transformer(bad, nnx.Rngs(0)), mesh=sharding.make_mesh(tp=8))
    for axis in ("heads = 4", "experts = 12", "vocab = 500", "mlp = 100"):
        assert axis in str(err.value) and "tp = 8" in str(err.value), (axis, err.value)
    with pytest.raises(ValueError, match="streams do not divide"):
        Decoder(target, mesh=sharding.parse_mesh("data=2,tp=4")).generate(PROMPTS[:3], DecodeSpec(max_new_tokens=2))
    for text, match in (("tp=16", "needs 16 devices"), ("pp=2", "axis=size"), ("tp=0", "positive"),
                        ("tp=2,tp=4", "axis=size")):
        with pytest.raises(ValueError, match=match):
            sharding.parse_mesh(text)
    assert sharding.parse_mesh("") is None


def _memory_plan_module():
    spec = importlib.util.spec_from_file_location("memory_plan", os.path.join(ROOT, "experiments", "memory_plan.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@on_devices
def test_memory_plan_weights_are_the_sharded_layout(models):
    """The plan's weight bytes per device == what device 0 actually holds; K2.6's routed experts by hand."""
    memory_plan = _memory_plan_module()
    target, _ = models
    for mesh_text in ("tp=8", "data=2,tp=4"):
        mesh = sharding.parse_mesh(mesh_text)
        params = sharding.shard_params(nnx.state(target, nnx.Param), mesh)
        device = mesh.devices.flat[0]
        held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards if s.device == device)
        planned = memory_plan.weight_bytes(CFG, dict(mesh.shape))
        assert sum(planned.values()) == held, mesh_text
    k2 = config.kimi_k2_6()
    plan = memory_plan.memory_plan(k2, tp=8, streams=64, context=4096, budget=64, block_size=16)
    experts = (k2.num_layers - k2.first_k_dense) * k2.num_experts * 3 * k2.hidden_size * k2.moe_intermediate_size
    bits = 4 + 16 / k2.quant_group_size  # a nibble per weight + a bf16 scale per group
    assert plan.weights["routed experts"] == experts * bits / 8 / 8
    assert plan.kv_bytes_per_token == k2.num_layers * (512 + 64) * 2
    assert plan.cache == 64 * 4096 * plan.kv_bytes_per_token
    assert 0 < plan.total < plan.hbm


@on_devices
@pytest.mark.parametrize("mesh_text", ["tp=4", "data=2,tp=4", "data=4"])
def test_the_exact_forward_leaves_no_kernel_to_gspmd(monkeypatch, mesh_text):
    """Under a mesh every choice of the exact forward between a kernel and its XLA reference (`ops.exact_kernels_take`)
    is made where nothing is left for GSPMD to partition (`parallel.per_device` and the layer's shard_maps), so on
    GPUs each takes its Triton kernel on its device's shards. Before, q_a, kv_a, the norms, W_UK / W_UV, the router,
    the lm_head and (without tp) o_proj and the dense MLP saw the mesh and ran their references (5-22x slower at
    K2.6's shapes). The spy answers False: the references trace cheaply on the CPU."""
    unpartitioned = []

    def spy(*operands):
        unpartitioned.append(ops.unpartitioned())
        return False
    monkeypatch.setattr(ops, "exact_kernels_take", spy)
    target = Transformer(CFG.replace(dtype="bfloat16"), nnx.Rngs(0))
    mesh = sharding.parse_mesh(mesh_text)
    graphdef, params = nnx.split(target)
    params = sharding.shard_params(params, mesh)
    tokens = np.asarray([[5, 9, 14], [3, 8, 1], [7, 22, 40], [11, 2, 4]], np.int32)
    positions = np.broadcast_to(np.arange(3, dtype=np.int32), tokens.shape)
    visible = np.broadcast_to(np.tril(np.ones((3, 3), bool)), (4, 3, 3))

    def forward(p, t):
        model = nnx.merge(graphdef, p)
        return model(t, positions, init_cache(model.cfg, 4, 3), visible, exact=True).logits
    with jax.set_mesh(mesh):
        jax.eval_shape(forward, params, tokens)
    layers = CFG.num_layers
    assert len(unpartitioned) >= 8 * layers and all(unpartitioned), unpartitioned



@on_devices
@pytest.mark.parametrize("data", [2, 4])
def test_the_exact_forward_on_a_data_mesh_equals_no_mesh(data):
    """bf16: the exact forward's logits on a mesh of data devices (each device's streams through `per_device`) are
    bitwise those without a mesh, compiled as the decoder compiles the exact mode (`batch_invariant.jit_options`).
    With XLA's excess precision on they were 0.03 apart: XLA dropped a product's rounding to bf16 before the
    residual outside the shard_map and kept it inside."""
    target = Transformer(CFG.replace(dtype="bfloat16"), nnx.Rngs(0))
    tokens = np.asarray([[5, 9, 14], [3, 8, 1], [7, 22, 40], [11, 2, 4]], np.int32)
    positions = np.broadcast_to(np.arange(3, dtype=np.int32), tokens.shape)
    visible = np.broadcast_to(np.tril(np.ones((3, 3), bool)), (4, 3, 3))
    graphdef, params = nnx.split(target)

    def forward(p, t):
        model = nnx.merge(graphdef, p)
        return model(t, positions, init_cache(model.cfg, 4, 3), visible, exact=True).logits
    options = batch_invariant.jit_options(exact=True)
    alone = np.asarray(jax.jit(forward, **options)(params, tokens))
    mesh = sharding.make_mesh(tp=1, data=data)
    with jax.set_mesh(mesh):
        split = np.asarray(jax.jit(forward, **options)(sharding.shard_params(params, mesh), tokens))
    np.testing.assert_array_equal(split, alone)
