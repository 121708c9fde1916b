"""Prefill and the jitted round loop: autoregressive (ar), DFlash chain (chain) and DDTree (ddtree) decoding.

Every policy runs the same round, all on device inside one `lax.while_loop` (no host round trip per round):
  draft  -> the drafter's L-1 per-position logits after the bonus token        (skipped by ar)
  build  -> a draft tree of B+1 nodes: ar B=0; chain top-1 per depth, B=L-1; ddtree best-first top-B prefixes
  verify -> one target forward over the B+1 nodes at positions length + depth (tree KV -> rows length..length+B)
  accept -> walk the tree along the target's own tokens (argmax, or a sample per node at T > 0)
  commit -> compact the accepted KV rows, extend the drafter context, emit accepted tokens + the new bonus
ddtree with `auto_budgets` (`--budget=auto`) verifies each round a B from a compiled set, planned by the round
before from the device's measured step costs and what each budget accepted (kdtree_jax.budget): an AR round (no
draft) or a draft built at the next candidate above B (at B, the largest), of which the first B + 1 nodes are
verified. Rounds of one B run as a segment (an inner while loop, static shapes); the outer loop's `lax.switch`
starts the segment of the B the last round planned. An AR round of that loop keeps its row for the drafter's context
and the AR segment's end projects the rows at once (`DeferredContext`).
Greedy output is identical for all policies (the losslessness invariant the tests check).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax import budget as budget_lib
from kdtree_jax import memory, sharding
from pallas_kernels import tree as tree_lib
from kdtree_jax.cache import KVCache, check_capacity, compact, init_cache, write_rows
from kdtree_jax.config import DrafterConfig, ModelConfig
from kdtree_jax.drafter import Drafter, DrafterCache
from kdtree_jax.model.layers import dtype_of
from kdtree_jax.model.transformer import Transformer
from pallas_kernels import batch_invariant, ops

POLICIES = ("ar", "chain", "ddtree")


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static settings of one compiled decode loop."""

    policy: str = "ar"
    budget: int = 0  # B: non-root tree nodes (ddtree); chain uses L-1, ar 0
    block_size: int = 16  # L
    topk: int | None = None  # per-depth candidates (default min(B, V))
    temperature: float = 0.0
    max_new_tokens: int = 32
    eos_token_ids: tuple[int, ...] = ()  # a stream stops after emitting any of these
    rounds_per_check: int = 1  # rounds between checks of the stop condition (XLA:GPU reads it on the host)
    auto_budgets: tuple[int, ...] = ()  # ddtree: choose B per round among these (0 = AR round); () = fixed `budget`
    check_finite: bool = True  # stop at the first round whose target logits hold NaN / inf (Decoder.generate raises)
    exact: bool = False  # the target's batch-invariant forward: greedy chain / ddtree == ar bitwise in bf16 too
    device_loop: bool = False  # the loop's while and conditionals as CUDA graph nodes on the GPU (`loop_jit_options`):
    # no host round trip between rounds; the CPU ignores it

    @property
    def auto(self) -> bool:
        """Whether the loop chooses the budget per round (kdtree_jax.budget)."""
        return bool(self.auto_budgets)

    @property
    def depth(self) -> int:
        """D: deepest tree level (0 for ar)."""
        return 0 if self.policy == "ar" else self.block_size - 1

    @property
    def tree_budget(self) -> int:
        """B of the tree built each round (auto: the largest candidate, the most any round builds: the bound of the
        cache rows and memory checks)."""
        ddtree = max(self.auto_budgets) if self.auto else self.budget
        return {"ar": 0, "chain": self.depth, "ddtree": ddtree}[self.policy]

    @property
    def budget_label(self) -> int | str:
        """The budget as reports show it: B, or 'auto'."""
        return "auto" if self.auto else self.tree_budget

    @property
    def tree_topk(self) -> int | None:
        return 1 if self.policy == "chain" else self.topk

    def tree_rows(self) -> int:
        """Cache rows a round may touch past the committed length (verify writes B+1, compaction D+1)."""
        return max(self.tree_budget, self.depth) + 1


class LoopControls(NamedTuple):
    """Traced inputs of a compiled loop: other values run the same executable."""
    round_limit: jax.Array  # int32 []: stop after this many rounds (the loop also stops at max_new_tokens)
    step_costs: jax.Array  # [C] float32 seconds of a round at each of spec.auto_budgets (auto); [0] otherwise
    auto_start: budget_lib.BudgetState | None  # the budget chooser's state an auto loop starts from; None otherwise


class LoopState(NamedTuple):
    cache: KVCache
    dcache: DrafterCache | None
    bonus: jax.Array  # [S] the next round's root token (emitted, not yet in the cache)
    out: jax.Array  # [S, max_new + L] generated tokens
    num_out: jax.Array  # [S]
    done: jax.Array  # [S] bool
    taus: jax.Array  # [max_rounds, S] tokens emitted per round (0 once done)
    budgets: jax.Array  # [max_rounds] int32: B verified in each round (the nodes besides the root)
    rounds: jax.Array  # int32
    keys: jax.Array  # [S] one PRNG key per stream: a stream's samples do not depend on the other streams
    auto: budget_lib.BudgetState | None  # the budget chooser's state (auto), else None
    nonfinite: jax.Array  # [S] int32: where the stream's first non-finite target logits came (tokens out then), -1
    deferred: DeferredContext | None = None  # the auto loop's committed rows not yet in the drafter's context


class DeferredContext(NamedTuple):
    """The target's hidden rows (at the drafter's context layers) of tokens committed by the auto loop's AR rounds
    and not yet in the drafter's context: an AR round stores its row here instead of running the drafter's context
    projection, and the AR segment's end projects them all at once (`catch_up_context`). Without this an AR
    round of the auto loop cost 9-16% more than the AR loop's (decode.md, "Fourth GPU run")."""
    hidden: tuple  # per context layer [S, DEFERRED_ROWS, D]: row j holds position start[s] + j
    start: jax.Array  # [S] int32: the first position not in the drafter's context (<= the cache length)


STEP_COST_ROUNDS = 6  # rounds of each timed loop when step costs are calibrated (`Decoder.step_costs`)
DEFERRED_ROWS = 64  # AR rounds of the auto loop between two catch-ups of the drafter's context (the longest AR
# segment; PROBE_MAX_GAP rounds, so that a probe's wait is rarely cut)


class NonFiniteLogits(ValueError):
    """The target's logits held NaN or inf: the tokens picked from them would be meaningless."""


class GenerateResult(NamedTuple):
    tokens: list  # per stream, generated token ids (EOS included when hit)
    taus: np.ndarray  # [rounds, S]: tokens emitted per round, 0 when the stream was done
    rounds: int
    seconds: float  # wall time of prefill + loop (compilation and cost calibration excluded)
    budgets: np.ndarray  # [rounds]: B verified in each round
    costs: budget_lib.StepCosts | None  # the step costs the auto loop chose by (None for a fixed budget)
    handed_over: int | None = None  # an auto call that ran a fixed loop instead (`budget.Handover`): its B (0: AR)
    rounds_run: int = 0  # rounds the loop ran, those that emitted nothing after every stream finished included


def acceptance(taus, block_size: int) -> tuple[float, list]:
    """(mean tau, histogram of tau = 1..L) over the rounds in which a stream emitted tokens (taus [..., S])."""
    taus = np.asarray(taus)
    taus = taus[taus > 0]
    hist = np.bincount(taus, minlength=block_size + 1)[1:].tolist()
    return (float(taus.mean()) if taus.size else 0.0), hist


def agreeing_prefix(tokens, reference) -> float:
    """Mean fraction of each stream's tokens before the first difference from the reference (1.0 = identical).

    tokens, reference: per stream, lists of token ids."""
    fractions = []
    for got, want in zip(tokens, reference):
        n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        fractions.append(n / max(len(want), 1))
    return float(np.mean(fractions))


def check_spec(spec: DecodeSpec, cfg: ModelConfig, drafter_cfg: DrafterConfig | None, prompts, cache_len: int,
               mesh: jax.sharding.Mesh | None = None) -> None:
    """Everything Decoder.validate checks but memory, from the configs alone (no params): a script runs it before it
    loads any weight. Raises ValueError naming the problem and the fix."""
    if spec.policy not in POLICIES:
        raise ValueError(f"policy {spec.policy!r} is unknown; choose one of {POLICIES}")
    if spec.auto and spec.policy != "ddtree":
        raise ValueError(f"auto budgets are a ddtree setting; policy {spec.policy!r} has its own tree")
    if spec.policy != "ar":
        if drafter_cfg is None:
            raise ValueError(f"policy {spec.policy!r} needs a drafter; pass one or use policy 'ar'")
        if spec.block_size != drafter_cfg.block_size:
            raise ValueError(f"block_size={spec.block_size} differs from the drafter's "
                             f"{drafter_cfg.block_size}; use the drafter's block size")
        if spec.auto:
            budget_lib.check_candidates(spec.auto_budgets, lambda b: tree_lib.check_budget(
                b, spec.block_size, cfg.vocab_size))
        tree_lib.check_budget(spec.tree_budget, spec.block_size, cfg.vocab_size)
    if not (math.isfinite(spec.temperature) and spec.temperature >= 0):
        raise ValueError(f"temperature={spec.temperature} must be a finite number >= 0 (0 = greedy)")
    if spec.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={spec.max_new_tokens} must be >= 1")
    if spec.rounds_per_check < 1:
        raise ValueError(f"rounds_per_check={spec.rounds_per_check} must be >= 1")
    if spec.auto and spec.rounds_per_check != 1:
        raise ValueError(f"rounds_per_check={spec.rounds_per_check} is a fixed-budget setting: the auto loop decides "
                         f"the next round's budget after each round; use rounds_per_check=1 with auto budgets")
    outside = [e for e in spec.eos_token_ids if not 0 <= e < cfg.vocab_size]
    if outside:
        raise ValueError(f"eos_token_ids {outside} are not tokens of the model's vocabulary "
                         f"[0, {cfg.vocab_size}): decoding would never stop at them")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token; an empty prompt cannot be decoded")
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")
    if mesh is not None:
        sharding.check_streams(mesh, len(prompts))
    longest = max(len(p) for p in prompts)
    check_capacity(cache_len, longest + spec.max_new_tokens + spec.depth + spec.tree_rows(),
                   f"a prompt of {longest} tokens + {spec.max_new_tokens} new tokens + {spec.tree_rows()} "
                   f"tree rows")
    last = longest + spec.max_new_tokens + spec.depth
    if last > cfg.max_position_embeddings:
        raise ValueError(f"a prompt of {longest} tokens + {spec.max_new_tokens} new tokens + {spec.depth} drafted "
                         f"positions past the last (the drafter's depth) reaches position {last}, past the "
                         f"model's max_position_embeddings={cfg.max_position_embeddings}; shorten the prompt "
                         f"or max_new_tokens")


class Decoder:
    """Holds the target (and drafter) parameters and compiles one loop per DecodeSpec.

    mesh: a ("data", "tp") mesh (kdtree_jax.sharding): the target's params go into their shards, the drafter's onto
    every device, and the loop is compiled with explicit in/out shardings (streams split over data).
    """

    def __init__(self, target: Transformer, drafter: Drafter | None = None, mesh: jax.sharding.Mesh | None = None):
        if drafter is not None:
            drafter.cfg.check_fits(target.cfg)
        self.cfg = target.cfg
        self.target_def, self.target_params = nnx.split(target)
        self.drafter_def, self.drafter_params = nnx.split(drafter) if drafter is not None else (None, None)
        self.drafter_cfg = drafter.cfg if drafter is not None else None
        self.mesh = mesh
        if mesh is not None:
            self.target_params = sharding.shard_params(self.target_params, mesh)
            self.drafter_params = sharding.replicate(self.drafter_params, mesh)
        self._compiled = {}
        self._costs = {}  # (spec, streams, prompt length, cache rows) -> StepCosts calibrated by `step_costs`
        self._runs = {}  # the same keys -> [(rounds [C] at each candidate, seconds of those rounds)] since then
        self._handover = {}  # the same keys -> budget.Handover: whether a call runs a fixed loop instead
        self._warm = set()  # the keys of the fixed loops `generate` has compiled for a handover
        self._auto_state = {}  # the same keys -> the BudgetState the last auto call (costs calibrated here) ended with

    # ------------------------------------------------------------------------------------------- validation
    def validate(self, spec: DecodeSpec, prompts, cache_len: int) -> None:
        check_spec(spec, self.cfg, self.drafter_cfg, prompts, cache_len, self.mesh)
        self.check_memory(spec, len(prompts), max(len(p) for p in prompts), cache_len)

    def check_memory(self, spec: DecodeSpec, num_streams: int, prompt_len: int, cache_len: int) -> None:
        """Refuse, before compiling, a loop whose params, caches and largest array of one step cannot fit in the
        devices' memory (a lower bound, kdtree_jax.memory)."""
        s, n, v, nodes = num_streams, cache_len, self.cfg.vocab_size, spec.tree_budget + 1
        arrays = {f"verify logits [{s}, {nodes}, {v}] f32": s * nodes * v * 4,
                  f"tree mask [{s}, {nodes}, {nodes}]": s * nodes * nodes}
        if not ops.uses_kernel():  # the pure-JAX attention materialises its scores [S, T, H, N] in f32
            for what, t in (("prefill", prompt_len), ("verify", nodes)):
                arrays[f"{what} attention scores [{s}, {t}, {self.cfg.num_heads}, {n}] f32"] = \
                    s * t * self.cfg.num_heads * n * 4
        largest = max(arrays, key=arrays.get)
        caches = jax.eval_shape(functools.partial(self._make_caches, spec, s, cache_len))
        devices = list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()[:1]
        memory.check_fits({"params": memory.tree_bytes((self.target_params, self.drafter_params)),
                           "caches": memory.tree_bytes(caches), largest: arrays[largest]}, devices,
                          "lower the tree budget, the number of streams, the prompt length or max_new_tokens")

    @staticmethod
    def default_cache_len(spec: DecodeSpec, prompts) -> int:
        need = max(len(p) for p in prompts) + spec.max_new_tokens + spec.depth + spec.tree_rows()
        return -(-need // 64) * 64

    # ------------------------------------------------------------------------------------------- generation
    def generate(self, prompts, spec: DecodeSpec, seed: int = 0, cache_len: int | None = None,
                 costs: budget_lib.StepCosts | None = None) -> GenerateResult:
        """Decode a batch of prompts (lists of token ids, ragged) with one compiled loop. costs: the step costs an
        auto loop chooses by (default: `step_costs`, calibrated once per loop and batch shape, then refitted to
        every run of that loop: `budget.refit`; with them, a call after auto calls that verified one budget may run
        that budget's fixed loop instead: `budget.Handover`)."""
        given_len = cache_len
        cache_len = cache_len or self.default_cache_len(spec, prompts)
        self.validate(spec, prompts, cache_len)
        adapts = spec.auto and costs is None
        if spec.auto:
            costs = costs or self.step_costs(spec, prompts, cache_len)
            self.check_costs(spec, costs)
        key = self._cost_cache_key(spec, prompts, cache_len)
        handover = self._handover.setdefault(key, budget_lib.Handover()) if adapts else None
        fixed = handover.fixed_budget() if handover else None
        if fixed == 0 and handover.ar_pays is None:  # the first handover to AR: does the AR loop's round pay?
            handover.ar_pays = self._ar_loop_pays(spec, prompts, given_len, self._costs[key], seed)
            if not handover.ar_pays:
                handover.refuse_ar()
                fixed = None
        run_spec, run_len = spec, cache_len
        if fixed is not None:  # the fixed loop, with the cache rows it needs
            run_spec = fixed_loop_spec(spec, fixed)
            run_len = given_len or self.default_cache_len(run_spec, prompts)
        run = self._loop_runner(run_spec, prompts, run_len, seed)
        run_key = self._cost_cache_key(run_spec, prompts, run_len)
        if fixed is not None and run_key not in self._warm:
            run(self.controls(run_spec, round_limit=0))  # compile the fixed loop outside the timed call
            self._warm.add(run_key)
        carried = self._auto_state.get(key) if adapts and fixed is None else None
        if carried is not None and (handover.gap or handover.probe_next):  # after fixed calls, or after an AR call
            carried = carried._replace(ar_left=np.minimum(carried.ar_left, 1))  # not handed over: probe now
        state, seconds = run(self.controls(run_spec, costs, auto_start=carried))
        num_out, out = np.asarray(state.num_out), np.asarray(state.out)
        raise_nonfinite(np.asarray(state.nonfinite), np.array([len(p) for p in prompts]))
        budgets = np.asarray(state.budgets)[:int(state.rounds)]
        taus = np.asarray(state.taus)[:int(state.rounds)]
        emitted = (taus > 0).any(axis=1)  # not the rounds run after every stream finished (rounds_per_check > 1)
        if adapts and fixed is None:  # the next auto call of this loop starts where this one ended
            self._auto_state[key] = jax.tree.map(np.asarray, state.auto)
            self._observe(key, budgets, seconds)  # every round run took time
            handover.after_auto(budgets[emitted])
        return GenerateResult([out[i, :num_out[i]].tolist() for i in range(len(prompts))], taus[emitted],
                              int(emitted.sum()), seconds, budgets[emitted], costs if spec.auto else None, fixed,
                              int(state.rounds))

    def _ar_loop_pays(self, spec: DecodeSpec, prompts, given_len: int | None, calibrated: budget_lib.StepCosts,
                      seed: int) -> bool:
        """Whether a round of the plain AR loop on these prompts costs `budget.HANDOVER_AR_GAIN` less than the auto
        loop's AR round as calibrated (calibrated.seconds[0], before any refit: both timed alike, short forced loops
        after the prefill): the AR loop timed as `budget.calibrate` times a candidate (it compiles the loop a
        handover would run). Across processes, process 0's times decide."""
        ar_spec = fixed_loop_spec(spec, 0)
        ar_len = given_len or self.default_cache_len(ar_spec, prompts)
        run = self._loop_runner(ar_spec, prompts, ar_len, seed)

        def run_rounds(_, limit):
            state, seconds = run(self.controls(ar_spec, round_limit=limit))
            return seconds, int(state.rounds)
        ar_loop = budget_lib.calibrate(run_rounds, (0,), rounds=STEP_COST_ROUNDS, reps=3)
        self._warm.add(self._cost_cache_key(ar_spec, prompts, ar_len))
        loop_s, auto_s = process0_values((ar_loop.seconds[0], calibrated.seconds[0]))
        return bool(loop_s < (1.0 - budget_lib.HANDOVER_AR_GAIN) * auto_s)

    def _loop_runner(self, spec: DecodeSpec, prompts, cache_len: int, seed: int):
        """run(controls) -> (final LoopState, seconds of the loop call): the compiled loop on these prompts, with
        fresh caches each call (they are donated; made before the clock starts)."""
        s, longest = len(prompts), max(len(p) for p in prompts)
        tokens = np.zeros((s, longest), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        tokens, lengths = jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)
        loop = self.compiled_loop(spec, s, longest, cache_len)

        def run(controls: LoopControls):
            cache, dcache = self.new_caches(spec, s, cache_len)
            args = (self.target_params, self.drafter_params, cache, dcache, tokens, lengths, jax.random.key(seed))
            jax.block_until_ready(args)
            start = time.perf_counter()
            state = jax.block_until_ready(loop(*args, controls))
            return state, time.perf_counter() - start
        return run

    def controls(self, spec: DecodeSpec, costs=None, round_limit: int | None = None,
                 auto_start: budget_lib.BudgetState | None = None) -> LoopControls:
        """The loop's traced inputs: costs (StepCosts or [C] seconds; auto only), round_limit (default: no limit
        besides max_new_tokens), auto_start (auto only: the chooser's state to start from, e.g. where an earlier call
        ended; default: a fresh one, `budget.init_state`)."""
        if isinstance(costs, budget_lib.StepCosts):
            costs = costs.seconds
        costs = jnp.asarray(costs if spec.auto else (), jnp.float32)
        limit = spec.max_new_tokens if round_limit is None else round_limit
        if spec.auto and auto_start is None:
            auto_start = budget_lib.init_state(spec.auto_budgets, costs, spec.depth)
        return LoopControls(jnp.asarray(limit, jnp.int32), costs, auto_start if spec.auto else None)

    # ------------------------------------------------------------------------------------------- step costs
    def cost_key(self, spec: DecodeSpec, num_streams: int, cache_len: int) -> dict:
        """What step costs measured for this loop are valid for (budget.cost_key)."""
        c = self.cfg
        model = (f"{c.name} hidden={c.hidden_size} layers={c.num_layers} experts={c.num_experts} vocab={c.vocab_size}"
                 f" drafter_block={spec.block_size}")
        devices = list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()[:1]
        device = f"{len(devices)} x {devices[0].device_kind}"
        return budget_lib.cost_key(device, model, str(c.dtype), num_streams, cache_len, spec.temperature,
                                   spec.auto_budgets)

    def step_costs(self, spec: DecodeSpec, prompts, cache_len: int | None = None, rounds: int = STEP_COST_ROUNDS,
                   reps: int = 3) -> budget_lib.StepCosts:
        """The auto loop's step costs for this batch shape: `budget.calibrate` on these prompts with the compiled
        loop itself (once per loop and shape; ~ (C + 1) x (reps + 1) loops of `rounds` rounds), refitted to the runs
        of that loop `generate` made since (`budget.refit`). Across processes (jax.distributed), process 0's."""
        cache_len = cache_len or self.default_cache_len(spec, prompts)
        self.validate(spec, prompts, cache_len)
        s = len(prompts)
        key = self._cost_cache_key(spec, prompts, cache_len)
        if key not in self._costs:
            run = self._loop_runner(spec, prompts, cache_len, seed=0)

            def run_rounds(costs, limit):
                state, seconds = run(self.controls(spec, costs, limit))
                return seconds, int(state.rounds)
            costs = budget_lib.calibrate(run_rounds, spec.auto_budgets, rounds=rounds, reps=reps,
                                         key=self.cost_key(spec, s, cache_len))
            seconds = process0_values(costs.seconds + (costs.prefill_s,))  # every process must choose alike
            costs = dataclasses.replace(costs, seconds=tuple(float(t) for t in seconds[:-1]),
                                        prefill_s=float(seconds[-1]))
            self._costs[key] = costs
            self._runs[key] = []
        return budget_lib.refit(self._costs[key], self._runs[key])

    @staticmethod
    def _cost_cache_key(spec: DecodeSpec, prompts, cache_len: int) -> tuple:
        return spec, len(prompts), max(len(p) for p in prompts), cache_len

    def _observe(self, key: tuple, budgets, seconds: float) -> None:
        """Record a run of the auto loop calibrated under `key` (warm: `step_costs` ran it) for `budget.refit`: its
        rounds at each candidate (budgets [R]: the B of every round run) and their seconds (the call's, less the
        calibrated prefill). Across processes every process records process 0's seconds, so that all refit alike."""
        spec, costs = key[0], self._costs[key]
        rounds = budget_lib.rounds_by_candidate(budgets, spec.auto_budgets)
        seconds = float(process0_values((seconds,))[0])
        if rounds.sum() > 0 and seconds > costs.prefill_s:
            self._runs[key].append((rounds, seconds - costs.prefill_s))

    @staticmethod
    def check_costs(spec: DecodeSpec, costs: budget_lib.StepCosts) -> None:
        if tuple(costs.candidates) != spec.auto_budgets:
            raise ValueError(f"step costs for budgets {costs.candidates} given to a loop choosing among "
                             f"{spec.auto_budgets}; measure them for these budgets (Decoder.step_costs)")
        if not all(c > 0 for c in costs.seconds):  # NaN fails too; +inf is allowed (never chosen)
            raise ValueError(f"step costs {costs.seconds} must be positive seconds; measure them again "
                             f"(Decoder.step_costs)")

    def new_caches(self, spec: DecodeSpec, num_streams: int, cache_len: int):
        """Empty target and drafter caches; under a mesh made in place, split over data (never whole on one device)."""
        make = functools.partial(self._make_caches, spec, num_streams, cache_len)
        if self.mesh is None:
            return make()
        return jax.jit(make, out_shardings=sharding.stream_sharding(self.mesh))()

    def _make_caches(self, spec: DecodeSpec, num_streams: int, cache_len: int):
        cache = init_cache(self.cfg, num_streams, cache_len)
        dcache = (nnx.merge(self.drafter_def, self.drafter_params).init_cache(num_streams, cache_len)
                  if spec.policy != "ar" else None)
        return cache, dcache

    def compiled_loop(self, spec: DecodeSpec, num_streams: int, prompt_len: int, cache_len: int):
        """The jitted prefill + loop `generate` runs for this spec and shape (cached), called as
        fn(params, drafter_params, cache, dcache, tokens [S, prompt_len], lengths [S], key, controls) -> LoopState
        (controls: `Decoder.controls`); the caches (from `new_caches`) are donated."""
        spec = dataclasses.replace(spec, budget=spec.tree_budget, topk=spec.tree_topk)  # chain ignores the budget
        key = (spec, num_streams, prompt_len, cache_len)
        if key not in self._compiled:
            options = loop_jit_options(spec)
            if self.mesh is None:
                fn = jax.jit(functools.partial(self._run, spec), donate_argnums=(2, 3), **options)
            else:
                fn = sharding.under_mesh(self.mesh, jax.jit(functools.partial(self._run, spec), donate_argnums=(2, 3),
                                                            **self._loop_shardings(), **options))
            self._compiled[key] = fn
        return self._compiled[key]

    def _loop_shardings(self) -> dict:
        """in/out shardings of `_run`: params sharded (drafter replicated), per-stream arrays split over data."""
        rep, streams = sharding.replicated(self.mesh), sharding.stream_sharding(self.mesh)
        params = sharding.param_shardings(self.target_params, self.mesh)
        out = LoopState(cache=streams, dcache=streams, bonus=streams, out=streams, num_out=streams, done=streams,
                        taus=sharding.stream_sharding(self.mesh, axis=1), budgets=rep, rounds=rep, keys=streams,
                        auto=rep, nonfinite=streams, deferred=streams)
        return dict(in_shardings=(params, rep, streams, streams, streams, streams, rep, rep), out_shardings=out)

    # ------------------------------------------------------------------------------------------- on device
    def _run(self, spec: DecodeSpec, params, dparams, cache, dcache, tokens, lengths, key, controls: LoopControls):
        target = nnx.merge(self.target_def, params)
        drafter = nnx.merge(self.drafter_def, dparams) if spec.policy != "ar" else None
        state = prefill(target, drafter, spec, cache, dcache, tokens, lengths, key, controls)
        limit = jnp.minimum(controls.round_limit, spec.max_new_tokens)
        if spec.auto:
            state = state._replace(deferred=no_deferred_rows(state.cache.length, target, drafter))
            step = functools.partial(auto_segment, target, drafter, spec, limit, controls.step_costs)
        elif spec.rounds_per_check > 1:  # done streams are frozen, so extra rounds change nothing
            step = lambda st: jax.lax.fori_loop(0, spec.rounds_per_check,
                                                lambda _, s: decode_round(target, drafter, spec, s), st)
        else:
            step = functools.partial(decode_round, target, drafter, spec)
        return jax.lax.while_loop(functools.partial(running, spec, limit), step, state)


# XLA:GPU's command buffer types with the while loop and conditionals captured too (xla_gpu_enable_command_buffer;
# XLA's default set leaves WHILE and CONDITIONAL out, so the host reads a while loop's predicate after every iteration
# and launches the body again).
DEVICE_LOOP_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


def loop_jit_options(spec: DecodeSpec) -> dict:
    """jax.jit's keywords for the decode loop of `spec`: the exact mode's (`batch_invariant.jit_options`) and, with
    spec.device_loop, DEVICE_LOOP_COMMAND_BUFFERS, so that the whole loop runs as one CUDA graph without the host
    between rounds (experiments/notes/decode.md, "The loop's round trip per round")."""
    options = dict(batch_invariant.jit_options(spec.exact).get("compiler_options", {}))
    if spec.device_loop:
        options["xla_gpu_enable_command_buffer"] = DEVICE_LOOP_COMMAND_BUFFERS
    return dict(compiler_options=options) if options else {}


def fixed_loop_spec(spec: DecodeSpec, budget: int) -> DecodeSpec:
    """The fixed loop an auto spec's call is handed to (`budget.Handover`): ddtree at `budget`, or the AR loop at 0."""
    return dataclasses.replace(spec, auto_budgets=(), budget=budget, topk=spec.topk if budget else None,
                               policy="ddtree" if budget else "ar")


def process0_values(values) -> np.ndarray:
    """values (floats) as process 0 has them, on every process (jax.distributed: the processes of one SPMD program
    must make the same choices); the values themselves in one process."""
    if jax.process_count() == 1:
        return np.asarray(values, np.float64)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(values, np.float64)))


def running(spec: DecodeSpec, limit, st: LoopState):
    """The loop's predicate: rounds left (limit), a stream still going, and (check_finite) no stream gone
    non-finite."""
    going = (st.rounds < limit) & ~jnp.all(st.done)
    return going & jnp.all(st.nonfinite < 0) if spec.check_finite else going


def all_finite(logits, valid=None):
    """logits [S, T, V] -> [S] bool: every value of the stream's rows (those where valid, [S, T] or [S, 1], is true)
    finite. One isfinite reduction over logits the round has computed anyway."""
    finite = jnp.isfinite(logits).all(axis=-1)  # [S, T]
    if valid is not None:
        finite = finite | ~valid
    return finite.all(axis=1)


def first_nonfinite(nonfinite, finite, position):
    """nonfinite [S] updated with `position` [S] for each stream whose logits went non-finite (finite [S] false)
    for the first time."""
    return jnp.where((nonfinite < 0) & ~finite, position, nonfinite)


def raise_nonfinite(nonfinite: np.ndarray, prompt_lengths: np.ndarray) -> None:
    """Raise NonFiniteLogits naming each stream whose logits went non-finite (nonfinite >= 0) and where."""
    bad = np.flatnonzero(nonfinite >= 0)
    if not bad.size:
        return
    where = ", ".join(f"stream {s} at generated token {nonfinite[s]} (position {prompt_lengths[s] + nonfinite[s]})"
                      for s in bad[:8])
    raise NonFiniteLogits(f"the target's logits are not finite (NaN or inf) for {where}: the tokens picked from them "
                          f"would be meaningless; the weights or the activations overflow: check the checkpoint "
                          f"(it may be corrupt) or run in float32 (--dtype=float32)")


def pick_tokens(logits, temperature: float, keys, depth=None, levels: int = 0):
    """logits [S, T, V], keys [S] -> [S, T] int32 tokens: argmax at temperature 0, else one sample per position with
    the stream's own key, by the Gumbel-max trick: argmax(logits + T * g), g standard Gumbel noise [V].

    depth [S, T] (tree positions, each < `levels`, static; a node's depth is at most its index): positions at the
    same depth share their noise, so the noise drawn is [S, min(levels, T), V] instead of [S, T, V] (fewer random
    bits where the tree has more nodes than depths). Exact for the accept walk: it visits one node per depth, and
    the node it visits at depth d is fixed by the samples at depths < d, so each sample it uses is independent of
    every sample before it, as with noise per node. None: every position its own noise."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    s, t, v = logits.shape
    shared = depth is not None and levels < t
    rows = levels if shared else t
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (rows, v), jnp.float32))(keys)  # [S, rows, V]
    if shared:
        noise = jax.vmap(lambda n, d: n[d])(noise, depth)  # [S, T, V]
    return jnp.argmax(logits.astype(jnp.float32) + temperature * noise, axis=-1).astype(jnp.int32)


def split_each(keys):
    """keys [S] -> (next keys [S], keys to use now [S])."""
    pairs = jax.vmap(jax.random.split)(keys)
    return pairs[:, 0], pairs[:, 1]


def prefill(target: Transformer, drafter: Drafter | None, spec: DecodeSpec, cache: KVCache, dcache, tokens,
            lengths, key, controls: LoopControls | None = None) -> LoopState:
    """Run the ragged prompts (tokens [S, P] right-padded, lengths [S]) and emit each stream's first token.
    controls: the loop's traced inputs (auto: its step costs and the chooser's starting state)."""
    s, p = tokens.shape
    causal = jnp.tril(jnp.ones((p, p), bool))
    valid = jnp.arange(p)[None, :] < lengths[:, None]
    visible = (causal[None] & valid[:, None, :]) | jnp.eye(p, dtype=bool)[None]  # padding rows see themselves
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (s, p))
    layer_ids = drafter.cfg.target_layer_ids if drafter is not None else ()
    fwd = target(tokens, positions, cache, visible, hidden_layers=layer_ids, exact=spec.exact)
    keys, sub = split_each(jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(s)))
    last = jnp.take_along_axis(fwd.logits, (lengths - 1)[:, None, None], axis=1)  # [S, 1, V]
    first = pick_tokens(last, spec.temperature, sub)[:, 0]
    cache = fwd.cache._replace(length=lengths)
    if drafter is not None:
        dcache = drafter.extend_cache(dcache, fwd.hidden, positions, jnp.zeros_like(lengths))
    out = jnp.zeros((s, spec.max_new_tokens + spec.block_size), jnp.int32).at[:, 0].set(first)
    num_out = jnp.ones((s,), jnp.int32)
    done = (num_out >= spec.max_new_tokens) | _is_eos(first, spec)
    max_rounds = spec.max_new_tokens + spec.rounds_per_check - 1  # at most max_new - 1 rounds emit tokens
    if spec.auto and (controls is None or controls.auto_start is None):
        raise ValueError("an auto loop's prefill needs its controls with a starting chooser state "
                         "(Decoder.controls(spec, costs))")
    auto = controls.auto_start if spec.auto else None
    nonfinite = jnp.full((s,), -1, jnp.int32)
    if spec.check_finite:
        nonfinite = first_nonfinite(nonfinite, all_finite(fwd.logits, valid), jnp.zeros((s,), jnp.int32))
    return LoopState(cache, dcache, first, out, num_out, done, jnp.zeros((max_rounds, s), jnp.int32),
                     jnp.zeros((max_rounds,), jnp.int32), jnp.zeros((), jnp.int32), keys, auto, nonfinite)


def _is_eos(tokens, spec: DecodeSpec):
    """[...] bool: whether each token is one the streams stop at (any of spec.eos_token_ids)."""
    if not spec.eos_token_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(spec.eos_token_ids, tokens.dtype))


def root_only_tree(root) -> tree_lib.TreeArrays:
    """The ar 'tree': just the bonus token."""
    s = root.shape[0]
    minus = jnp.full((s, 1), -1, jnp.int32)
    return tree_lib.TreeArrays(root[:, None].astype(jnp.int32), minus, jnp.zeros((s, 1), jnp.int32), minus, minus,
                               jnp.ones((s, 1, 1), bool), jnp.ones((s,), jnp.int32), jnp.zeros((s, 1), jnp.float32))


def draft_tree(target: Transformer, drafter: Drafter, spec: DecodeSpec, st: LoopState,
               budget: int | None = None) -> tree_lib.TreeArrays:
    """Draft after each stream's bonus token and build the best-first tree of `budget` (default spec.tree_budget)
    nodes."""
    length = st.cache.length
    draft = drafter.draft(target.embed, target.logits, st.bonus, length, st.dcache, length)
    return ops.tree_build(draft, st.bonus, spec.tree_budget if budget is None else budget, spec.tree_topk)


def verify_and_commit(target: Transformer, drafter: Drafter | None, spec: DecodeSpec, st: LoopState,
                      tree: tree_lib.TreeArrays, keys, extend_context: bool = True):
    """Verify the tree (one target forward over its B+1 nodes), walk it (`walk_tree`), compact the accepted KV and
    extend the drafter context with the root and the accepted nodes (min(B, D) + 1 rows: an AR round writes one)
    -> (cache, dcache, verdict with its path padded to D+1, finite [S]: the logits all finite (check_finite; else
    true), hidden: the forward's rows at the drafter's context layers, per layer [S, B+1, D] (() without a
    drafter)). extend_context=False leaves the drafter's context as it was (the caller keeps the rows: `defer_row`)."""
    length = st.cache.length
    layer_ids = drafter.cfg.target_layer_ids if drafter is not None else ()
    fwd = target(tree.tokens, length[:, None] + tree.depth, st.cache, tree.visible, hidden_layers=layer_ids,
                 exact=spec.exact)
    verdict = walk_tree(spec, tree, fwd.logits, keys)
    cache, dcache = commit_kv(drafter if extend_context else None, fwd.cache, st.dcache, fwd.hidden, verdict,
                              ~st.done)
    path = jnp.pad(verdict.path, ((0, 0), (0, spec.depth + 1 - verdict.path.shape[1])), constant_values=-1)
    finite = all_finite(fwd.logits) if spec.check_finite else jnp.ones(length.shape, bool)
    return cache, dcache, verdict._replace(path=path), finite, fwd.hidden


def walk_tree(spec: DecodeSpec, tree: tree_lib.TreeArrays, logits, keys) -> tree_lib.AcceptResult:
    """The accept walk along the target's tokens at the nodes (logits [S, B+1, V]: argmax, or samples with keys [S]),
    for at most min(B, D) steps (a walk takes one step per non-root node at most): path [S, min(B, D) + 1]."""
    picked = pick_tokens(logits, spec.temperature, keys, tree.depth, spec.depth + 1)
    return ops.tree_accept(tree, picked, min(tree.tokens.shape[1] - 1, spec.depth))


def decode_round(target: Transformer, drafter: Drafter | None, spec: DecodeSpec, st: LoopState) -> LoopState:
    """One draft -> build -> verify -> accept -> commit round for every stream (finished streams are frozen), at the
    fixed budget (the auto loop runs `auto_segment`)."""
    keys, sub = split_each(st.keys)
    tree = root_only_tree(st.bonus) if drafter is None else draft_tree(target, drafter, spec, st)
    cache, dcache, verdict, finite, _ = verify_and_commit(target, drafter, spec, st, tree, sub)
    return finish_round(spec, st, tree.tokens, verdict, cache, dcache, keys, spec.tree_budget, st.auto, finite)


def auto_segment(target: Transformer, drafter: Drafter, spec: DecodeSpec, limit, step_costs,
                 st: LoopState) -> LoopState:
    """A step of the auto loop (kdtree_jax.budget): the segment of the budget st.auto.next_index names, an inner
    while loop of rounds at that B (`ar_round` for B = 0, else `drafted_round`) for as long as each round plans the
    same B for the next (and the loop is `running`; an AR segment also ends after DEFERRED_ROWS rounds). An AR
    segment ends by catching the drafter's context up with the rows its rounds deferred (`catch_up_context`), so
    every segment starts with the context whole and a drafted one needs no catch-up. One
    `lax.switch` a segment: on XLA:GPU every conditional is a host read of its predicate, and rounds that passed two
    a round cost 12-30% more than the fixed loop's (decode.md, "Third GPU run"). step_costs: [C] seconds of a round
    at each candidate."""
    def segment(index, st):
        b = spec.auto_budgets[index]
        same = lambda s: running(spec, limit, s) & (s.auto.next_index == index)  # noqa: E731
        if b > 0:
            drafted = functools.partial(drafted_round, budget=b)
            return jax.lax.while_loop(same, lambda s: drafted(target, drafter, spec, s, step_costs), st)
        room = lambda s: same(s) & (jnp.max(s.cache.length - s.deferred.start) < DEFERRED_ROWS)  # noqa: E731
        st = jax.lax.while_loop(room, lambda s: ar_round(target, drafter, spec, s, step_costs), st)
        return catch_up_context(drafter, st)
    branches = [functools.partial(segment, i) for i in range(len(spec.auto_budgets))]
    return jax.lax.switch(st.auto.next_index, branches, st)


def no_deferred_rows(length, target: Transformer, drafter: Drafter) -> DeferredContext:
    """An empty `DeferredContext` for streams whose drafter context holds every row < length [S]."""
    rows = (length.shape[0], DEFERRED_ROWS, target.cfg.hidden_size)
    dtype = dtype_of(target.cfg.dtype)
    return DeferredContext(tuple(jnp.zeros(rows, dtype) for _ in drafter.cfg.target_layer_ids), length)


def defer_row(deferred: DeferredContext, hidden, length) -> DeferredContext:
    """Keep an AR round's rows (hidden: per context layer [S, 1, D], committed at position length [S]) for the next
    catch-up. The loop guarantees length - start < DEFERRED_ROWS (an AR segment ends before)."""
    for d, h in zip(deferred.hidden, hidden):
        if d.dtype != h.dtype:
            raise TypeError(f"defer_row: the target's hidden rows are {h.dtype}, the deferred buffer {d.dtype}: "
                            f"`no_deferred_rows` must allocate it in the target's activation dtype")
    return deferred._replace(hidden=tuple(write_rows(d, h[:, :1], length - deferred.start)
                                          for d, h in zip(deferred.hidden, hidden)))


def catch_up_context(drafter: Drafter, st: LoopState) -> LoopState:
    """The drafter's context extended over the deferred rows (positions start .. length - 1 of each stream, one
    batched projection), and nothing deferred after."""
    d = st.deferred
    positions = d.start[:, None] + jnp.arange(DEFERRED_ROWS)[None, :]
    dcache = drafter.extend_cache(st.dcache, d.hidden, positions, d.start, count=st.cache.length - d.start)
    return st._replace(dcache=dcache, deferred=d._replace(start=st.cache.length))


def drafted_round(target: Transformer, drafter: Drafter, spec: DecodeSpec, st: LoopState, step_costs,
                  budget: int) -> LoopState:
    """Draft and build the tree of the next candidate above `budget` (the smallest that tells whether a larger B
    pays; `budget` itself at the largest), verify its first `budget` + 1 nodes; fold the outcome into the
    calibration, then plan the next round from what each budget accepted and the drafter's expected gain above
    (`budget.plan_after_draft`; this round's outcome may inform the next round's B, never its own). Candidates above
    the built tree look no better than it this round, so the loop climbs one candidate at a time. The drafter's
    context holds every committed row (an AR segment catches it up at its end); the round extends it itself."""
    keys, sub = split_each(st.keys)
    tree = draft_tree(target, drafter, spec, st, budget_lib.build_budget(spec.auto_budgets, budget))
    cache, dcache, verdict, finite, _ = verify_and_commit(target, drafter, spec, st,
                                                          tree_lib.prefix_tree(tree, budget), sub)
    auto = budget_lib.after_drafted_round(st.auto, tree.score, verdict.path, budget, spec.auto_budgets, step_costs,
                                          spec.depth, ~st.done)
    st = st._replace(deferred=st.deferred._replace(start=cache.length))
    return finish_round(spec, st, tree.tokens, verdict, cache, dcache, keys, budget, auto, finite)


def ar_round(target: Transformer, drafter: Drafter, spec: DecodeSpec, st: LoopState, step_costs) -> LoopState:
    """An AR round of the auto loop: the root alone verified, its row at the drafter's context layers deferred
    (`defer_row`: its segment's end projects it), and the count down to the next probe."""
    keys, sub = split_each(st.keys)
    tree = root_only_tree(st.bonus)
    cache, dcache, verdict, finite, hidden = verify_and_commit(target, drafter, spec, st, tree, sub,
                                                               extend_context=False)
    st = st._replace(deferred=defer_row(st.deferred, hidden, st.cache.length))
    auto = budget_lib.plan_after_ar(st.auto, spec.auto_budgets, step_costs, spec.depth)
    return finish_round(spec, st, tree.tokens, verdict, cache, dcache, keys, 0, auto, finite)


def finish_round(spec: DecodeSpec, st: LoopState, tree_tokens, verdict, cache, dcache, keys, budget,
                 auto, finite) -> LoopState:
    """The round's bookkeeping: emit the accepted draft tokens (tree_tokens [S, N], N >= the path's nodes) and the
    new bonus, cut at EOS and at max_new_tokens; record tau, the budget verified (B, int or int32 []) and where a
    stream's logits first went non-finite (finite [S])."""
    depth = spec.depth
    accepted = jnp.take_along_axis(tree_tokens, jnp.maximum(verdict.path[:, 1:], 0), axis=1)  # [S, D]
    slots = jnp.arange(depth + 1)[None, :]
    emitted = jnp.where(slots == verdict.num_accepted[:, None], verdict.next_token[:, None],
                        jnp.pad(accepted, ((0, 0), (0, 1))))
    count = verdict.num_accepted + 1
    eos_at = jnp.where(_is_eos(emitted, spec) & (slots < count[:, None]), slots, depth + 1).min(axis=1)
    hit_eos = eos_at <= depth
    count = jnp.minimum(jnp.where(hit_eos, eos_at + 1, count), spec.max_new_tokens - st.num_out)
    active = ~st.done
    count = jnp.where(active, count, 0)
    out = jax.vmap(lambda o, e, n: jax.lax.dynamic_update_slice(o, e, (n,)))(st.out, emitted, st.num_out)
    out = jnp.where(active[:, None], out, st.out)
    num_out = st.num_out + count
    done = st.done | hit_eos | (num_out >= spec.max_new_tokens)
    nonfinite = first_nonfinite(st.nonfinite, finite | ~active, st.num_out)
    return LoopState(cache, dcache, jnp.where(active, verdict.next_token, st.bonus), out, num_out, done,
                     st.taus.at[st.rounds].set(count), st.budgets.at[st.rounds].set(budget), st.rounds + 1, keys,
                     auto, nonfinite, st.deferred)


def commit_kv(drafter: Drafter | None, cache: KVCache, dcache, hidden, verdict, active):
    """Compact the accepted tree rows of the target cache and extend the drafter context with the root and accepted
    nodes' hidden states (hidden: per target layer [S, B+1, D]; verdict.path [S, P]: P rows written). Returns
    (cache, dcache)."""
    length = cache.length
    new_cache = compact(cache, verdict.path, verdict.num_accepted, active)
    if drafter is None:
        return new_cache, dcache
    path = jnp.maximum(verdict.path, 0)
    hidden = tuple(jnp.take_along_axis(h, path[:, :, None], axis=1) for h in hidden)  # [S, P, D_model]
    positions = length[:, None] + jnp.arange(path.shape[1])[None, :]
    return new_cache, drafter.extend_cache(dcache, hidden, positions, length)


def budget_counts(budgets) -> dict:
    """{B: rounds} of the budgets verified per round (any shape), by increasing B."""
    values, counts = np.unique(np.asarray(budgets).ravel(), return_counts=True)
    return {int(b): int(n) for b, n in zip(values, counts)}


def decode_in_batches(decoder: Decoder, prompts, spec: DecodeSpec, batch: int, seed: int) -> dict:
    """Decode all prompts, `batch` streams at a time (first, one batch of each shape once more, to compile and warm
    up, and for auto to calibrate the step costs; batch k samples with seed + k) -> totals, tau statistics, the
    budgets verified (`budget_hist` {B: batch rounds}; `budget_rounds`: per round of the first batch), for auto the
    batches that ran a fixed loop instead (`handed_over` {B: batches}), and the outputs (`tokens`, per prompt)."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    shapes = {(len(g), max(len(p) for p in g)): g for g in reversed(groups)}  # a ragged last batch compiles apart
    start = time.perf_counter()
    for group in shapes.values():
        decoder.generate(group, spec, seed=seed)  # compile + warm up (+ calibrate)
    setup_s = time.perf_counter() - start
    seconds, tokens, taus, budgets, first, handed = 0.0, [], [], [], None, []
    for k, group in enumerate(groups):
        res = decoder.generate(group, spec, seed=seed + k)
        if res.handed_over is not None:
            handed.append(res.handed_over)
        seconds += res.seconds
        tokens += res.tokens
        taus.append(res.taus.ravel())
        budgets.append(res.budgets)
        first = res if k == 0 else first
    tau, hist = acceptance(np.concatenate(taus), spec.block_size)
    new = sum(len(t) for t in tokens)
    row = {"policy": spec.policy, "budget": spec.budget_label, "seconds": seconds, "new_tokens": new,
           "tokens_per_s": new / seconds, "tau": tau, "rounds": sum(hist), "accept_hist": hist,
           "budget_hist": budget_counts(np.concatenate(budgets)), "setup_s": setup_s, "tokens": tokens}
    if spec.auto:
        row.update(budget_rounds=first.budgets.tolist(), costs=first.costs.as_dict(), costs_last=res.costs.as_dict(),
                   handed_over=budget_counts(handed) if handed else {})
    return row
