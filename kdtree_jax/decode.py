"""Prefill and the jitted round loop: autoregressive (ar), DFlash chain (chain) and DDTree (ddtree) decoding.

Every policy runs the same round, all on device inside one `lax.while_loop` (no host round trip per round):
  draft  -> the drafter's L-1 per-position logits after the bonus token        (skipped by ar)
  build  -> a draft tree of B+1 nodes: ar B=0; chain top-1 per depth, B=L-1; ddtree best-first top-B prefixes
  verify -> one target forward over the B+1 nodes at positions length + depth (tree KV -> rows length..length+B)
  accept -> walk the tree along the target's own tokens (argmax, or a sample per node at T > 0)
  commit -> compact the accepted KV rows, extend the drafter context, emit accepted tokens + the new bonus
Greedy output is identical for all three policies (the losslessness invariant the tests check).
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

from kdtree_jax import memory, sharding
from pallas_kernels import tree as tree_lib
from kdtree_jax.cache import KVCache, check_capacity, compact, init_cache
from kdtree_jax.config import DrafterConfig, ModelConfig
from kdtree_jax.drafter import Drafter, DrafterCache
from kdtree_jax.model.transformer import Transformer
from pallas_kernels import ops

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
    eos_token_id: int | None = None
    rounds_per_check: int = 1  # rounds between checks of the stop condition (XLA:GPU reads it on the host)
    check_finite: bool = True  # stop at the first round whose target logits hold NaN / inf (Decoder.generate raises)

    @property
    def depth(self) -> int:
        """D: deepest tree level (0 for ar)."""
        return 0 if self.policy == "ar" else self.block_size - 1

    @property
    def tree_budget(self) -> int:
        return {"ar": 0, "chain": self.depth, "ddtree": self.budget}[self.policy]

    @property
    def tree_topk(self) -> int | None:
        return 1 if self.policy == "chain" else self.topk

    def tree_rows(self) -> int:
        """Cache rows a round may touch past the committed length (verify writes B+1, compaction D+1)."""
        return max(self.tree_budget, self.depth) + 1


class LoopState(NamedTuple):
    cache: KVCache
    dcache: DrafterCache | None
    bonus: jax.Array  # [S] the next round's root token (emitted, not yet in the cache)
    out: jax.Array  # [S, max_new + L] generated tokens
    num_out: jax.Array  # [S]
    done: jax.Array  # [S] bool
    taus: jax.Array  # [max_rounds, S] tokens emitted per round (0 once done)
    rounds: jax.Array  # int32
    keys: jax.Array  # [S] one PRNG key per stream: a stream's samples do not depend on the other streams
    nonfinite: jax.Array  # [S] int32: where the stream's first non-finite target logits came (tokens out then), -1


class NonFiniteLogits(ValueError):
    """The target's logits held NaN or inf: the tokens picked from them would be meaningless."""


class GenerateResult(NamedTuple):
    tokens: list  # per stream, generated token ids (EOS included when hit)
    taus: np.ndarray  # [rounds, S]: tokens emitted per round, 0 when the stream was done
    rounds: int
    seconds: float  # wall time of prefill + loop (compilation excluded)


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
    if spec.policy != "ar":
        if drafter_cfg is None:
            raise ValueError(f"policy {spec.policy!r} needs a drafter; pass one or use policy 'ar'")
        if spec.block_size != drafter_cfg.block_size:
            raise ValueError(f"block_size={spec.block_size} differs from the drafter's "
                             f"{drafter_cfg.block_size}; use the drafter's block size")
        tree_lib.check_budget(spec.tree_budget, spec.block_size, cfg.vocab_size)
    if not (math.isfinite(spec.temperature) and spec.temperature >= 0):
        raise ValueError(f"temperature={spec.temperature} must be a finite number >= 0 (0 = greedy)")
    if spec.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={spec.max_new_tokens} must be >= 1")
    if spec.rounds_per_check < 1:
        raise ValueError(f"rounds_per_check={spec.rounds_per_check} must be >= 1")
    if spec.eos_token_id is not None and not 0 <= spec.eos_token_id < cfg.vocab_size:
        raise ValueError(f"eos_token_id={spec.eos_token_id} is not a token of the model's vocabulary "
                         f"[0, {cfg.vocab_size}): decoding would never stop at it")
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
    def generate(self, prompts, spec: DecodeSpec, seed: int = 0, cache_len: int | None = None) -> GenerateResult:
        """Decode a batch of prompts (lists of token ids, ragged) with one compiled loop."""
        cache_len = cache_len or self.default_cache_len(spec, prompts)
        self.validate(spec, prompts, cache_len)
        s, longest = len(prompts), max(len(p) for p in prompts)
        tokens = np.zeros((s, longest), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        lengths = np.array([len(p) for p in prompts], np.int32)
        run = self.compiled_loop(spec, s, longest, cache_len)
        cache, dcache = self.new_caches(spec, s, cache_len)
        args = (self.target_params, self.drafter_params, cache, dcache, jnp.asarray(tokens), jnp.asarray(lengths),
                jax.random.key(seed))
        start = time.perf_counter()
        state = jax.block_until_ready(run(*args))
        seconds = time.perf_counter() - start
        num_out, out = np.asarray(state.num_out), np.asarray(state.out)
        raise_nonfinite(np.asarray(state.nonfinite), lengths)
        taus = np.asarray(state.taus)[:int(state.rounds)]
        taus = taus[(taus > 0).any(axis=1)]  # rounds run after every stream finished (rounds_per_check > 1) emit nothing
        return GenerateResult([out[i, :num_out[i]].tolist() for i in range(s)], taus, len(taus), seconds)

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
        fn(params, drafter_params, cache, dcache, tokens [S, prompt_len], lengths [S], key) -> LoopState; the caches
        (from `new_caches`) are donated."""
        spec = dataclasses.replace(spec, budget=spec.tree_budget, topk=spec.tree_topk)  # chain ignores the budget
        key = (spec, num_streams, prompt_len, cache_len)
        if key not in self._compiled:
            if self.mesh is None:
                fn = jax.jit(functools.partial(self._run, spec), donate_argnums=(2, 3))
            else:
                fn = sharding.under_mesh(self.mesh, jax.jit(functools.partial(self._run, spec), donate_argnums=(2, 3),
                                                            **self._loop_shardings()))
            self._compiled[key] = fn
        return self._compiled[key]

    def _loop_shardings(self) -> dict:
        """in/out shardings of `_run`: params sharded (drafter replicated), per-stream arrays split over data."""
        rep, streams = sharding.replicated(self.mesh), sharding.stream_sharding(self.mesh)
        params = sharding.param_shardings(self.target_params, self.mesh)
        out = LoopState(cache=streams, dcache=streams, bonus=streams, out=streams, num_out=streams, done=streams,
                        taus=sharding.stream_sharding(self.mesh, axis=1), rounds=rep, keys=streams,
                        nonfinite=streams)
        return dict(in_shardings=(params, rep, streams, streams, streams, streams, rep), out_shardings=out)

    # ------------------------------------------------------------------------------------------- on device
    def _run(self, spec: DecodeSpec, params, dparams, cache, dcache, tokens, lengths, key):
        target = nnx.merge(self.target_def, params)
        drafter = nnx.merge(self.drafter_def, dparams) if spec.policy != "ar" else None
        state = prefill(target, drafter, spec, cache, dcache, tokens, lengths, key)
        one_round = functools.partial(decode_round, target, drafter, spec)
        if spec.rounds_per_check > 1:  # done streams are frozen, so extra rounds change nothing
            rounds = lambda st: jax.lax.fori_loop(0, spec.rounds_per_check, lambda _, s: one_round(s), st)
        else:
            rounds = one_round
        return jax.lax.while_loop(functools.partial(running, spec), rounds, state)


def running(spec: DecodeSpec, st: LoopState):
    """The loop's predicate: rounds left, a stream still going, and (check_finite) no stream gone non-finite."""
    going = (st.rounds < spec.max_new_tokens) & ~jnp.all(st.done)
    return going & jnp.all(st.nonfinite < 0) if spec.check_finite else going


def first_nonfinite(nonfinite, logits, position, valid=None):
    """nonfinite [S] updated with `position` [S] for each stream whose logits [S, T, V] (the rows where valid, [S, T]
    or [S, 1], is true) hold NaN or inf for the first time; one isfinite reduction over logits the round has computed
    anyway."""
    finite = jnp.isfinite(logits).all(axis=-1)  # [S, T]
    if valid is not None:
        finite = finite | ~valid
    return jnp.where((nonfinite < 0) & ~finite.all(axis=1), position, nonfinite)


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


def pick_tokens(logits, temperature: float, keys):
    """logits [S, T, V], keys [S] -> [S, T] tokens: argmax at temperature 0, else one independent sample per position
    drawn with the stream's own key."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sample = lambda k, l: jax.random.categorical(k, l / temperature, axis=-1)
    return jax.vmap(sample)(keys, logits).astype(jnp.int32)


def split_each(keys):
    """keys [S] -> (next keys [S], keys to use now [S])."""
    pairs = jax.vmap(jax.random.split)(keys)
    return pairs[:, 0], pairs[:, 1]


def prefill(target: Transformer, drafter: Drafter | None, spec: DecodeSpec, cache: KVCache, dcache, tokens,
            lengths, key) -> LoopState:
    """Run the ragged prompts (tokens [S, P] right-padded, lengths [S]) and emit each stream's first token."""
    s, p = tokens.shape
    causal = jnp.tril(jnp.ones((p, p), bool))
    valid = jnp.arange(p)[None, :] < lengths[:, None]
    visible = (causal[None] & valid[:, None, :]) | jnp.eye(p, dtype=bool)[None]  # padding rows see themselves
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (s, p))
    layer_ids = drafter.cfg.target_layer_ids if drafter is not None else ()
    fwd = target(tokens, positions, cache, visible, hidden_layers=layer_ids)
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
    nonfinite = jnp.full((s,), -1, jnp.int32)
    if spec.check_finite:
        nonfinite = first_nonfinite(nonfinite, fwd.logits, jnp.zeros((s,), jnp.int32), valid)
    return LoopState(cache, dcache, first, out, num_out, done, jnp.zeros((max_rounds, s), jnp.int32),
                     jnp.zeros((), jnp.int32), keys, nonfinite)


def _is_eos(tokens, spec: DecodeSpec):
    if spec.eos_token_id is None:
        return jnp.zeros(tokens.shape, bool)
    return tokens == spec.eos_token_id


def root_only_tree(root) -> tree_lib.TreeArrays:
    """The ar 'tree': just the bonus token."""
    s = root.shape[0]
    minus = jnp.full((s, 1), -1, jnp.int32)
    return tree_lib.TreeArrays(root[:, None].astype(jnp.int32), minus, jnp.zeros((s, 1), jnp.int32), minus, minus,
                               jnp.ones((s, 1, 1), bool), jnp.ones((s,), jnp.int32), jnp.zeros((s, 1), jnp.float32))


def decode_round(target: Transformer, drafter: Drafter | None, spec: DecodeSpec, st: LoopState) -> LoopState:
    """One draft -> build -> verify -> accept -> commit round for every stream (finished streams are frozen)."""
    length = st.cache.length
    if drafter is None:
        tree = root_only_tree(st.bonus)
    else:
        draft = drafter.draft(target.embed, target.logits, st.bonus, length, st.dcache, length)
        tree = ops.tree_build(draft, st.bonus, spec.tree_budget, spec.tree_topk)
    layer_ids = drafter.cfg.target_layer_ids if drafter is not None else ()
    fwd = target(tree.tokens, length[:, None] + tree.depth, st.cache, tree.visible, hidden_layers=layer_ids)
    keys, sub = split_each(st.keys)
    verdict = ops.tree_accept(tree, pick_tokens(fwd.logits, spec.temperature, sub), spec.depth)

    # Emitted this round: the accepted draft tokens, then the new bonus; cut at EOS and at max_new_tokens.
    depth = spec.depth
    accepted = jnp.take_along_axis(tree.tokens, jnp.maximum(verdict.path[:, 1:], 0), axis=1)  # [S, D]
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

    nonfinite = st.nonfinite
    if spec.check_finite:
        nonfinite = first_nonfinite(nonfinite, fwd.logits, st.num_out, valid=active[:, None])
    cache, dcache = commit_kv(drafter, fwd.cache, st.dcache, fwd.hidden, verdict, active)
    return LoopState(cache, dcache, jnp.where(active, verdict.next_token, st.bonus), out, num_out, done,
                     st.taus.at[st.rounds].set(count), st.rounds + 1, keys, nonfinite)


def commit_kv(drafter: Drafter | None, cache: KVCache, dcache, hidden, verdict, active):
    """Compact the accepted tree rows of the target cache and extend the drafter context with the root and accepted
    nodes' hidden states (hidden: per target layer [S, B+1, D]). Returns (cache, dcache)."""
    length = cache.length
    new_cache = compact(cache, verdict.path, verdict.num_accepted, active)
    if drafter is None:
        return new_cache, dcache
    path = jnp.maximum(verdict.path, 0)
    hidden = tuple(jnp.take_along_axis(h, path[:, :, None], axis=1) for h in hidden)  # [S, D+1, D_model]
    positions = length[:, None] + jnp.arange(path.shape[1])[None, :]
    return new_cache, drafter.extend_cache(dcache, hidden, positions, length)


def decode_in_batches(decoder: Decoder, prompts, spec: DecodeSpec, batch: int, seed: int) -> dict:
    """Decode all prompts, `batch` streams at a time (the first batch once more first, to compile and warm up; batch
    k samples with seed + k) -> totals, tau statistics and the outputs (`tokens`, per prompt)."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    decoder.generate(groups[0], spec, seed=seed)  # compile + warm up
    seconds, tokens, taus = 0.0, [], []
    for k, group in enumerate(groups):
        res = decoder.generate(group, spec, seed=seed + k)
        seconds += res.seconds
        tokens += res.tokens
        taus.append(res.taus.ravel())
    tau, hist = acceptance(np.concatenate(taus), spec.block_size)
    new = sum(len(t) for t in tokens)
    return {"policy": spec.policy, "budget": spec.tree_budget, "seconds": seconds, "new_tokens": new,
            "tokens_per_s": new / seconds, "tau": tau, "rounds": sum(hist), "accept_hist": hist,
            "tokens": tokens}
