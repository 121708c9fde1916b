"""The budget chooser of --budget=auto (kdtree_jax/budget.py): the tree of every budget is a prefix of the largest,
the choice rule against a hand-made cost table, the calibration of the drafter's confidence, the decision to draft
and its probes, the calibration of step costs and the cost table file."""
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import budget
from kdtree_jax.decode import DecodeSpec, Decoder
from pallas_kernels import tree as tree_lib

CANDIDATES = (0, 4, 16)
COSTS = jnp.asarray([1.0, 1.5, 2.5])  # seconds of an AR round, a B=4 round, a B=16 round


@pytest.mark.parametrize("topk", [None, 3])
def test_every_budget_is_a_prefix_of_the_largest_tree(topk):
    """Integer logits (many exact ties): the first B + 1 nodes of the B_max tree are the B tree, field by field."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.integers(-3, 3, (3, 5, 40)), jnp.float32)
    root = jnp.asarray(rng.integers(0, 40, 3))
    largest = tree_lib.build_tree(logits, root, 40, topk)
    for b in (1, 4, 13, 40):
        got, want = tree_lib.prefix_tree(largest, b), tree_lib.build_tree(logits, root, b, topk)
        for name, g, w in zip(tree_lib.TreeArrays._fields, got, want):
            np.testing.assert_array_equal(g, w, err_msg=f"B={b} {name}")


def test_the_choice_maximises_tokens_per_second_against_a_hand_made_table():
    """Rates (F + 1) / cost: B=4 at F=1.2 -> 2.2 / 1.5 = 1.47; B=16 at F=2.4 -> 3.4 / 2.5 = 1.36; so B=4. The
    expectation is a mean over active streams only; a tie goes to the smaller budget; from a current B, a smaller
    one only when it beats it by more than SWITCH_MARGIN, a larger one whenever it beats it."""
    spec_costs = COSTS[1:]
    score = jnp.log(jnp.asarray([[1.0, 0.5, 0.5, 0.25], [1.0, 0.5, 0.25, 0.25], [1.0, 1.0, 1.0, 1.0]]))
    state = budget.init_state(CANDIDATES, COSTS, max_accepted=15)  # no observations: the drafter trusted
    mean = budget.expected_accepted(score, state, [1, 3], jnp.asarray([True, True, False]))  # stream 3 is done
    np.testing.assert_allclose(mean, [0.5, 1.125])  # (0.5 + 0.5) / 2, (1.25 + 1.0) / 2
    assert int(budget.choose(jnp.asarray([1.2, 2.4]), spec_costs)) == 0
    assert int(budget.choose(jnp.asarray([1.0, 3.5]), spec_costs)) == 1    # 2.0/1.5 = 1.33 < 4.5/2.5 = 1.8
    assert int(budget.choose(jnp.asarray([2.0, 4.0]), spec_costs)) == 0    # 3/1.5 = 5/2.5 = 2: a tie
    margin = budget.SWITCH_MARGIN
    just_over = 1.5 * (1 + 2 * margin) * (4.0 + 1) / 2.5 - 1           # B=4's rate 2 (1 + 2 margin) vs B=16's 2
    just_under = 1.5 * (1 + margin / 2) * (4.0 + 1) / 2.5 - 1
    assert int(budget.choose(jnp.asarray([just_over, 4.0]), spec_costs, jnp.int32(1))) == 0
    assert int(budget.choose(jnp.asarray([just_under, 4.0]), spec_costs, jnp.int32(1))) == 1  # stays at B=16
    assert int(budget.choose(jnp.asarray([just_under, 4.0]), spec_costs)) == 0
    # upwards no margin: from B=4 (rate 2), B=16 at any rate above it; an equal rate stays
    above = (1.2 + 1) / 1.5 * 2.5 * (1 + margin / 4) - 1                # B=16's rate a quarter margin over B=4's
    assert int(budget.choose(jnp.asarray([1.2, above]), spec_costs, jnp.int32(0))) == 1
    assert int(budget.choose(jnp.asarray([1.2, (1.2 + 1) / 1.5 * 2.5 - 1]), spec_costs, jnp.int32(0))) == 0
    # the current budget stays when nothing beats it, also at a rate that is not a positive number
    assert int(budget.choose(jnp.asarray([1.2, jnp.nan, 3.0]), jnp.ones(3), jnp.int32(1))) == 1
    assert int(budget.choose(jnp.asarray([1.2, 2.0, 3.0]), jnp.asarray([1.0, 0.0, 1.0]), jnp.int32(1))) == 1
    assert int(budget.choose(jnp.asarray([1.2, 2.0]), jnp.asarray([jnp.inf, jnp.inf]), jnp.int32(1))) == 1


def test_accepted_at_each_budget_is_the_walk_up_to_its_first_node_past_b():
    """Paths of a tree verified at b = 16 (node indices, root first, -1 past the end): the walk in the tree of B
    counts its nodes up to the first one past B; means over the active streams."""
    path = jnp.asarray([[0, 1, 3, 9, 20, -1], [0, 2, 4, -1, -1, -1], [0, 1, 2, 3, 4, 5]])
    got = budget.accepted_at_each_budget(path, [2, 4, 8, 16], jnp.asarray([True, True, False]))
    # stream 0: B=2 -> 1 (node 3 is past 2), 4 -> 2, 8 -> 2, 16 -> 3 (node 20 past 16); stream 1: 1, 2, 2, 2
    np.testing.assert_allclose(got, [1.0, 2.0, 2.0, 2.5])


def test_drafting_against_ar_and_the_probes():
    """The first round drafts at the largest budget; after a drafted round the next drafts (at the forecast's best B)
    unless, after MIN_DRAFTED drafted rounds, AR's 1 / 1.0 beats the best forecast rate by AR_MARGIN; once AR wins,
    probe after PROBE_FIRST_GAP AR rounds or the floor the probes' cost sets, the gap doubling while AR keeps
    winning, back to the first gap when drafting wins."""
    plan = lambda st, expected, accepted, costs=COSTS: budget.plan_after_draft(  # st at a drafted B of CANDIDATES
        st, jnp.asarray(expected), jnp.asarray(accepted, jnp.float32), int(st.next_index) - 1, CANDIDATES, costs, 15)
    state = budget.init_state(CANDIDATES, COSTS, max_accepted=15)
    assert int(state.next_index) == 2  # 16 tokens / 2.5 s beats AR: draft, at B = 16
    win = plan(state, [1.0, 1.5], [1.0, 1.5])  # 2 / 1.5 > 1 and > 2.5 / 2.5
    assert int(win.next_index) == 1 and int(win.probe_gap) == budget.PROBE_FIRST_GAP
    # a probe costs 0.5 AR rounds more here, at most PROBE_SHARE = 3% of the AR rounds: at least 17 rounds apart
    assert int(budget.probe_gap_floor(CANDIDATES, COSTS)) == 17
    assert int(plan(state, [0.2, 0.3], [0.2, 0.3]).next_index) == 1  # AR would win, but too few rounds drafted yet
    seasoned = state._replace(drafted_rounds=jnp.int32(budget.MIN_DRAFTED))
    lose = plan(seasoned, [0.2, 0.3], [0.2, 0.3])  # forecast 0.25 x [0.2, 0.3]: 1.05 x 1.05 / 1.5 < 1
    assert int(lose.next_index) == 0 and int(lose.ar_left) == 17
    assert int(lose.probe_gap) == 2 * budget.PROBE_FIRST_GAP
    costly = plan(seasoned, [0.0, 0.0], [0.0, 0.0], COSTS * jnp.asarray([1, 4, 4]))
    floor = int(np.ceil(5.0 / budget.PROBE_SHARE))  # a drafted round costs 6 AR rounds: 5 more
    assert int(costly.ar_left) == floor and int(costly.probe_gap) == min(2 * budget.PROBE_FIRST_GAP, floor)
    for _ in range(17 - 1):
        lose = budget.plan_after_ar(lose, CANDIDATES, COSTS, 15)
        assert int(lose.next_index) == 0
    probe = budget.plan_after_ar(lose, CANDIDATES, COSTS, 15)
    assert int(probe.next_index) == 1  # the probe, at the forecast's best B = 4
    # the forecast is a plain mean over the first rounds, then weighs the newest FORECAST_WEIGHT
    second = plan(win, [0.0, 0.0], [0.0, 0.0])
    np.testing.assert_allclose(second.forecast, [0.5, 0.75])
    # a round at B = 4 observes what B = 4 accepted, and for B = 16 that plus the drafter's expected gain; at most D
    at_4 = state._replace(next_index=jnp.int32(1))
    np.testing.assert_allclose(plan(at_4, [0.5, 1.0], [3.0, 3.0]).forecast, [3.0, 3.5])
    np.testing.assert_allclose(plan(at_4, [0.5, 1.0], [14.8, 14.8]).forecast, [14.8, 15.0])
    np.testing.assert_allclose(plan(state, [0.5, 1.0], [2.0, 3.0]).forecast, [2.0, 3.0])  # at B = 16: both seen
    # never draft (nor probe) when even full acceptance loses to AR
    slow = jnp.asarray([1.0, 20.0, 30.0])
    assert int(budget.init_state(CANDIDATES, slow, max_accepted=15).next_index) == 0
    assert int(budget.plan_after_ar(lose._replace(ar_left=jnp.int32(1)), CANDIDATES, slow, 15).next_index) == 0
    # without AR among the candidates every round drafts, at its best B, however little it expects
    seasoned_no_ar = budget.init_state((4, 16), COSTS[1:], 15)._replace(drafted_rounds=jnp.int32(9))
    for expected, best in (([0.0, 5.0], 1), ([0.0, 0.0], 0)):
        no_ar = budget.plan_after_draft(seasoned_no_ar, jnp.asarray(expected), jnp.asarray(expected), 1, (4, 16),
                                        COSTS[1:], 15)
        assert int(no_ar.next_index) == best
    assert int(budget.probe_gap_floor((4, 16), COSTS[1:])) == 1


def test_a_few_poor_rounds_do_not_stop_drafting():
    """The decision to stop drafting reads the steady forecast (STEADY_WEIGHT): after 40 rounds accepting 1 node at
    B = 4 (rate 2 / 1.5 = 1.33 against AR's 1), three rounds accepting none bring the four-round forecast to
    0.42 (rate 0.95: AR would win) but the steady one only to 0.81, and the loop keeps drafting; a long run of poor
    rounds still turns it to AR. Both forecasts start as plain means."""
    plan = lambda st, accepted: budget.plan_after_draft(st, jnp.asarray([accepted, accepted]),
                                                        jnp.asarray([accepted, accepted], jnp.float32), 0,
                                                        CANDIDATES, COSTS, 15)
    state = budget.init_state(CANDIDATES, COSTS, max_accepted=15)._replace(next_index=jnp.int32(1))
    state = plan(plan(state, 1.0), 0.0)
    np.testing.assert_allclose(state.steady, [0.5, 0.5])
    for _ in range(38):
        state = plan(state, 1.0)
    for _ in range(3):
        state = plan(state, 0.0)
    np.testing.assert_allclose(state.forecast[0], 0.75 ** 3, rtol=1e-5)
    assert 0.8 < state.steady[0] < (15 / 16) ** 3  # the second round's 0 not yet quite forgotten
    assert (1 + budget.AR_MARGIN) * (state.forecast[0] + 1) / 1.5 < 1 and int(state.next_index) == 1
    for _ in range(10):
        state = plan(state, 0.0)
    assert int(state.next_index) == 0


def test_a_forced_candidate_is_the_only_one_run():
    """`calibrate` times each candidate under a cost table with +inf elsewhere (`forced_costs`): a fresh chooser
    starts there and every plan keeps it, whatever the rounds expect and accept."""
    for index in range(len(CANDIDATES)):
        costs = jnp.asarray(budget.forced_costs(CANDIDATES, index))
        state = budget.init_state(CANDIDATES, costs, 15)
        assert int(state.next_index) == index
        for expected in ([0.0, 0.0], [3.0, 9.0]):
            if index == 0:
                state = budget.plan_after_ar(state._replace(ar_left=jnp.int32(1)), CANDIDATES, costs, 15)
            else:
                state = budget.plan_after_draft(state, jnp.asarray(expected), jnp.asarray(expected), index - 1,
                                                CANDIDATES, costs, 15)
            assert int(state.next_index) == index


def test_step_costs_refit_to_the_loops_own_runs():
    """A run of 10 rounds at B=4 taking 20 s (2.0 s a round against the calibrated 1.5) moves B=4's cost
    a / (a^2 + REFIT_PRIOR) of the relative miss (a = 0.75, the prior's share of the run) and no other; runs mixing
    AR and B=16 rounds at true costs 1.2 and 3.0 recover both; a budget never run and an infinite one stay."""
    prior = budget.StepCosts(CANDIDATES, (1.0, 1.5, 2.5), how="calibrated")
    assert budget.refit(prior, []) is prior
    np.testing.assert_array_equal(budget.rounds_by_candidate([0, 4, 4, 16, 0, 0], CANDIDATES), [3, 2, 1])
    one = budget.refit(prior, [(np.asarray([0.0, 10.0, 0.0]), 20.0)])
    a, e = 0.75, 0.25
    np.testing.assert_allclose(one.seconds, [1.0, 1.5 * (1 + a * e / (a * a + budget.REFIT_PRIOR)), 2.5])
    assert "refitted to 1 run" in one.how
    runs = [(np.asarray([n0, 0.0, n16]), 1.2 * n0 + 3.0 * n16) for n0, n16 in [(30, 5), (10, 12), (0, 20), (25, 0)]]
    np.testing.assert_allclose(budget.refit(prior, runs * 5).seconds, [1.2, 1.5, 3.0], rtol=0.02)
    forced = budget.StepCosts(CANDIDATES, (np.inf, 1.5, 2.5))
    assert budget.refit(forced, [(np.asarray([0.0, 0.0, 4.0]), 12.0)]).seconds[0] == np.inf


def test_an_auto_call_that_verified_one_budget_hands_the_next_calls_to_its_fixed_loop():
    """A call with >= HANDOVER_SHARE of its rounds at one B: the next HANDOVER_FIRST_GAP calls run B's fixed loop (0:
    the AR loop), then one auto call; the gap doubles (up to HANDOVER_MAX_GAP) while the same B keeps winning,
    starts again when another B wins, and ends when no B has the share."""
    h = budget.Handover()
    assert h.fixed_budget() is None
    h.after_auto([0] * 9 + [8])                                     # 90% AR
    gaps = []
    for _ in range(6):
        fixed = []
        while (b := h.fixed_budget()) is not None:
            fixed.append(b)
        gaps.append(len(fixed))
        assert set(fixed) == {0}
        h.after_auto([0] * 20)
    assert gaps == [2, 4, 8, 16, 16, 16] and budget.HANDOVER_FIRST_GAP == 2 and budget.HANDOVER_MAX_GAP == 16
    while h.fixed_budget() is not None:
        pass
    h.after_auto([32] * 19 + [64])                                  # B = 32 wins: its fixed loop, the first gap
    assert [h.fixed_budget(), h.fixed_budget(), h.fixed_budget()] == [32, 32, None] and h.gap == 2
    h.after_auto([0] * 5 + [8] * 5)                                 # no budget has the share
    assert h.fixed_budget() is None and h.gap == 0
    h = budget.Handover(ar_pays=False)                              # the AR loop's round is no cheaper:
    h.after_auto([0] * 20)                                          # AR rounds stay in the auto loop, and the
    assert h.fixed_budget() is None and h.gap == 0 and h.probe_next  # next call probes at once
    h.after_auto([8] * 20)                                          # a drafted budget is still handed over
    assert h.fixed_budget() == 8 and not h.probe_next
    h = budget.Handover(budget=0, calls_left=2, gap=2)
    h.refuse_ar()                                                   # measured not to pay: the auto call probes
    assert h.fixed_budget() is None and h.probe_next


def test_calibration_scales_the_drafter_by_observed_acceptance():
    """Nodes of path probability 0.8 (bin 0) accepted half the time, 0.1 (bin 3) always: after one round the
    expectation of a node is p * (accepted + PRIOR) / (predicted + PRIOR) in its bin, capped at 1."""
    state = budget.init_state(CANDIDATES, COSTS, 15)
    score = jnp.log(jnp.asarray([[1.0, 0.8, 0.8, 0.1, 0.1]]))
    on_path = jnp.asarray([[True, True, False, True, True]])
    verified = jnp.asarray([[False, True, True, True, True]])
    state = budget.observe(state, score, on_path, verified)
    np.testing.assert_allclose(np.asarray(state.predicted)[[0, 3]], [1.6, 0.2], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state.accepted)[[0, 3]], [1.0, 2.0])
    q = budget.calibrated_probs(score, state)
    np.testing.assert_allclose(q, [[0.0, 0.8 * 2.0 / 2.6, 0.8 * 2.0 / 2.6, 0.1 * 3.0 / 1.2, 0.1 * 3.0 / 1.2]],
                               rtol=1e-6)
    np.testing.assert_allclose(budget.expected_accepted(score, state, (1, 4), jnp.asarray([True])),
                               [q[0, 1], q[0, 1:].sum()], rtol=1e-6)
    decayed = budget.observe(state, score, on_path, jnp.zeros_like(verified))  # nothing verified: only the decay
    np.testing.assert_allclose(decayed.accepted, budget.DECAY * state.accepted)


def test_monotone_costs_pool_the_budgets_that_a_noisy_table_ranks_below_a_smaller_one():
    """The H100's calibrated costs (us: AR, 4, 8, 16, 32) had B = 16 below B = 8: the two are pooled at their mean;
    an ordered table, and infinite entries, stay as they are; the fit is non-decreasing and keeps each pool's sum."""
    np.testing.assert_allclose(budget.monotone_costs([521, 705, 795, 717, 777]), [521, 705, 756, 756, 777])
    assert budget.monotone_costs([1.0, 2.0, 2.0, 3.0]) == (1.0, 2.0, 2.0, 3.0)
    assert budget.monotone_costs([np.inf, 3.0, 1.0]) == (np.inf, 2.0, 2.0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        raw = rng.uniform(0.5, 2.0, size=6)
        fit = np.asarray(budget.monotone_costs(raw))
        assert (np.diff(fit) >= -1e-12).all() and fit.sum() == pytest.approx(raw.sum())


def test_calibrate_recovers_the_step_costs_of_a_known_loop():
    """A loop whose call costs prefill + rounds x cost of the forced candidate: every cost comes back."""
    prefill, per_round = 0.010, {0: 0.001, 4: 0.003, 16: 0.004}

    def run_loop(costs, limit):
        forced = CANDIDATES[int(np.argmin(costs))]
        return prefill + limit * per_round[forced], limit

    costs = budget.calibrate(run_loop, CANDIDATES, rounds=5, reps=2)
    np.testing.assert_allclose(costs.seconds, [per_round[b] for b in CANDIDATES])
    assert costs.prefill_s == pytest.approx(prefill)


def test_cost_table_file_and_the_checks(tmp_path):
    path = str(tmp_path / "costs.json")
    key = budget.cost_key("cpu", "tiny", "float32", 2, 64, 0.0, CANDIDATES)
    assert budget.load_costs(path, key) is None
    budget.save_costs(path, budget.StepCosts(CANDIDATES, (1e-3, 2e-3, 3e-3), key))
    budget.save_costs(path, budget.StepCosts(CANDIDATES, (1.0, 2.0, 3.0), dict(key, streams=4)))
    got = budget.load_costs(path, key)
    assert got.seconds == (1e-3, 2e-3, 3e-3) and got.how == path
    assert budget.load_costs(path, dict(key, device="gpu")) is None
    spec = DecodeSpec(policy="ddtree", auto_budgets=CANDIDATES)
    with pytest.raises(ValueError, match=r"step costs for budgets \(0, 4\) given to a loop choosing among"):
        Decoder.check_costs(spec, budget.StepCosts((0, 4), (1.0, 2.0)))
    with pytest.raises(ValueError, match="must be positive seconds"):
        Decoder.check_costs(spec, budget.StepCosts(CANDIDATES, (1.0, float("nan"), 2.0)))
    for bad in ((4, 0), (0,), (), (0, 4, 4), (-1, 4)):
        with pytest.raises(ValueError, match="auto budgets"):
            budget.check_candidates(bad, lambda b: None)
    assert budget.parse_budget(" Auto ") is None and budget.parse_budget("8") == 8
