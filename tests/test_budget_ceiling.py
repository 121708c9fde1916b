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
        for k in range(c):
            assert best <= bc.replay([accepted], [accepted.astype(float)], seconds, lambda a, e, k=k: k)[0] + 1e-12


def test_replay_of_a_fixed_budget_runs_the_decode_loops_rounds():
    """Shipped checkpoints in f32, 2 held-out prompts x 16 tokens: the rounds measured one start at a time and
    replayed at B = 8 accept what the decode loop's rounds at B = 8 accepted, round by round."""
    from kdtree_jax.data import eval_prompts
    from kdtree_jax.tokenizer import load_tokenizer
    target = model_dir.load_target("checkpoints/target", dtype="float32")
    drafter = model_dir.load_drafter("checkpoints/drafter", target.cfg)
    decoder = Decoder(target, drafter)
    prompts = [list(p.ids) for p in eval_prompts(load_tokenizer("checkpoints/tokenizer.json"), 2, 24)]
    ar = DecodeSpec(policy="ar", max_new_tokens=16)
    outputs = [decoder.generate([p], ar).tokens[0] for p in prompts]
    contexts = [p + out[:q] for p, out in zip(prompts, outputs) for q in range(len(out) - 1)]
    budgets = [4, 8]
    bonus, accepted, _ = bc.round_outcomes(decoder, bc.outcome_spec(max(budgets), drafter.cfg.block_size), contexts,
                                           budgets, chunk=len(contexts))
    assert bonus.tolist() == [t for out in outputs for t in out[:-1]]  # each round starts from AR's token
    start = 0
    for p, out in zip(prompts, outputs):
        loop = decoder.generate([p], DecodeSpec(policy="ddtree", budget=8, max_new_tokens=16,
                                                block_size=drafter.cfg.block_size))
        assert loop.tokens[0] == out
        mine = accepted[start:start + len(out) - 1]
        q, taus = 0, []
        while q < len(mine):
            taus.append(min(mine[q, 1] + 1, len(mine) - q))
            q += mine[q, 1] + 1
        assert taus == loop.taus[:, 0].tolist()
        start += len(out) - 1
