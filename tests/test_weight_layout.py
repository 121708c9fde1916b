"""weight_layout: which target params get their reduction axes minor-most, with which layout, and that a jit told
so computes what the row-major params compute (on the CPU the layout is accepted and ignored, so this checks the
plumbing; the speed is the GPU's: experiments/kernels/kernels_skinny.py, variant xla_layout)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdtree_jax import config as config_lib
from kdtree_jax import sharding, weight_layout
from kdtree_jax.cache import init_cache
from kdtree_jax.model.transformer import Transformer


def test_reduction_axes_go_minor_most():
    assert weight_layout.reduction_minor(2, 1).major_to_minor == (1, 0)
    assert weight_layout.reduction_minor(3, 1).major_to_minor == (1, 2, 0)      # q_b [Q, H, P]
    assert weight_layout.reduction_minor(3, 2).major_to_minor == (2, 0, 1)      # o_proj [H, V, D]
    with pytest.raises(ValueError, match="no output axis"):
        weight_layout.reduction_minor(2, 2)


def tiny_state():
    graphdef, state = nnx.split(Transformer(config_lib.preset("tiny"), nnx.Rngs(0)))
    return graphdef, state


def test_formats_cover_the_dense_products_only():
    """'nk': every dense product weight of the target (attention, shared / dense MLP, router, lm_head) a Format with
    its K axes minor-most; norms, embeddings, routed experts keep their sharding. 'kn': the shardings unchanged."""
    _, state = tiny_state()
    mesh = sharding.make_mesh()
    shardings = sharding.param_shardings(state, mesh)
    assert weight_layout.formats(state, shardings, "kn") is shardings
    formats = weight_layout.formats(state, shardings, "nk")
    laid = {}
    for (path, leaf), fmt in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(formats)):
        names = sharding.path_names(path)
        if isinstance(fmt, jax.sharding.Sharding):
            assert names[-1] not in weight_layout.REDUCTION_AXES or leaf.ndim <= 1, names
        else:
            laid[names[-1]] = fmt.layout.major_to_minor
    assert laid["o_proj"] == (2, 0, 1) and laid["gate_proj"] == (1, 0) and laid["lm_head"] == (1, 0)
    assert {"embed_tokens", "weight"}.isdisjoint(laid)
    with pytest.raises(ValueError, match="not one of"):
        weight_layout.formats(state, shardings, "nn")


def test_a_forward_with_laid_out_params_equals_the_row_major_one():
    """The tiny target's prefill forward, jitted with 'nk' formats over params placed in them, gives the logits and
    cache of the plain jit bitwise (the plumbing: placing, in_shardings, nnx.merge inside)."""
    graphdef, state = tiny_state()
    cfg = config_lib.preset("tiny")
    mesh = sharding.make_mesh()
    shardings = sharding.param_shardings(state, mesh)
    rng = np.random.default_rng(0)
    s, t = 2, 6
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (s, t)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (s, t, t))

    def forward(params):
        out = nnx.merge(graphdef, params)(tokens, positions, init_cache(cfg, s, 16), visible)
        return out.logits, out.cache.c_kv, out.cache.k_rope

    want = jax.jit(forward, in_shardings=(shardings,))(state)
    formats = weight_layout.formats(state, shardings, "nk")
    got = jax.jit(forward, in_shardings=(formats,))(weight_layout.place(state, shardings, "nk"))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
