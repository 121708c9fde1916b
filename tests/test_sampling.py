"""Sampling at T > 0 is lossless where it matters: the tokens DDTree emits past the first of each round (depths 2..L
of the accepted paths, where the target's samples at non-root tree nodes decide) follow the target's distribution
at temperature T, exactly as AR sampling's tokens do.

Setup: the tiny target with a vocabulary of V = 8 and a drafter that is always accepted down to depth 2: it drafts
uniform logits, so the tree of B = 8 + 64 + 8 nodes holds every token at depths 1 and 2 (and 8 nodes at depth 3),
and every round emits 3 or 4 tokens (block size L = 4). For each sampled sequence one causal forward of the target
(the naive MLA path, no cache, no tree) gives the exact conditional distribution p_t = softmax(logits_t / T) of
every generated token. The tokens checked are those at index >= 1 within their round (index 0 is the root's own
sample); whether a token is checked depends only on the tokens before it, so under correct sampling each checked
token is a draw from its p_t given everything before it (so is every token, which is checked too). AR sampling's
tokens, checked the same way at T = 1, show that the statistics hold where sampling is right by construction. The
same seed must give the same samples. Two statistics, on S streams x max_new tokens:

  * randomized PIT: u = P_t(tokens more probable than x) + U * p_t(x), U uniform: i.i.d. uniform on [0, 1) under
    correct sampling, whatever p_t is; Pearson's chi-square over 10 equal bins (9 dof) must stay below
    CHI2_9_P1E6 = 44.81 (its 1e-6 quantile).
  * argmax frequency: z = (#{x_t = argmax p_t} - sum_t m_t) / sqrt(sum_t m_t (1 - m_t)), m_t = max p_t; a sum of
    bounded martingale increments, about standard normal under correct sampling: |z| < Z_MAX = 5 (p ~ 6e-7).

Power against "argmax at every tree node except the root" (the bug this file exists for): every checked token is
then its argmax, so z = sum_t (1 - m_t) / sqrt(sum_t m_t (1 - m_t)) >= sqrt(sum_t (1 - m_t)) with certainty, since
m_t (1 - m_t) <= 1 - m_t. The test asserts sum_t (1 - m_t) >= MIN_UNCERTAINTY = 100 over the checked tokens (so
z >= 10 > Z_MAX under the bug: it fails with probability 1, not just > 99%). Measured with the default sizes (256
streams x 13 tokens, 2048 checked tokens per T, T = 0.7 / 1.0 / 1.3): sum_t (1 - m_t) 1154 / 1367 / 1486; correct
sampling chi-square 6.6 / 5.2 / 6.3 and z 1.2 / 0.0 / 0.0; under the bug chi-square 2254 / 3499 / 4625 and
z 54 / 65 / 74. A subtler bug, sampling the nodes below the root at T = 1 whatever T, gives chi-square 198 / 3 / 54
and z -9.5 / 0.6 / 6.6 (caught at T = 0.7 and 1.3; with 64 streams it gave 37 and -4.8 at T = 0.7: not reliably
caught, hence 256). The default run checks ddtree at T = 0.7 and 1.3, which catch both bugs (T = 1 adds no power
against either, and AR's test samples at T = 1); the slow variant (512 streams x 25 tokens, ~8000 checked tokens per
T) takes all three T and resolves smaller errors.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdtree_jax import budget
from kdtree_jax import config as config_lib
from kdtree_jax.decode import DecodeSpec, Decoder
from kdtree_jax.drafter import DrafterCache
from kdtree_jax.model.transformer import Transformer

VOCAB, BLOCK = 8, 4
BUDGET = VOCAB + VOCAB**2 + VOCAB  # every token at depths 1 and 2, and 8 nodes at depth 3
PROMPT = [1, 2, 3]
CHI2_9_P1E6 = 44.81
Z_MAX = 5.0
MIN_UNCERTAINTY = 100.0


class UniformDrafter(nnx.Module):
    """Drafts uniform logits: the best-first tree is then breadth first, every token at each level it fills."""

    def __init__(self, cfg: config_lib.DrafterConfig):
        self.cfg = cfg

    def init_cache(self, num_streams, capacity):
        return DrafterCache((), ())

    def extend_cache(self, cache, hidden, positions, offsets, count=None):
        return cache

    def draft(self, embed, lm_head, bonus, start, cache, ctx_len):
        return jnp.zeros((bonus.shape[0], self.cfg.block_size - 1, self.cfg.vocab_size))


@pytest.fixture(scope="module")
def target():
    return Transformer(config_lib.tiny().replace(vocab_size=VOCAB), nnx.Rngs(3))


def exact_distributions(target, tokens: np.ndarray, temperature: float) -> np.ndarray:
    """tokens [S, N] generated after PROMPT -> p [S, N, V] float64: the target's distribution of each at T."""
    seqs = np.concatenate([np.tile(PROMPT, (len(tokens), 1)), tokens], axis=1)
    logits = np.asarray(target.causal(jnp.asarray(seqs), absorbed=False).logits, np.float64)
    logits = logits[:, len(PROMPT) - 1:-1] / temperature
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def past_the_root(taus: np.ndarray, num_tokens: int) -> np.ndarray:
    """taus [rounds, S] -> [S, num_tokens] bool: tokens at index >= 1 within their round (token 0 is prefill's)."""
    mask = np.zeros((taus.shape[1], num_tokens), bool)
    for s in range(taus.shape[1]):
        start = 1
        for tau in taus[:, s]:
            mask[s, start + 1:start + tau] = True
            start += tau
    return mask


def pit_chi_square(p: np.ndarray, x: np.ndarray, rng: np.random.Generator, bins: int = 10) -> float:
    """p [n, V] distributions, x [n] draws -> Pearson's chi-square of the randomized PIT values over `bins` bins."""
    order = np.argsort(-p, axis=-1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=-1)
    rank = np.argmax(order == x[:, None], axis=-1)
    below = np.where(np.arange(p.shape[1])[None] < rank[:, None], ranked, 0.0).sum(-1)
    u = below + rng.random(len(x)) * p[np.arange(len(x)), x]
    counts = np.bincount(np.minimum((u * bins).astype(int), bins - 1), minlength=bins)
    expected = len(x) / bins
    return float(((counts - expected) ** 2 / expected).sum())


def argmax_z(p: np.ndarray, x: np.ndarray) -> float:
    m = p.max(-1)
    hits = (x == p.argmax(-1)).sum()
    return float((hits - m.sum()) / np.sqrt((m * (1 - m)).sum()))


def sampling_statistics(p: np.ndarray, x: np.ndarray, seed: int) -> dict:
    """p [n, V], x [n] -> the two statistics, asserted within their bounds."""
    stats = dict(n=len(x), uncertainty=float((1 - p.max(-1)).sum()),
                 chi2=pit_chi_square(p, x, np.random.default_rng(seed)), z=argmax_z(p, x))
    assert stats["chi2"] < CHI2_9_P1E6 and abs(stats["z"]) < Z_MAX, stats
    return stats


def sample(target, decoder, spec: DecodeSpec, streams: int, seed: int):
    """`streams` copies of PROMPT decoded -> (tokens [S, max_new], their exact distributions [S, max_new, V], taus)."""
    result = decoder.generate([PROMPT] * streams, spec, seed=seed)
    tokens = np.asarray(result.tokens)
    return tokens, exact_distributions(target, tokens, spec.temperature), result.taus


def check_ddtree(target, temperature: float, streams: int, max_new: int) -> None:
    spec = DecodeSpec(policy="ddtree", budget=BUDGET, block_size=BLOCK, temperature=temperature,
                      max_new_tokens=max_new)
    decoder = Decoder(target, UniformDrafter(config_lib.tiny_drafter(target.cfg, BLOCK)))
    tokens, p, taus = sample(target, decoder, spec, streams, seed=1)
    checked = past_the_root(taus, tokens.shape[1])
    past = sampling_statistics(p[checked], tokens[checked], seed=1)
    assert past["n"] >= streams * (max_new - 1) // 2  # rounds emit >= 3 tokens, >= 2 of them past the root
    assert past["uncertainty"] >= MIN_UNCERTAINTY  # the power bound of the module docstring
    sampling_statistics(p.reshape(-1, VOCAB), tokens.ravel(), seed=2)
    assert decoder.generate([PROMPT] * streams, spec, seed=1).tokens == tokens.tolist()  # reproducible by seed


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_ddtree_tokens_follow_the_target(target, temperature):
    check_ddtree(target, temperature, streams=256, max_new=13)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_ddtree_tokens_follow_the_target_many_samples(target, temperature):
    check_ddtree(target, temperature, streams=512, max_new=25)


def test_auto_budget_tokens_follow_the_target(target):
    """--budget=auto over (0, 8, 80) with step costs under which AR wins once MIN_DRAFTED rounds drafted, and probes
    are far apart (a drafted round costs 2.5 AR rounds): tree rounds, then AR rounds, 256 streams checked past the
    root. B is fixed before the round's target samples, so the tokens still follow the
    target's distribution, past the root and overall."""
    spec = DecodeSpec(policy="ddtree", auto_budgets=(0, 8, BUDGET), block_size=BLOCK, temperature=1.3,
                      max_new_tokens=21)
    decoder = Decoder(target, UniformDrafter(config_lib.tiny_drafter(target.cfg, BLOCK)))
    costs = budget.StepCosts(spec.auto_budgets, (0.4, 1.0, 1.508))
    result = decoder.generate([PROMPT] * 256, spec, seed=4, costs=costs)
    tokens = np.asarray(result.tokens)
    p = exact_distributions(target, tokens, spec.temperature)
    assert 0 in result.budgets and (result.budgets[:budget.MIN_DRAFTED] > 0).all()
    checked = past_the_root(result.taus, tokens.shape[1])
    past = sampling_statistics(p[checked], tokens[checked], seed=4)
    assert past["uncertainty"] >= MIN_UNCERTAINTY
    sampling_statistics(p.reshape(-1, VOCAB), tokens.ravel(), seed=5)


def test_ar_tokens_follow_the_target(target):
    tokens, p, _ = sample(target, Decoder(target), DecodeSpec(policy="ar", temperature=1.0, max_new_tokens=13),
                          streams=64, seed=3)
    sampling_statistics(p.reshape(-1, VOCAB), tokens.ravel(), seed=3)
