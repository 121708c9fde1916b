"""experiments/budget_ceiling.py: the replay of per-round budget choices on measured round outcomes.

Its premise is checked against the decode loop itself: at T = 0 in f32 a round's outcome depends only on where it
starts, so replaying a fixed budget over the outcomes measured round by round gives the loop's own rounds."""
import itertools

import numpy as np
import pytest

from experiments import budget_ceiling as bc
from kdtree_jax import model_dir
from kdtree_jax.decode import DecodeSpec, Decoder


def brute_force_seconds(accepted, seconds):
    """The fewest seconds over every sequence of budget indices (short streams only)."""
    best = np.inf
    q_end = accepted.shape[0]
    for choices in itertools.product(range(len(seconds)), repeat=q_end):
        q, total = 0, 0.0
        for c in choices:
            if q >= q_end:
                break
            total += seconds[c]
            q += accepted[q, c] + 1
        if q >= q_end:
            best = min(best, total)
    return best


def test_fewest_seconds_is_the_best_budget_sequence_and_beats_every_fixed_one():
    rng = np.random.default_rng(0)
    for _ in range(20):
        q_end, c = int(rng.integers(1, 7)), 3
        accepted = np.sort(rng.integers(0, 4, size=(q_end, c)), axis=1)  # larger trees accept at least as much
        accepted[:, 0] = 0  # budget index 0 is AR
        seconds = np.sort(rng.uniform(0.5, 2.0, size=c))
        best = bc.fewest_seconds(accepted, seconds)
        assert best == pytest.approx(brute_force_seconds(accepted, seconds))
        stream = bc.Rounds(accepted, accepted.astype(float), np.zeros((q_end, 2)), np.zeros((q_end, 2), int))
        for k in range(c):
            assert best <= bc.replay([stream], seconds, lambda r, m, k=k: k)[0] + 1e-12


@pytest.fixture(scope="module")
def shipped():
    """The shipped models in f32, 2 held-out prompts, AR's 16 tokens for each and the rounds after each token."""
    from kdtree_jax.data import eval_prompts
    from kdtree_jax.tokenizer import load_tokenizer
    target = model_dir.load_target("checkpoints/target", dtype="float32")
    drafter = model_dir.load_drafter("checkpoints/drafter", target.cfg)
    decoder = Decoder(target, drafter)
    prompts = [list(p.ids) for p in eval_prompts(load_tokenizer("checkpoints/tokenizer.json"), 2, 24)]
    outputs = [decoder.generate([p], DecodeSpec(policy="ar", max_new_tokens=16)).tokens[0] for p in prompts]
    contexts = [p + out[:q] for p, out in zip(prompts, outputs) for q in range(len(out) - 1)]
    bonus, accepted, expected, score, path = bc.round_outcomes(
        decoder, bc.outcome_spec(max(BUDGETS), drafter.cfg.block_size), contexts, BUDGETS, chunk=len(contexts))
    assert bonus.tolist() == [t for out in outputs for t in out[:-1]]  # each round starts from AR's token
    zero = np.zeros((len(bonus), 1), int)
    rounds = bc.Rounds(np.concatenate([zero, accepted], 1), np.concatenate([zero, expected], 1), score, path)
    streams, start = [], 0
    for out in outputs:
        streams.append(bc.Rounds(*(x[start:start + len(out) - 1] for x in rounds)))
        start += len(out) - 1
    return decoder, prompts, outputs, streams


BUDGETS = [4, 8, 16]


def test_replay_of_a_fixed_budget_runs_the_decode_loops_rounds(shipped):
    """Shipped checkpoints in f32, 2 held-out prompts x 16 tokens: the rounds measured one start at a time and
    replayed at B = 8 accept what the decode loop's rounds at B = 8 accepted, round by round."""
    decoder, prompts, outputs, streams = shipped
    for p, out, stream in zip(prompts, outputs, streams):
        loop = decoder.generate([p], DecodeSpec(policy="ddtree", budget=8, max_new_tokens=16,
                                                block_size=decoder.drafter_cfg.block_size))
        assert loop.tokens[0] == out
        q, taus = 0, []
        while q < len(stream.accepted):
            taus.append(min(stream.accepted[q, 2] + 1, len(stream.accepted) - q))
            q += stream.accepted[q, 2] + 1
        assert taus == loop.taus[:, 0].tolist()


def test_the_replayed_auto_chooser_picks_the_auto_loops_budgets(shipped):
    """The auto loop on given step costs (f32, one stream) and `AutoChooser` on the replayed rounds at the same
    costs choose the same B round by round (each call a fresh chooser: with costs given, the loop carries none)."""
    from kdtree_jax import budget as budget_lib
    decoder, prompts, outputs, streams = shipped
    labels = [0] + BUDGETS
    seconds = np.array([1.0, 1.5, 1.6, 1.9])  # AR cheap enough that some rounds may go to it
    spec = DecodeSpec(policy="ddtree", budget=0, auto_budgets=tuple(labels), max_new_tokens=16,
                      block_size=decoder.drafter_cfg.block_size)
    costs = budget_lib.StepCosts(tuple(labels), tuple(seconds.tolist()), {}, "given", 0.0)
    for p, stream in zip(prompts, streams):
        loop = decoder.generate([p], spec, costs=costs)
        recorder = Recorder(bc.AutoChooser(labels, seconds, spec.depth))
        bc.replay([stream], seconds, recorder)
        assert [labels[c] for c in recorder.chosen] == loop.budgets.tolist()


class Recorder:
    """A replay policy that passes each round on to `policy` and keeps the budget indices it chose."""

    def __init__(self, policy):
        self.policy, self.chosen = policy, []

    def __call__(self, rows, active):
        self.chosen.append(self.policy(rows, active))
        return self.chosen[-1]

    def after(self, rows, active, c):
        self.policy.after(rows, active, c)
