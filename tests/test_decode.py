"""The DDTree loop: tree verify == path forwards, the losslessness invariant, sampling, guard rails."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdtree_jax import budget
from kdtree_jax import config as config_lib
from pallas_kernels import tree as tree_lib
from kdtree_jax.cache import init_cache
from kdtree_jax.decode import DecodeSpec, Decoder
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer
from conftest import OracleDrafter, rel_err

BLOCK = 6
PROMPTS = [[5, 9, 14, 3, 8, 1, 7, 22, 40], [11, 2], [4, 60, 4, 61, 4]]


@pytest.fixture(scope="module")
def setup():
    cfg = config_lib.tiny()
    target = Transformer(cfg, nnx.Rngs(0))
    drafter = Drafter(config_lib.tiny_drafter(cfg, BLOCK), cfg, nnx.Rngs(1))
    return cfg, target, drafter


@pytest.fixture(scope="module")
def ar_decoder(setup):
    return Decoder(setup[1])


@pytest.fixture(scope="module")
def draft_decoder(setup):
    return Decoder(setup[1], setup[2])


@pytest.fixture(scope="module")
def oracle_decoder(setup, ar_decoder):
    """One decoder (one compile per spec) whose oracle knows 40 greedy tokens of every prompt in PROMPTS."""
    cfg, target, _ = setup
    truth = ar_tokens(ar_decoder, PROMPTS, 40)
    seqs = np.zeros((len(PROMPTS), 64), np.int32)
    for i, (p, out) in enumerate(zip(PROMPTS, truth)):
        seqs[i, :len(p) + len(out)] = p + out
    return Decoder(target, OracleDrafter(config_lib.tiny_drafter(cfg, BLOCK), seqs)), truth


def ar_tokens(decoder, prompts, max_new, eos=()):
    return decoder.generate(prompts, DecodeSpec(max_new_tokens=max_new, eos_token_ids=eos)).tokens


def test_tree_verify_logits_equal_path_forwards(setup):
    cfg, target, _ = setup
    s, budget, depth, n = 2, 12, 4, 48
    prefix_len = np.array([7, 3])
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, cfg.vocab_size, (s, prefix_len.max()))
    draft = jnp.asarray(rng.normal(size=(s, depth, cfg.vocab_size)) * 3)
    tree = tree_lib.build_tree(draft, jnp.asarray(rng.integers(0, cfg.vocab_size, s)), budget, topk=3)

    cache = init_cache(cfg, s, n)
    pre_pos = jnp.broadcast_to(jnp.arange(prefix.shape[1]), prefix.shape)
    causal = jnp.tril(jnp.ones((prefix.shape[1],) * 2, bool))[None].repeat(s, 0)
    cache = target(jnp.asarray(prefix), pre_pos, cache, causal).cache._replace(length=jnp.asarray(prefix_len))
    logits = target(tree.tokens, cache.length[:, None] + tree.depth, cache, tree.visible).logits

    # Every node's root-to-node path appended to its stream's prefix, all run as one ragged causal batch.
    parent, tokens = np.asarray(tree.parent), np.asarray(tree.tokens)
    seqs, where = [], []
    for b in range(s):
        for i in range(int(tree.num_nodes[b])):
            path, node = [], i
            while node >= 0:
                path.append(tokens[b, node])
                node = parent[b, node]
            seqs.append(np.concatenate([prefix[b, :prefix_len[b]], path[::-1]]))
            where.append((b, i))
    width = max(len(q) for q in seqs)
    batch = np.zeros((len(seqs), width), np.int32)
    for r, q in enumerate(seqs):
        batch[r, :len(q)] = q
    ref = target(jnp.asarray(batch), jnp.arange(width)[None].repeat(len(seqs), 0), init_cache(cfg, len(seqs), n),
                 jnp.tril(jnp.ones((len(seqs), width, width), bool)), absorbed=False).logits
    for r, (b, i) in enumerate(where):
        assert rel_err(logits[b, i], ref[r, len(seqs[r]) - 1]) < 1e-5, (b, i)


@pytest.mark.parametrize("budget", [1, 4, 32])
def test_greedy_ddtree_and_chain_equal_ar_random_drafter(ar_decoder, draft_decoder, budget):
    expect = ar_tokens(ar_decoder, PROMPTS, 14)
    for policy in ("chain", "ddtree"):
        got = draft_decoder.generate(PROMPTS, DecodeSpec(policy=policy, budget=budget, block_size=BLOCK,
                                                         max_new_tokens=14)).tokens
        assert got == expect, policy


@pytest.mark.parametrize("budget", [1, 4, 32])
def test_greedy_ddtree_and_chain_equal_ar_oracle_drafter(oracle_decoder, budget):
    decoder, truth = oracle_decoder
    max_new, taus = 20, {}
    for policy in ("chain", "ddtree"):
        res = decoder.generate(PROMPTS, DecodeSpec(policy=policy, budget=budget, block_size=BLOCK,
                                                   max_new_tokens=max_new))
        assert res.tokens == [t[:max_new] for t in truth], policy
        taus[policy] = res.taus[res.taus > 0].mean()
    assert taus["chain"] > 1.5  # multi-token rounds happen
    if budget >= 32:
        assert taus["ddtree"] > taus["chain"]  # a wide enough tree recovers the demoted tokens


AUTO = (0, 2, 8)


@pytest.mark.parametrize("costs, kind", [((1.0, 1.2, 1.5), "spec"),  # drafting pays: B = 2 or 8 each round
                                         ((0.2, 1.0, 1.2), "mixed"),  # AR wins once MIN_DRAFTED rounds drafted
                                         ((np.inf, np.inf, 1.0), {8}),  # forced, as `budget.calibrate` does
                                         ((np.inf, 1.0, np.inf), {2})],  # forced in the middle: builds B = 8's tree
                         ids=["spec", "ar_after_min_drafted", "forced_8", "forced_2"])
def test_greedy_auto_equals_ar(oracle_decoder, costs, kind):
    """--budget=auto over (0, 2, 8) with hand-made step costs (one compiled loop: the costs are traced): the oracle
    drafter's greedy output is AR's whatever budgets the rounds verify, AR rounds and tree prefixes in one run."""
    decoder, truth = oracle_decoder
    spec = DecodeSpec(policy="ddtree", auto_budgets=AUTO, block_size=BLOCK, max_new_tokens=40)
    res = decoder.generate(PROMPTS, spec, costs=budget.StepCosts(AUTO, costs))
    assert res.tokens == truth
    assert res.budgets.shape == (res.rounds,) and set(res.budgets.tolist()) <= set(AUTO)
    if kind == "mixed":
        assert (res.budgets[:budget.MIN_DRAFTED] > 0).all() and 0 in res.budgets  # drafted first, then AR
    elif kind == "spec":
        assert 0 not in res.budgets and res.taus[res.taus > 0].mean() > 1.5
    else:
        assert set(res.budgets.tolist()) == kind


def test_greedy_auto_equals_ar_random_drafter_calibrated(ar_decoder, draft_decoder):
    """A random drafter, the step costs calibrated on this machine (a few rounds of the loop itself per budget), then
    refitted to each run of the loop (`budget.refit`)."""
    spec = DecodeSpec(policy="ddtree", auto_budgets=(0, 4), block_size=BLOCK, max_new_tokens=14)
    costs = draft_decoder.step_costs(spec, PROMPTS, rounds=2, reps=1)
    assert costs.candidates == (0, 4) and all(c > 0 for c in costs.seconds) and costs.key["streams"] == len(PROMPTS)
    first = draft_decoder.generate(PROMPTS, spec)
    assert first.tokens == ar_tokens(ar_decoder, PROMPTS, 14) and first.costs == costs
    key = draft_decoder._cost_cache_key(spec, PROMPTS, draft_decoder.default_cache_len(spec, PROMPTS))
    carried = draft_decoder._auto_state[key]              # the next auto call starts where this one ended
    assert int(carried.drafted_rounds) == int((first.budgets > 0).sum())
    refitted = draft_decoder.step_costs(spec, PROMPTS)
    assert "refitted to 1 run" in refitted.how and all(c > 0 for c in refitted.seconds)
    draft_decoder._handover[key] = budget.Handover()            # whatever this machine's first call chose
    second = draft_decoder.generate(PROMPTS, spec)
    assert second.costs == refitted and second.tokens == first.tokens and second.handed_over is None
    assert second.budgets[0] == spec.auto_budgets[int(carried.next_index)]  # it went on where the first ended
    # handed to a fixed loop (as after calls that verified one budget): the same tokens, its rounds, no run recorded
    for fixed in (0, 4):
        draft_decoder._handover[key] = budget.Handover(budget=fixed, calls_left=1, gap=2, ar_pays=True)
        res = draft_decoder.generate(PROMPTS, spec)
        assert res.handed_over == fixed and res.tokens == first.tokens and set(res.budgets.tolist()) == {fixed}
    # the first handover to AR measures whether the AR loop's round is cheaper than the auto loop's; if not, the auto
    # loop runs (its run recorded), else the AR loop (none recorded)
    draft_decoder._handover[key] = budget.Handover(budget=0, calls_left=1, gap=2)
    res = draft_decoder.generate(PROMPTS, spec)
    pays = draft_decoder._handover[key].ar_pays
    assert isinstance(pays, bool) and res.tokens == first.tokens
    assert res.handed_over == (0 if pays else None)
    runs = 2 if pays else 3
    assert f"refitted to {runs} run" in draft_decoder.step_costs(spec, PROMPTS).how
    draft_decoder._handover[key] = budget.Handover()
    assert draft_decoder.generate(PROMPTS, spec).handed_over is None   # no fixed calls left: the auto loop again
    with pytest.raises(ValueError, match="auto budgets are a ddtree setting"):
        draft_decoder.generate(PROMPTS, DecodeSpec(policy="chain", auto_budgets=(0, 4), block_size=BLOCK))
    with pytest.raises(ValueError, match="auto budgets"):
        draft_decoder.generate(PROMPTS, DecodeSpec(policy="ddtree", auto_budgets=(4, 0), block_size=BLOCK))


def test_ar_rounds_defer_the_drafter_context_and_a_segment_catches_it_up(setup):
    """An AR round of the auto loop keeps its row at the drafter's context layers (`defer_row`) instead of projecting
    it; an AR segment's end (`catch_up_context`) projects the deferred rows at once. The drafter's context then equals
    extending it round by round, and rows at or past each stream's length are untouched (a stream that stopped
    deferring, and a stream near the cache's end: nothing is written past N)."""
    from kdtree_jax import decode as D
    from kdtree_jax.cache import KVCache

    cfg, target, drafter = setup
    rng = np.random.default_rng(3)
    layers = len(drafter.cfg.target_layer_ids)
    start, rounds = jnp.asarray([5, 9, 29], jnp.int32), 3
    before = drafter.init_cache(3, 32)
    before = type(before)(*(tuple(jnp.asarray(rng.standard_normal(c.shape), c.dtype) for c in part)
                            for part in before))
    rows = [tuple(jnp.asarray(rng.standard_normal((3, 1, cfg.hidden_size)), D.dtype_of(cfg.dtype))
                  for _ in range(layers)) for _ in range(rounds)]
    advance = jnp.asarray([1, 0, 1], jnp.int32)            # stream 1 is done: its length stays
    eager, deferred, length = before, D.no_deferred_rows(start, target, drafter), start
    for row in rows:
        eager = jax.tree.map(lambda new, old: jnp.where(advance[:, None, None, None] > 0, new, old),
                             drafter.extend_cache(eager, row, length[:, None], length), eager)
        deferred = D.defer_row(deferred, row, length)
        length = length + advance
    st = D.LoopState(KVCache((), (), length), before, *([None] * 10), deferred=deferred)
    caught = D.catch_up_context(drafter, st)
    assert caught.deferred.start.tolist() == length.tolist()
    for got, want, old in zip(jax.tree.leaves(caught.dcache), jax.tree.leaves(eager), jax.tree.leaves(before)):
        for s in range(3):
            np.testing.assert_allclose(got[s, :int(length[s])], want[s, :int(length[s])], rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(got[s, int(length[s]):], old[s, int(length[s]):])


def test_greedy_auto_equals_ar_across_many_catch_ups(setup, ar_decoder, monkeypatch):
    """AR segments cut every DEFERRED_ROWS = 3 rounds (each one's end catches the drafter's context up), a
    random drafter, AR after MIN_DRAFTED drafted rounds and a probe after them (an AR round at 0.8 of a drafted one:
    a probe gap of 9 rounds): the greedy output is AR's."""
    from kdtree_jax import decode as D
    monkeypatch.setattr(D, "DEFERRED_ROWS", 3)
    _, target, drafter = setup
    spec = DecodeSpec(policy="ddtree", auto_budgets=AUTO, block_size=BLOCK, max_new_tokens=30)
    res = Decoder(target, drafter).generate(PROMPTS, spec, costs=budget.StepCosts(AUTO, (0.8, 1.0, 1.2)))
    assert res.tokens == ar_tokens(ar_decoder, PROMPTS, 30)
    assert (res.budgets == 0).sum() > 3 * D.DEFERRED_ROWS and (res.budgets > 0).sum() > budget.MIN_DRAFTED


def test_deferred_context_drafts_as_the_eager_one(setup, monkeypatch):
    """The auto loop with AR rounds that defer the drafter's context (`defer_row`, caught up at each AR segment's end)
    against AR rounds that extend it at once: every round verifies the same budget and emits the same count, so every
    probe drafted from the same context (a random drafter, AR after MIN_DRAFTED rounds, probes every few rounds)."""
    from kdtree_jax import decode as D
    _, target, drafter = setup
    monkeypatch.setattr(budget, "PROBE_SHARE", 1.0)             # probe gaps from PROBE_FIRST_GAP on
    spec = DecodeSpec(policy="ddtree", auto_budgets=AUTO, block_size=BLOCK, max_new_tokens=40)
    costs = budget.StepCosts(AUTO, (0.8, 1.0, 1.2))

    def eager_ar_round(target, drafter, spec, st, step_costs):
        keys, sub = D.split_each(st.keys)
        tree = D.root_only_tree(st.bonus)
        cache, dcache, verdict, finite, _ = D.verify_and_commit(target, drafter, spec, st, tree, sub)
        st = st._replace(deferred=st.deferred._replace(start=cache.length))
        auto = budget.plan_after_ar(st.auto, spec.auto_budgets, step_costs, spec.depth)
        return D.finish_round(spec, st, tree.tokens, verdict, cache, dcache, keys, 0, auto, finite)

    deferred = Decoder(target, drafter).generate(PROMPTS, spec, costs=costs)
    monkeypatch.setattr(D, "ar_round", eager_ar_round)
    eager = Decoder(target, drafter).generate(PROMPTS, spec, costs=costs)
    probes = np.flatnonzero(deferred.budgets[budget.MIN_DRAFTED:] > 0)
    assert len(probes) >= 2 and (deferred.budgets == 0).sum() > 8
    np.testing.assert_array_equal(deferred.budgets, eager.budgets)
    np.testing.assert_array_equal(deferred.taus, eager.taus)
    assert deferred.tokens == eager.tokens


def _eqns(jaxpr, primitive: str) -> list:
    """The equations of `primitive` ("cond": lax.cond and lax.switch; "while") in a jaxpr, through its jit calls but
    not into control flow."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found.append(eqn)
        elif eqn.primitive.name in ("jit", "pjit", "closed_call"):
            found += _eqns(eqn.params["jaxpr"].jaxpr, primitive)
    return found


def _nested_conds(jaxpr) -> int:
    """The conds in a jaxpr at any depth: through jit calls and into loop bodies and branches."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "cond"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _nested_conds(inner)
    return count


def test_auto_rounds_pass_no_conditional(draft_decoder):
    """The auto loop's step is one switch over the candidates, each branch a segment: a while loop of rounds at one
    B whose body holds no conditional at any depth. On XLA:GPU each conditional costs a host read of its predicate, and rounds
    that passed two cost 12-30% more than the fixed loop's round on an H100 (decode.md, "Third GPU run")."""
    spec = DecodeSpec(policy="ddtree", auto_budgets=(0, 2, 8), block_size=BLOCK, max_new_tokens=8)
    prompts = [p[:2] for p in PROMPTS]
    cache_len = draft_decoder.default_cache_len(spec, prompts)
    loop = draft_decoder.compiled_loop(spec, len(prompts), 2, cache_len)
    args = (draft_decoder.target_params, draft_decoder.drafter_params,
            *draft_decoder.new_caches(spec, len(prompts), cache_len), jnp.asarray(prompts, jnp.int32),
            jnp.full((len(prompts),), 2, jnp.int32), jax.random.key(0), draft_decoder.controls(spec, (1.0, 2.0, 3.0)))
    loops = _eqns(jax.make_jaxpr(loop)(*args).jaxpr, "while")
    steps = [conds for conds in (_eqns(w.params["body_jaxpr"].jaxpr, "cond") for w in loops) if conds]
    assert len(steps) == 1 and len(steps[0]) == 1, [len(c) for c in steps]
    segments = steps[0][0].params["branches"]
    assert len(segments) == len(spec.auto_budgets)
    for branch in segments:
        (segment,) = _eqns(branch.jaxpr, "while")
        assert not _nested_conds(segment.params["body_jaxpr"].jaxpr)
    with pytest.raises(ValueError, match="rounds_per_check=2 is a fixed-budget setting"):
        draft_decoder.generate(prompts, dataclasses.replace(spec, rounds_per_check=2))


def test_eos_mid_round(ar_decoder, oracle_decoder):
    decoder, truth = oracle_decoder
    eos = (truth[0][7], truth[1][5])  # two stop tokens, emitted mid-way: a stream stops at the first of either
    expect = ar_tokens(ar_decoder, PROMPTS, 20, eos=eos)
    assert len(expect[0]) <= 8 and len(expect[1]) <= 6
    res = decoder.generate(PROMPTS, DecodeSpec(policy="ddtree", budget=32, block_size=BLOCK, max_new_tokens=20,
                                               eos_token_ids=eos))
    assert res.tokens == expect
    assert res.taus.max() > 1


def test_guard_rails(setup, draft_decoder):
    cfg, target, drafter = setup
    decoder = draft_decoder
    with pytest.raises(ValueError, match="budget"):
        decoder.generate(PROMPTS, DecodeSpec(policy="ddtree", budget=-1, block_size=BLOCK))
    with pytest.raises(ValueError, match="budget"):
        small = Decoder(target, Drafter(config_lib.tiny_drafter(cfg, 2), cfg, nnx.Rngs(1)))
        small.generate(PROMPTS, DecodeSpec(policy="ddtree", budget=cfg.vocab_size + 1, block_size=2))
    with pytest.raises(ValueError, match="block_size"):
        config_lib.tiny_drafter(cfg, 1)
    with pytest.raises(ValueError, match="block_size"):
        decoder.generate(PROMPTS, DecodeSpec(policy="ddtree", budget=4, block_size=BLOCK + 1))
    with pytest.raises(ValueError, match="hidden_size"):
        Decoder(target, Drafter(config_lib.tiny_drafter(cfg.replace(hidden_size=32), BLOCK),
                                cfg.replace(hidden_size=32), nnx.Rngs(1)))
    with pytest.raises(ValueError, match="vocab_size"):
        config_lib.tiny_drafter(cfg, BLOCK).replace(vocab_size=600).check_fits(cfg)
    with pytest.raises(ValueError, match="cache"):
        decoder.generate(PROMPTS, DecodeSpec(policy="ddtree", budget=32, block_size=BLOCK, max_new_tokens=8),
                         cache_len=40)
    with pytest.raises(ValueError, match="needs a drafter"):
        Decoder(target).generate(PROMPTS, DecodeSpec(policy="ddtree", budget=4, block_size=BLOCK))
    for temperature in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match=f"temperature={temperature} must be a finite number >= 0"):
            decoder.generate(PROMPTS, DecodeSpec(temperature=temperature))
    with pytest.raises(ValueError, match=r"a prompt of 9 tokens \+ 1011 new tokens \+ 5 drafted positions past the "
                                         r"last \(the drafter's depth\) reaches position 1025, past the model's "
                                         r"max_position_embeddings=1024; shorten"):
        decoder.generate(PROMPTS, DecodeSpec(policy="ddtree", budget=4, block_size=BLOCK, max_new_tokens=1011))


def test_sizes_beyond_memory_are_refused_before_compiling(draft_decoder):
    """B = 100000 on the tiny model: the tree mask alone is 10 GB a stream, the reference attention's scores 160 GB."""
    with pytest.raises(ValueError, match=r"needs at least \d+ GB \(params .* GB, caches .* GB, verify attention "
                                         r"scores \[3, 100001, 4, \d+\] f32 \d+ GB\), more than the .* GB of "
                                         r"this host's RAM; lower the tree budget"):
        draft_decoder.generate(PROMPTS, DecodeSpec(policy="ddtree", budget=100000, block_size=BLOCK))


def test_invariant_with_pallas_kernels_in_interpret_mode(setup):
    """Every kernel inside the loop (tree build, tree accept, tree-verify attention; int4_moe's Triton kernel has no
    interpret mode, so its reference runs), in interpret mode, on
    a target with INT4 experts and an oracle drafter (multi-token rounds, branching past demoted tokens): ddtree and
    ar give the pure-JAX references' greedy tokens, and ddtree their acceptance round by round. (ops reads the
    implementation when a loop is traced: each implementation gets its own Decoder.)"""
    from pallas_kernels import ops
    cfg = setup[0].replace(expert_quant="int4")
    target = Transformer(cfg, nnx.Rngs(0))
    prompts, max_new = PROMPTS[:2], 12
    with ops.implementation("reference"):
        expect = ar_tokens(Decoder(target), prompts, max_new + BLOCK)
        seqs = np.zeros((len(prompts), 64), np.int32)
        for i, (p, out) in enumerate(zip(prompts, expect)):
            seqs[i, :len(p) + len(out)] = p + out
        drafter = OracleDrafter(config_lib.tiny_drafter(cfg, BLOCK), seqs)
        spec = DecodeSpec(policy="ddtree", budget=8, block_size=BLOCK, max_new_tokens=max_new)
        reference = Decoder(target, drafter).generate(prompts, spec)
    with ops.implementation("kernel", interpret=True):
        got = Decoder(target, drafter).generate(prompts, spec)
        ar_kernel = ar_tokens(Decoder(target), prompts, max_new)
    want = [t[:max_new] for t in expect]
    assert reference.tokens == got.tokens == ar_kernel == want
    np.testing.assert_array_equal(got.taus, reference.taus)
    assert got.taus[got.taus > 0].mean() > 2.5  # the walk goes deep: most rounds accept several nodes


def test_samples_of_a_stream_do_not_depend_on_its_batch(draft_decoder):
    spec = DecodeSpec(policy="ddtree", budget=4, block_size=BLOCK, temperature=1.0, max_new_tokens=10)
    first = draft_decoder.generate([PROMPTS[0], [4, 60, 4, 61, 4]], spec, seed=5).tokens
    second = draft_decoder.generate([PROMPTS[0], [9, 9, 9, 9, 9]], spec, seed=5).tokens
    assert first[0] == second[0]
    assert first[1] != second[1]


def test_rounds_per_check_changes_nothing_but_the_checks(oracle_decoder):
    decoder, truth = oracle_decoder
    spec = DecodeSpec(policy="ddtree", budget=4, block_size=BLOCK, max_new_tokens=20)
    once = decoder.generate(PROMPTS, spec)
    batched = decoder.generate(PROMPTS, dataclasses.replace(spec, rounds_per_check=3))
    assert batched.tokens == once.tokens == [t[:20] for t in truth]
    np.testing.assert_array_equal(batched.taus, once.taus)
    with pytest.raises(ValueError, match="rounds_per_check"):
        decoder.generate(PROMPTS, dataclasses.replace(spec, rounds_per_check=0))


def test_the_device_loop_is_a_compile_option_of_the_same_loop(draft_decoder):
    """DecodeSpec.device_loop adds XLA:GPU's WHILE / CONDITIONAL command buffers to the loop's compile options (beside
    the exact mode's) and nothing else: on the CPU, which ignores them, the tokens are the default loop's."""
    from kdtree_jax.decode import DEVICE_LOOP_COMMAND_BUFFERS, loop_jit_options
    assert loop_jit_options(DecodeSpec()) == {}
    options = loop_jit_options(DecodeSpec(device_loop=True, exact=True))["compiler_options"]
    assert options["xla_gpu_enable_command_buffer"] == DEVICE_LOOP_COMMAND_BUFFERS
    assert options["xla_allow_excess_precision"] is False
    spec = DecodeSpec(policy="ddtree", budget=6, block_size=BLOCK, max_new_tokens=12)
    want = draft_decoder.generate(PROMPTS, spec).tokens
    assert draft_decoder.generate(PROMPTS, dataclasses.replace(spec, device_loop=True)).tokens == want
