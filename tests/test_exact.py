"""The exact mode (`DecodeSpec.exact`, `pallas_kernels/batch_invariant.py`): in bf16 a token row's cache latents,
hidden states and logits are bitwise the same whether it runs alone (an AR step, M = 1), as a node of a chain or a
tree verify, or beside other streams, so greedy chain / ddtree == ar token for token in bf16, not only in f32."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdtree_jax import config as config_lib
from kdtree_jax import sharding
from kdtree_jax.cache import init_cache
from kdtree_jax.decode import DecodeSpec, Decoder
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer
from conftest import OracleDrafter, rel_err
from pallas_kernels import batch_invariant

BLOCK = 6
PARENTS = (-1, 0, 0, 2, 1, 3, 3)  # a tree of 7 block tokens listed parent before child; node 0 is the root


def bf16(name: str, **changes):
    return getattr(config_lib, name)().replace(dtype="bfloat16", **changes)


def block_visible(parents) -> np.ndarray:
    """[T, T] bool: each block token sees its ancestors and itself."""
    t = len(parents)
    vis = np.zeros((t, t), bool)
    for i in range(t):
        j = i
        while j >= 0:
            vis[i, j], j = True, parents[j]
    return vis


class Rows:
    """A prefilled cache (ragged prompts) and the exact forward, jitted once per shape."""

    def __init__(self, cfg, seed: int, prefix_lens):
        self.cfg, self.model = cfg, Transformer(cfg, nnx.Rngs(seed))
        self.fwd = nnx.jit(lambda m, t, p, c, v: m(t, p, c, v, exact=True, hidden_layers=(cfg.num_layers - 1,)))
        self.rng = np.random.default_rng(seed)
        s, p = len(prefix_lens), max(prefix_lens)
        tokens = jnp.asarray(self.rng.integers(0, cfg.vocab_size, (s, p)), jnp.int32)
        valid = np.arange(p)[None, :] < np.asarray(prefix_lens)[:, None]
        visible = (np.tril(np.ones((p, p), bool))[None] & valid[:, None, :]) | np.eye(p, dtype=bool)[None]
        out = self.fwd(self.model, tokens, jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (s, p)),
                       init_cache(cfg, s, 96), jnp.asarray(visible))
        self.cache = out.cache._replace(length=jnp.asarray(prefix_lens, jnp.int32))

    def block(self, tokens, depth, visible, cache=None):
        """tokens / depth [S, T], visible [T, T] -> the forward (latents at rows length .. length + T - 1)."""
        cache = self.cache if cache is None else cache
        s, t = tokens.shape
        return self.fwd(self.model, tokens, cache.length[:, None] + jnp.asarray(depth, jnp.int32), cache,
                        jnp.broadcast_to(jnp.asarray(visible), (s, t, t)))

    def ar_path(self, tokens):
        """AR steps over tokens [S, D]: [(logits [S, V], c_kv row [S, C] of the last layer, hidden [S, D])]."""
        cache, out = self.cache, []
        for j in range(tokens.shape[1]):
            o = self.block(tokens[:, j:j + 1], [[0]] * tokens.shape[0], np.ones((1, 1), bool), cache)
            rows = cache.length
            out.append((o.logits[:, 0], row_of(o.cache.c_kv[-1], rows), o.hidden[0][:, 0]))
            cache = o.cache._replace(length=cache.length + 1)
        return out


def row_of(layer_cache, rows):
    return jnp.take_along_axis(layer_cache, rows[:, None, None], axis=1)[:, 0]


def assert_bitwise(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.array_equal(got, want), f"{what}: max |diff| {np.abs(got - want).max()}"


@pytest.mark.parametrize("name, prefix_lens", [("tiny", (9,)), ("tiny", (9, 4, 13)), ("code_target", (21,)),
                                               ("code_target", (21, 6, 14))])
def test_a_rows_results_do_not_depend_on_its_block_or_batch(name, prefix_lens):
    """Chain and tree verify nodes against AR steps along their paths, and each stream alone against the batch."""
    seed = sum(prefix_lens) + len(name)
    rows = Rows(bf16(name), seed, prefix_lens)
    s, t = len(prefix_lens), len(PARENTS)
    tokens = jnp.asarray(rows.rng.integers(0, rows.cfg.vocab_size, (s, t)), jnp.int32)
    vis = block_visible(PARENTS)
    depth = vis.sum(1) - 1
    tree = rows.block(tokens, [depth] * s, vis)
    chain = rows.block(tokens, [np.arange(t)] * s, np.tril(np.ones((t, t), bool)))
    for j, (logits, latent, hidden) in enumerate(rows.ar_path(tokens)):   # the chain is the AR path of tokens
        assert_bitwise(chain.logits[:, j], logits, f"chain node {j} logits")
        assert_bitwise(row_of(chain.cache.c_kv[-1], rows.cache.length + j), latent, f"chain node {j} latent")
        assert_bitwise(chain.hidden[0][:, j], hidden, f"chain node {j} hidden")
    leaf = t - 1
    path = [leaf]
    while PARENTS[path[-1]] > 0:
        path.append(PARENTS[path[-1]])
    path = [0] + path[::-1]
    for d, (logits, latent, hidden) in enumerate(rows.ar_path(tokens[:, np.asarray(path)])):
        node = path[d]
        assert_bitwise(tree.logits[:, node], logits, f"tree node {node} logits")
        assert_bitwise(row_of(tree.cache.c_kv[-1], rows.cache.length + node), latent, f"tree node {node} latent")
        assert_bitwise(tree.hidden[0][:, node], hidden, f"tree node {node} hidden")
    if s > 1:
        alone = jax.tree.map(lambda a: a[1:2], rows.cache)
        one = rows.block(tokens[1:2], [depth], vis, alone)
        assert_bitwise(one.logits, tree.logits[1:2], "stream 1 alone")


def test_int4_experts_are_exact_too():
    rows = Rows(bf16("tiny", expert_quant="int4"), 3, (11, 5))
    tokens = jnp.asarray(rows.rng.integers(0, rows.cfg.vocab_size, (2, 4)), jnp.int32)
    chain = rows.block(tokens, [np.arange(4)] * 2, np.tril(np.ones((4, 4), bool)))
    for j, (logits, _, _) in enumerate(rows.ar_path(tokens)):
        assert_bitwise(chain.logits[:, j], logits, f"chain node {j} logits")


PROMPTS = [[5, 9, 14, 3, 8, 1, 7, 22, 40], [11, 2], [4, 60, 4, 61, 4]]


@pytest.fixture(scope="module")
def bf16_decoders():
    cfg = bf16("tiny")
    target = Transformer(cfg, nnx.Rngs(0))
    ar = Decoder(target)
    truth = ar.generate(PROMPTS, DecodeSpec(max_new_tokens=40, exact=True)).tokens
    seqs = np.zeros((len(PROMPTS), 64), np.int32)
    for i, (p, out) in enumerate(zip(PROMPTS, truth)):
        seqs[i, :len(p) + len(out)] = p + out
    oracle = Decoder(target, OracleDrafter(config_lib.tiny_drafter(cfg, BLOCK), seqs))
    random = Decoder(target, Drafter(config_lib.tiny_drafter(cfg, BLOCK), cfg, nnx.Rngs(1)))
    return ar, oracle, random, truth


@pytest.mark.parametrize("budget", [4, 32])
def test_greedy_chain_and_ddtree_equal_ar_in_bf16(bf16_decoders, budget):
    """Greedy chain / ddtree == ar in bf16 with the exact mode, batched and each stream alone (an oracle drafter:
    multi-token rounds, so accepted tree rows are compacted into the cache; and a random one)."""
    ar, oracle, random, truth = bf16_decoders
    for decoder in (oracle, random):
        for policy in ("chain", "ddtree"):
            spec = DecodeSpec(policy=policy, budget=budget, block_size=BLOCK, max_new_tokens=24, exact=True)
            res = decoder.generate(PROMPTS, spec)
            assert res.tokens == [t[:24] for t in truth], policy
            if decoder is oracle:
                assert res.taus[res.taus > 0].mean() > 1.5
    spec = DecodeSpec(policy="ddtree", budget=budget, block_size=BLOCK, max_new_tokens=24, exact=True)
    assert random.generate(PROMPTS[1:2], spec).tokens == [truth[1][:24]]  # a stream alone


def test_the_exact_kernels_run_wherever_nothing_is_partitioned(monkeypatch):
    """Without a mesh, under a mesh of one device (bench_k26's tp=1) and inside a shard_map over every axis of size
    > 1 the exact mode's Triton kernels run; under a mesh GSPMD may split, they do not (its references run)."""
    from pallas_kernels import ops
    monkeypatch.setattr(ops, "_compiled_on_gpu", lambda: True)
    x, w = jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((2, 64), jnp.bfloat16)
    assert ops.exact_kernels_take(x)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1, 1), sharding.MESH_AXES)):
        assert ops.exact_kernels_take(x) and ops.exact_dense_takes(x, w)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2, 1), sharding.MESH_AXES)):
        assert not ops.exact_kernels_take(x)
    manual = jax.sharding.AbstractMesh((2, 1), sharding.MESH_AXES,
                                       axis_types=(jax.sharding.AxisType.Manual,) * 2)
    with jax.sharding.use_abstract_mesh(manual):
        assert ops.exact_kernels_take(x)
    auto, manual = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Manual
    for shape, taken in (((1, 4), True), ((2, 4), False)):   # a shard_map over tp alone: data is GSPMD's to split
        mesh = jax.sharding.AbstractMesh(shape, sharding.MESH_AXES, axis_types=(auto, manual))
        with jax.sharding.use_abstract_mesh(mesh):
            assert ops.exact_kernels_take(x) == taken, shape


@pytest.mark.parametrize("name, quant", [("tiny", "bf16"), ("tiny", "int4"), ("code_target", "bf16")])
def test_the_exact_forward_computes_the_same_function(name, quant):
    """f32, highest precision: the exact forward against the default one by relative norm (logits and latents)."""
    cfg = getattr(config_lib, name)().replace(expert_quant=quant, dtype="float32")
    model = Transformer(cfg, nnx.Rngs(7))
    rng = np.random.default_rng(7)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
    with jax.default_matmul_precision("highest"):
        want = model.causal(tokens)
        got = nnx.jit(lambda m, t: m(t, jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11)),
                                     init_cache(cfg, 2, 11), jnp.broadcast_to(jnp.tril(jnp.ones((11, 11), bool)),
                                                                               (2, 11, 11)), exact=True))(model, tokens)
    assert rel_err(got.logits, want.logits) < 1e-5
    assert rel_err(got.cache.c_kv[-1], want.cache.c_kv[-1]) < 1e-5


def test_matmul_and_row_sum_give_a_row_the_same_bits_at_any_row_count():
    """A row alone (M = 1), among 37 rows and in the second tile of 70 (each shape its own program): the products,
    the row sums and the RMSNorm built on them."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.normal(size=(70, 300)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(130, 300)), jnp.bfloat16)
    g = jnp.asarray(1 + 0.1 * rng.normal(size=300), jnp.bfloat16)
    for fn in (jax.jit(lambda x: batch_invariant.matmul(x, w, out_dtype=jnp.float32)),
               jax.jit(batch_invariant.row_sum), jax.jit(lambda x: batch_invariant.rms_norm(x, g, 1e-6))):
        rows = {m: np.asarray(fn(x[:m])) for m in (37, 70)}
        for i in (0, 5, 36):
            assert np.array_equal(np.asarray(fn(x[i:i + 1]))[0], rows[37][i])
        assert np.array_equal(np.asarray(fn(x[66:67]))[0], rows[70][66])


def test_matmul_adds_the_residual_to_the_rounded_product():
    """residual=: the layer's residual add in the product's epilogue (o_proj's in the exact attention) gives the bits
    of the add after the product, and a row alone those it has among 37."""
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.normal(size=(37, 320)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(96, 320)) / 16, jnp.bfloat16)
    r = jnp.asarray(rng.normal(size=(37, 96)), jnp.bfloat16)
    fused = jax.jit(lambda x, r: batch_invariant.matmul(x, w, residual=r))
    after = np.asarray(r + batch_invariant.matmul(x, w))
    assert np.array_equal(np.asarray(fused(x, r)), after)
    assert np.array_equal(np.asarray(fused(x[5:6], r[5:6]))[0], after[5])
