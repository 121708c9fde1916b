"""The tree budget chosen each round (`--budget=auto`): the device's measured step costs, what each budget would have
accepted in the rounds so far, and the drafter's expected gain from more nodes, calibrated against what the target
accepts.

A round of the auto loop verifies B + 1 nodes per stream, B from a compiled set of candidates (`DecodeSpec.
auto_budgets`, e.g. 0, 4, 8, 16, 32); B = 0 is an AR round (no draft, no build: the root alone). With c_B the
device's cost of such a round for the whole batch (seconds, `StepCosts`, measured by `calibrate`) and F_B a
forecast of the nodes a stream accepts at B (mean over active streams), a round emits F_B + 1 tokens per stream, so
the loop picks

    B* = argmax_B  (F_B + 1) / c_B      (`choose`; ties to the smaller B)

The loop runs in segments: a segment is an inner while loop of rounds at one candidate B (a static shape, no
conditional per round), ending when the plan for the next round names another candidate; the outer loop picks the
next segment with one `lax.switch`. On XLA:GPU every conditional is a host read of its predicate, and a round that
passed two of them (the draft `cond` and a budget `switch` each round) cost 12-30% more than the fixed loop's
round on an H100 (experiments/notes/decode.md, "Third GPU run"). So each round plans the next one
(`plan_after_draft`, `plan_after_ar`) from what the loop knows after it, and the next round keeps the current B
unless a larger one's rate beats it or a smaller one's beats it by SWITCH_MARGIN (a segment's end costs two
predicate reads; `choose`).

What a drafted round at b tells about each budget. The best-first tree of budget B is the first B + 1 nodes of the
tree of any larger budget (nodes in pop order, a parent before its children, `tree.prefix_tree`). So for B <= b
the round knows exactly what B would have accepted: the walk in B's tree is b's walk cut at its first node past B
(`accepted_at_each_budget`). For B > b it adds the drafter's expected gain from the extra nodes: if the target drew
its tokens from the drafter's distributions, node i would lie on the accepted path with probability p_i =
exp(score_i) (its path log-prob), so E_B = sum_{i=1..B} p_i; each p_i is corrected by the acceptance observed for
verified nodes of like confidence, q_i = min(1, p_i * r[bin(p_i)]), with bins by powers of two of p (`NUM_BINS`)
and r = (accepted + PRIOR) / (predicted + PRIOR) from decayed sums (`observe`; PRIOR pseudo-counts start r at 1;
DECAY per round forgets). A round at b builds the tree of the next candidate above b only (the largest candidates'
build is the dearest part of a drafted round on the CPU), so candidates above that one look no better than it this
round, and the loop climbs one candidate at a time; a fresh chooser's first round drafts at the largest candidate
and so observes every budget. The forecast F_B is a running average of these observations (FORECAST_WEIGHT on the
newest round; a plain mean over the first ones). The whole state (`BudgetState`: calibration, forecast, whether
AR rounds run and the probe countdown) carries from one call of a loop to its next (`Decoder.generate`), so a call
starts where the last one left off: in AR rounds when AR was winning, instead of paying MIN_DRAFTED drafted rounds
again (after calls handed to a fixed loop, `Handover`, the countdown to the next probe is cut to one round).

AR against drafting. When an AR round's 1 / c_0 beats every drafted rate by AR_MARGIN, after at least MIN_DRAFTED
drafted rounds, the loop runs AR rounds and drafts again (a probe, at the forecast's best B) after PROBE_FIRST_GAP AR
rounds, the gap doubling up to PROBE_MAX_GAP while AR keeps winning, and never shorter than what keeps a probe's
extra cost (the cheapest drafted round over an AR round) under PROBE_SHARE of the AR rounds' time
(`probe_gap_floor`). The choice is per batch, not per stream: the verify is one forward of static shape [S, B + 1]
whose cost depends on the largest B in the batch, and given that size every stream accepts the most from all of
its B + 1 nodes.

The decision to stop drafting reads a steadier forecast of the same observations (`BudgetState.steady`,
STEADY_WEIGHT: about 16 rounds of memory). At T = 1 one round accepts mostly 0 or 1 or more nodes; with the
four-round forecast a few poor rounds sent the loop to AR, and a probe moves a forecast by one round's weight only
(an H100 at T = 1 batch 1 ran AR rounds in 1915 of 2989 rounds though B = 32 paid 1.24x; decode.md, "Fourth GPU
run"). The choice among the budgets keeps the four-round forecast, which follows a prompt's changes.

Lossless: B is fixed before the target sees the round's nodes, from past rounds only; the greedy output equals
AR's, and at T > 0 each emitted token is still the target's sample at its node.

The costs are an input of the compiled loop (`LoopControls.step_costs`), so `calibrate` times the very executable
that decodes: each candidate forced by a cost table that makes it the only finite choice, for a few rounds.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_CANDIDATES = (0, 4, 8, 16, 32)  # budgets of --budget=auto; 0 = an AR round (B = 64 was never the best
# fixed B on the code target, H200 decode.json; in the set, it would make every round at 32 build a 64-node tree)
NUM_BINS = 12  # confidence bins: bin j holds path probabilities in (2^-(j+1), 2^-j]; the last one everything below
DECAY = 0.95  # per drafted round, of the calibration sums (about 20 rounds of memory)
PRIOR = 1.0  # pseudo-counts (in accepted nodes) of the calibration, at ratio 1
FORECAST_WEIGHT = 0.25  # weight of the newest drafted round in the forecast of E_B (the first rounds: a plain mean)
STEADY_WEIGHT = 1.0 / 16  # the same for the steady forecast, which alone decides whether to stop drafting
SWITCH_MARGIN = 0.02  # the next round moves to a smaller B only when its forecast rate beats the current's by this share
AR_MARGIN = 0.05  # drafting stops only when AR's rate beats the best drafted forecast rate by this share ...
MIN_DRAFTED = 4  # ... and only after this many drafted rounds (one round's acceptance is noisy, and a
# wrong turn to AR costs a whole probe gap of rounds at 1 token)
PROBE_FIRST_GAP = 8  # AR rounds before the first probe (a drafted round) once AR wins
PROBE_MAX_GAP = 64  # the probe gap doubles up to this many AR rounds (or up to the gap PROBE_SHARE sets)
PROBE_SHARE = 0.03  # at most this share of the time of the AR rounds between probes goes to a probe's extra cost
REFIT_PRIOR = 0.25  # `refit`: the calibrated cost weighs as a quarter of one run spent wholly at its budget
HANDOVER_SHARE = 0.9  # `Handover`: a call whose rounds were this share one B hands the next calls to B's fixed loop
HANDOVER_FIRST_GAP = 2  # calls on the fixed loop before the auto loop runs again, doubling while that B keeps winning
HANDOVER_MAX_GAP = 16
HANDOVER_AR_GAIN = 0.05  # a handover to AR only where the AR loop's round costs this share less than the auto loop's


def check_candidates(candidates, check_budget) -> tuple[int, ...]:
    """candidates: budgets of the auto loop, strictly increasing, >= 0, at least one > 0; check_budget(B) raises for
    a B the tree cannot hold. Returns them as a tuple, or raises ValueError naming the fix."""
    candidates = tuple(int(b) for b in candidates)
    if not candidates or any(b < 0 for b in candidates) or list(candidates) != sorted(set(candidates)):
        raise ValueError(f"auto budgets {candidates} must be distinct budgets >= 0 in increasing order, e.g. "
                         f"{DEFAULT_CANDIDATES} (0 = an AR round)")
    if candidates[-1] == 0:
        raise ValueError(f"auto budgets {candidates} need a budget > 0; for AR alone use policy 'ar'")
    for b in candidates:
        if b:
            check_budget(b)
    return candidates


def parse_budget(text: str) -> int | None:
    """A --budget flag value: an integer B >= 0, or 'auto' (None)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"budget {text!r} is neither 'auto' nor an integer number of tree nodes") from None


# ------------------------------------------------------------------------------------------------------ step costs
@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Measured seconds of one round of the auto loop for each candidate budget, for one batch shape on one device.

    candidates: (B, ...) as in DecodeSpec.auto_budgets; seconds[i]: a round verifying candidates[i] + 1 nodes per
    stream (candidates[i] = 0: an AR round), draft, build, accept, commit and the loop's bookkeeping included; key:
    what the costs were measured for (`cost_key`); how: 'calibrated' (timed just now) or the table file read;
    prefill_s: the loop's prefill (a call of 0 rounds), measured beside them."""
    candidates: tuple[int, ...]
    seconds: tuple[float, ...]
    key: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)
    how: str = "calibrated"
    prefill_s: float = 0.0

    def __post_init__(self):
        if len(self.seconds) != len(self.candidates):
            raise ValueError(f"step costs: {len(self.seconds)} times for the {len(self.candidates)} candidate budgets "
                             f"{self.candidates}")

    def as_dict(self) -> dict:
        return {"candidates": list(self.candidates), "seconds": list(self.seconds), "key": self.key, "how": self.how,
                "prefill_s": self.prefill_s}


def forced_costs(candidates, index: int) -> np.ndarray:
    """[C] costs under which the loop always picks candidates[index]: 1 there, +inf elsewhere."""
    costs = np.full(len(candidates), np.inf, np.float32)
    costs[index] = 1.0
    return costs


def cost_key(device_kind: str, model: str, dtype: str, streams: int, cache_len: int, temperature: float,
             candidates) -> dict:
    """What a cost table entry is valid for: the device, the model (config name and shape), its dtype, the batch,
    the cache rows (the verify reads them), whether the round samples, and the candidates."""
    return {"device": device_kind, "model": model, "dtype": dtype, "streams": int(streams), "cache_len": int(cache_len),
            "sampling": temperature > 0, "candidates": [int(b) for b in candidates]}


def load_costs(path: str, key: dict) -> StepCosts | None:
    """The entry of the cost table at `path` (a JSON list of StepCosts.as_dict()) whose key equals `key`; None when
    the file or the entry does not exist."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        entries = json.load(f)
    for e in entries:
        if e["key"] == key:
            return StepCosts(tuple(e["candidates"]), tuple(e["seconds"]), e["key"], how=path,
                             prefill_s=e.get("prefill_s", 0.0))
    return None


def save_costs(path: str, costs: StepCosts) -> None:
    """Add (or replace, by key) the entry of `costs` in the cost table at `path`."""
    entries = []
    if os.path.exists(path):
        with open(path) as f:
            entries = [e for e in json.load(f) if e["key"] != costs.key]
    entries.append(dict(costs.as_dict(), how="calibrated", date=time.strftime("%Y-%m-%d %H:%M:%S")))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(entries, f, indent=1)


def monotone_costs(seconds) -> tuple[float, ...]:
    """Step costs in candidate order (AR first, then increasing B) made non-decreasing: the least-squares
    non-decreasing fit of the finite ones (pooling adjacent violators), infinite ones left as they are. A larger
    budget verifies more nodes and builds a larger tree, so it never costs less; a table that says otherwise
    measured noise, and the chooser would follow it: an H100's calibration priced B = 16 at 717 us against B = 8's
    795, and the loop sat at B = 16 where B = 32 paid ~8% more (experiments/notes/decode.md, "The H100's T = 0 gap
    taken apart")."""
    values = [float(c) for c in seconds]
    finite = [i for i, c in enumerate(values) if np.isfinite(c)]
    blocks = []  # [sum, count] of pooled runs, their means non-decreasing
    for i in finite:
        blocks.append([values[i], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(count)]
    for i, c in zip(finite, fitted):
        values[i] = c
    return tuple(values)


def calibrate(run_loop, candidates, rounds: int = 8, reps: int = 3, key: dict | None = None) -> StepCosts:
    """Time one round of the compiled auto loop at each candidate budget (made non-decreasing in B:
    `monotone_costs`).

    run_loop(step_costs [C] float32, round_limit) -> (seconds, rounds run): one timed call of the compiled loop
    (prefill, then at most round_limit rounds; `Decoder.step_costs`). Each candidate is forced by `forced_costs` for
    `rounds` rounds; a round's cost is (that call - a call of 0 rounds, the prefill) / rounds run, the fastest of
    `reps` calls each (a shared machine only ever adds time; the settings take turns). A first call of each warms
    up (the first one compiles). Costs about (C + 1) x (reps + 1) x (prefill + rounds x a round).
    """
    settings = [(forced_costs(candidates, 0), 0)] + [(forced_costs(candidates, i), rounds)
                                                      for i in range(len(candidates))]
    for costs, limit in settings:
        run_loop(costs, limit)  # warm-up (the first call compiles)
    times, done = [[] for _ in settings], [0] * len(settings)
    for _ in range(reps):  # interleaved, so that a busy spell of a shared machine touches every setting alike
        for j, (costs, limit) in enumerate(settings):
            t, done[j] = run_loop(costs, limit)
            times[j].append(t)
    prefill_s = min(times[0])
    seconds = [max(min(t) - prefill_s, 1e-9) / max(n, 1) for t, n in zip(times[1:], done[1:])]
    return StepCosts(tuple(candidates), monotone_costs(seconds), key or {}, prefill_s=prefill_s)


def rounds_by_candidate(budgets, candidates) -> np.ndarray:
    """budgets [R] (the B each round verified; `LoopState.budgets`) -> [C] float: rounds run at each candidate."""
    index = np.searchsorted(np.asarray(candidates), np.asarray(budgets))
    return np.bincount(index, minlength=len(candidates)).astype(np.float64)


def refit(prior: StepCosts, runs) -> StepCosts:
    """The step costs refitted to the loop's own runs since `prior` was calibrated: runs = [(rounds [C] at each
    candidate, seconds those rounds took (a call's time less the prefill))].

    Each cost moves by a relative correction d_B, c_B = prior_B (1 + d_B), the d minimising
    sum over runs ((sum_B rounds_B c_B - seconds) / seconds)^2 + REFIT_PRIOR * sum_B d_B^2: a run spent wholly at
    one budget moves that budget's cost a^2 / (a^2 + REFIT_PRIOR) of the way to what the run measured (a: the
    calibrated cost's share of the run's time); budgets no run used keep their calibrated cost, as do infinite ones,
    up to the non-decreasing fit of the result (`monotone_costs`).
    Why: the calibration's forced rounds ran right after the prompts and cost ~12% less than the decode's own at
    T = 1, batch 8 on an H100, enough to rank B=32 above AR where AR won (experiments/notes/decode.md, "Outcome on
    the GPU")."""
    p = np.asarray(prior.seconds, np.float64)
    if not runs:
        return prior
    n = np.stack([np.asarray(rounds, np.float64) for rounds, _ in runs])        # [R, C]
    t = np.asarray([seconds for _, seconds in runs], np.float64)                # [R]
    used = np.isfinite(p) & (n.sum(axis=0) > 0)
    if not used.any():
        return prior
    a = n[:, used] * p[used] / t[:, None]      # [R, U]: each used budget's predicted share of the run's time
    e = (t - n[:, used] @ p[used]) / t          # [R]: the run's relative miss
    d = np.linalg.solve(a.T @ a + REFIT_PRIOR * np.eye(a.shape[1]), a.T @ e)
    seconds = p.copy()
    seconds[used] = p[used] * (1.0 + np.clip(d, -0.5, 2.0))
    return dataclasses.replace(prior, seconds=monotone_costs(seconds),
                               how=f"{prior.how}, refitted to {len(runs)} run(s) of the loop")


@dataclasses.dataclass
class Handover:
    """Whether a `generate` of the auto loop runs a fixed loop instead (host side, between calls), and which.

    A round of the auto loop costs more than the same round of a fixed loop: a drafted one builds the tree of the
    next candidate up and computes the expectations, an AR one keeps its row of the drafter's hidden layers (its
    context projection is deferred to the end of its AR segment: before that, AR rounds of the auto loop cost 9-16%
    more than the AR loop's on an H100; decode.md, "Fourth GPU run"), and a segment's end costs two predicate
    reads. So when the auto loop verified one budget B in at least HANDOVER_SHARE of a call's rounds, the next
    calls run the fixed loop of that B (B = 0: the plain AR loop); every so many calls (HANDOVER_FIRST_GAP,
    doubling up to HANDOVER_MAX_GAP while the same B keeps winning) the auto loop runs again to see whether another
    choice pays now (probing at once if it was in AR rounds). Lossless either way: every loop emits the target's
    own tokens."""
    budget: int = 0  # the fixed loop's B while calls_left > 0
    calls_left: int = 0  # calls still to run on the fixed loop
    gap: int = 0  # the fixed calls before the next auto call, once a budget wins again (0: none has won yet)
    probe_next: bool = False  # the last auto call ran AR but was not handed over: the next call probes at once
    ar_pays: bool | None = None  # whether the AR loop's round costs HANDOVER_AR_GAIN less than the auto loop's AR
    # round (None: not measured yet; `Decoder.generate` measures it before the first handover to AR). Where it does
    # not, a handover to AR would save little and stop the probes that find the prompts worth drafting: prompts
    # differ from call to call (decode.md, "Fifth GPU run": 13 of 32 calls handed to AR at T = 1, batch 1, where
    # B = 32 paid 1.24x; the auto loop's AR round cost 478 us there against the AR loop's 467)

    def fixed_budget(self) -> int | None:
        """The B of the fixed loop this call runs (0: the AR loop), or None for the auto loop; counts the call."""
        if self.calls_left <= 0:
            return None
        self.calls_left -= 1
        return self.budget

    def after_auto(self, budgets) -> None:
        """After a call of the auto loop that verified `budgets` [R] (0: an AR round)."""
        values, counts = np.unique(np.asarray(budgets), return_counts=True)
        won = int(values[counts.argmax()]) if counts.size else None
        share = won is not None and counts.max() >= HANDOVER_SHARE * counts.sum()
        self.probe_next = share and won == 0 and self.ar_pays is False
        if share and not self.probe_next:
            self.gap = min(2 * self.gap, HANDOVER_MAX_GAP) if self.gap and won == self.budget else HANDOVER_FIRST_GAP
            self.budget, self.calls_left = won, self.gap
        else:
            self.gap = self.calls_left = 0

    def refuse_ar(self) -> None:
        """The handover to AR just measured not to pay (`ar_pays` False): no fixed calls, and the auto call that
        runs instead probes at once."""
        self.gap = self.calls_left = 0
        self.probe_next = True


# ------------------------------------------------------------------------------------------------------ on device
class BudgetState(NamedTuple):
    """The auto loop's state (batch level); C candidates, of which C' > 0."""
    predicted: jax.Array  # [NUM_BINS] f32: decayed sum of the drafter path probabilities of verified nodes, by bin
    accepted: jax.Array  # [NUM_BINS] f32: decayed count of those nodes found on the accepted path
    forecast: jax.Array  # [C'] f32: expected accepted nodes per candidate budget > 0 (mean over active streams)
    steady: jax.Array  # [C'] f32: the same observations averaged over more rounds (STEADY_WEIGHT): drafting or AR
    drafted_rounds: jax.Array  # int32: drafted rounds so far (the forecast is a plain mean over the first ones)
    next_index: jax.Array  # int32: index into the candidates of the next round's B (0 with candidates[0] = 0: AR)
    ar_left: jax.Array  # int32: AR rounds left before the next probe
    probe_gap: jax.Array  # int32: the AR rounds between probes, doubling while AR keeps winning


def spec_indices(candidates) -> tuple[int, ...]:
    """Indices of the candidates > 0."""
    return tuple(i for i, b in enumerate(candidates) if b > 0)


def init_state(candidates, step_costs, max_accepted: int) -> BudgetState:
    """A fresh chooser (no observations): the first round drafts at the largest candidate of finite cost (it
    verifies the most nodes, so it observes every budget below it) if speculation could pay at all (`could_pay`),
    else it is candidates[0] (an AR round when that is 0)."""
    draft = could_pay(candidates, step_costs, max_accepted)
    largest = len(candidates) - 1 - jnp.argmax(jnp.isfinite(step_costs[::-1]))
    forecast = jnp.zeros(len(spec_indices(candidates)), jnp.float32)
    return BudgetState(jnp.zeros(NUM_BINS, jnp.float32), jnp.zeros(NUM_BINS, jnp.float32), forecast, forecast,
                       jnp.int32(0),
                       jnp.where(draft, largest, 0).astype(jnp.int32), jnp.int32(PROBE_FIRST_GAP),
                       jnp.int32(PROBE_FIRST_GAP))


def _ar_rate(candidates, step_costs):
    """Tokens per second per stream of an AR round (0 when 0 is not a candidate)."""
    return 1.0 / step_costs[0] if candidates[0] == 0 else jnp.float32(0.0)


def _spec_costs(candidates, step_costs):
    """[C'] the costs of the candidates > 0."""
    return step_costs[jnp.asarray(spec_indices(candidates))]


def could_pay(candidates, step_costs, max_accepted: int):
    """bool []: whether a drafted round accepting all `max_accepted` (the tree depth D) nodes would beat an AR
    round at some budget; if not, the loop never drafts (nor probes)."""
    return jnp.max((max_accepted + 1.0) / _spec_costs(candidates, step_costs)) > _ar_rate(candidates, step_costs)


def confidence_bin(p):
    """p (path probabilities in [0, 1]) -> int32 bins: floor(-log2 p), clipped to [0, NUM_BINS - 1]."""
    return jnp.clip(jnp.floor(-jnp.log2(jnp.maximum(p, 1e-30))), 0, NUM_BINS - 1).astype(jnp.int32)


def calibrated_probs(score, state: BudgetState):
    """score [S, N] (path log-probs, node 0 the root at 0, -inf padding) -> q [S, N] f32: the calibrated probability
    that each node is accepted, 0 for the root and padding."""
    p = jnp.exp(score.astype(jnp.float32))
    ratio = (state.accepted + PRIOR) / (state.predicted + PRIOR)
    q = jnp.minimum(p * ratio[confidence_bin(p)], 1.0)
    return q.at[:, 0].set(0.0)


def mean_over_active(values, active) -> jax.Array:
    """values [S, C], active [S] bool -> [C] f32: the mean over the active streams (0 with none active)."""
    weight = active.astype(jnp.float32)
    return (values * weight[:, None]).sum(0) / jnp.maximum(weight.sum(), 1.0)


def expected_accepted(score, state: BudgetState, budgets, active) -> jax.Array:
    """score [S, N + 1] of a best-first tree of N nodes, active [S] bool -> [len(budgets)] f32: the
    calibrated expected accepted nodes of the first B + 1 nodes, for each B in `budgets` (static, 1 <= B <= N), mean
    over the active streams (0 with none active)."""
    cum = jnp.cumsum(calibrated_probs(score, state), axis=1)[:, jnp.asarray(budgets)]  # [S, C']
    return mean_over_active(cum, active)


def choose(forecast, costs, current=None):
    """forecast [C'] expected accepted nodes per candidate B > 0, costs [C'] seconds -> int32 index into them of the
    best rate (F + 1) / c (ties to the smaller index). With `current` (an index, int32 []): a larger B whose rate
    beats current's at all, or a smaller one that beats it by more than SWITCH_MARGIN, else current. The climb takes
    no margin because a round at the larger B observes every smaller one exactly (`accepted_at_each_budget`): a
    wrong climb shows at once and costs one segment. The descent keeps the margin: below, the larger B is known
    only through the drafter's expected gain, which undershoots (on an H100 auto held B = 16 where B = 32 cost 0.4%
    more and accepted 9% more: decode.md, "Fourth GPU run")."""
    rate = (forecast + 1.0) / costs
    if current is None:
        return jnp.argmax(rate).astype(jnp.int32)
    index = jnp.arange(rate.shape[0])
    bar = jnp.where(index > current, 1.0, 1.0 + SWITCH_MARGIN) * rate[current]
    better = jnp.where((rate > bar) & (index != current), rate, -jnp.inf)
    return jnp.where(jnp.max(better) > -jnp.inf, jnp.argmax(better), current).astype(jnp.int32)


def observe(state: BudgetState, score, on_path, verified) -> BudgetState:
    """Fold one drafted round's outcome into the calibration. score [S, N] path log-probs, on_path [S, N] bool
    (the node is on the accepted path), verified [S, N] bool (a non-root node the target verified, of an active
    stream)."""
    p = jnp.exp(score.astype(jnp.float32))
    one_hot = jax.nn.one_hot(confidence_bin(p), NUM_BINS, dtype=jnp.float32) * verified[..., None]
    predicted = DECAY * state.predicted + (one_hot * p[..., None]).sum((0, 1))
    accepted = DECAY * state.accepted + (one_hot * on_path[..., None]).sum((0, 1))
    return state._replace(predicted=predicted, accepted=accepted)


def _index_of_spec(candidates, k):
    """Index into the candidates of the k-th candidate > 0 (k int32 [])."""
    return jnp.asarray(spec_indices(candidates), jnp.int32)[k]


def accepted_at_each_budget(path, budgets, active) -> jax.Array:
    """path [S, P] (the accept walk's node indices, root first, -1 past its end) of a tree verified at budget b ->
    [len(budgets)] f32: the nodes the walk would have accepted in the tree of each budget B in `budgets` (static),
    mean over the active streams [S]. For B <= b the tree of B is the first B + 1 nodes of b's, a node's target
    token depends on its ancestors only, and siblings differ in token, so the walk in B's tree is b's walk up to its
    first node past B: exact at T = 0; at T > 0 the samples of B's tree would be other draws of the same
    distributions (`decode.pick_tokens` shares noise by depth only in trees of more nodes than depths), so exact in
    distribution. (For B > b: b's count, a lower bound.)"""
    steps = path[:, 1:, None]                                                 # [S, P - 1, 1]
    inside = (steps >= 1) & (steps <= jnp.asarray(budgets)[None, None, :])    # [S, P - 1, C']
    count = jnp.cumprod(inside.astype(jnp.int32), axis=1).sum(axis=1)         # [S, C']
    return mean_over_active(count, active)


def plan_after_draft(state: BudgetState, expected, accepted, current: int, candidates, step_costs,
                     max_accepted: int) -> BudgetState:
    """After a drafted round: update the forecast and plan the next round: the best B by the forecast (from this
    round's B, up on any gain, down by SWITCH_MARGIN: `choose`), or AR rounds until a probe when AR's rate beats
    every drafted one of the steady forecast by AR_MARGIN after at least MIN_DRAFTED drafted rounds.

    current: this round's B, as an index into the candidates > 0 (static).
    expected [C']: the round's tree's calibrated expected accepted nodes at each candidate B > 0; accepted [C']: the
    nodes the round accepted in the tree of each B up to its own b (`accepted_at_each_budget`), both means over
    active streams. The round's observation of a budget B is what it accepted at B <= b (exact), and above b its
    acceptance at b plus the drafter's expected gain from the extra nodes (expected_B - expected_b), at most
    max_accepted (the depth D). The drafter's own confidence alone misjudged the level: the code target's drafter
    expects about half the nodes it gets accepted, and a first round judged by it sent the loop to AR for 40 rounds
    (decode.md, "Segments")."""
    n = state.drafted_rounds + 1
    costs = _spec_costs(candidates, step_costs)
    above = jnp.arange(costs.shape[0]) > current
    seen = jnp.clip(jnp.where(above, accepted[current] + expected - expected[current], accepted), 0.0, max_accepted)
    average = lambda old, weight: old + jnp.maximum(weight, 1.0 / n.astype(jnp.float32)) * (seen - old)
    forecast, steady = average(state.forecast, FORECAST_WEIGHT), average(state.steady, STEADY_WEIGHT)
    draft = ((1.0 + AR_MARGIN) * jnp.max((steady + 1.0) / costs) >= _ar_rate(candidates, step_costs)) | \
        (n < MIN_DRAFTED)
    spec_next = _index_of_spec(candidates, choose(forecast, costs, current))
    gap = jnp.maximum(state.probe_gap, probe_gap_floor(candidates, step_costs))
    return state._replace(forecast=forecast, steady=steady, drafted_rounds=n,
                          next_index=jnp.where(draft, spec_next, 0), ar_left=jnp.where(draft, 0, gap),
                          probe_gap=jnp.where(draft, PROBE_FIRST_GAP, jnp.minimum(2 * state.probe_gap,
                                                                                  jnp.maximum(PROBE_MAX_GAP, gap))))


def build_budget(candidates, budget: int) -> int:
    """The nodes a drafted round at `budget` builds: the next candidate above it (the smallest tree that tells
    whether a larger B pays), `budget` itself at the largest."""
    return min([b for b in candidates if b > budget], default=budget)


def after_drafted_round(state: BudgetState, score, path, budget: int, candidates, step_costs, max_accepted: int,
                        active) -> BudgetState:
    """The chooser after a drafted round at `budget` (static): fold its outcome into the calibration (`observe`),
    then plan the next round from what each budget accepted and the drafter's expected gain above
    (`plan_after_draft`). score [S, N + 1] of the tree built (N = `build_budget`), path [S, P] of the walk in its
    first budget + 1 nodes, active [S] bool."""
    spec_budgets = [b for b in candidates if b > 0]
    build = score.shape[1] - 1
    nodes = jnp.arange(build + 1)
    on_path = (path[:, :, None] == nodes).any(axis=1)  # [S, build + 1]
    verified = (nodes >= 1) & (nodes <= budget) & active[:, None] & jnp.isfinite(score)
    state = observe(state, score, on_path, verified)
    expected = expected_accepted(score, state, [min(b, build) for b in spec_budgets], active)  # [C']
    accepted = accepted_at_each_budget(path, spec_budgets, active)  # [C']
    return plan_after_draft(state, expected, accepted, spec_budgets.index(budget), candidates, step_costs,
                            max_accepted)


def probe_gap_floor(candidates, step_costs):
    """int32 []: the fewest AR rounds between probes for which a probe's extra cost (the cheapest drafted round
    minus an AR round) is at most PROBE_SHARE of their time; 1 without AR rounds."""
    if candidates[0] != 0:
        return jnp.int32(1)
    extra = jnp.min(_spec_costs(candidates, step_costs)) / step_costs[0] - 1.0
    return jnp.clip(jnp.ceil(extra / PROBE_SHARE), 1, 2**20).astype(jnp.int32)


def plan_after_ar(state: BudgetState, candidates, step_costs, max_accepted: int) -> BudgetState:
    """After an AR round: count down to the next probe, a drafted round at the forecast's best B (never one where
    speculation cannot pay, `could_pay`)."""
    left = state.ar_left - 1
    probe = (left <= 0) & could_pay(candidates, step_costs, max_accepted)
    best = _index_of_spec(candidates, choose(state.forecast, _spec_costs(candidates, step_costs)))
    return state._replace(ar_left=left, next_index=jnp.where(probe, best, 0).astype(jnp.int32))
