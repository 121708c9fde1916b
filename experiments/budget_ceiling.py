"""The ceiling of choosing the tree budget each round (`--budget=auto`, issue 51): what any per-round choice of B
could gain over the best fixed budget, on the round costs a device measured.

    PYTHONPATH=. python3 experiments/budget_ceiling.py        # shipped code target + drafter, f32 on this machine,
        # against the H200's round costs of experiments/results/decode/decode.json
    PYTHONPATH=. python3 experiments/budget_ceiling.py --num_prompts=2 --max_new_tokens=24 --out=/tmp/c.json \\
        --plot=                                                # a smoke run

Greedy decoding is deterministic, so a round that starts after the AR output's first q + 1 tokens (the prompt and q
tokens committed, AR's token q the bonus) has one outcome whatever rounds came before: a(q, B), the draft nodes a tree
of budget B accepts there, and the next round starts at q + a(q, B) + 1. A best-first tree of B nodes is the first
B + 1 nodes of every larger one and the walk stops at its first node past B (`budget.accepted_at_each_budget`), so
one verify of the largest tree gives a(q, B) for every B. This script measures a(q, B) at every q of every prompt
(one prefill + draft + build + verify per q, batched; f32 by default, where the loop's output equals AR's) and
E(q, B), the drafter's own expected accepted nodes of that tree (the sum of its first B path probabilities,
uncalibrated). Then it replays, on a table of seconds per round c_B for each batch size (from a bench_decode JSON:
each fixed row's seconds over its batch rounds, so no model of the device enters), these policies:

  * fixed B (and AR): the replay's tau must match the decode loop's (`tau_loop` from the JSON, same prompts);
  * `oracle`: the best sequence of budgets for each batch, knowing every round's outcome: per stream, the fewest
    seconds to emit its tokens (dynamic programming over q; exact at batch 1); at batch S > 1 (one B per round for
    the batch) the round's best tokens per second, greedily. No chooser can beat it at batch 1;
  * `draft`: B = argmax (mean over the batch of E(q, B) + 1) / c_B from the round's own draft, before its verify
    (the auto loop fixes B one round ahead and calibrates E against acceptance: this is what the drafter's own
    numbers, seen in time, give);
  * `auto`: `--budget=auto`'s own chooser (`AutoChooser`) on the same rounds and costs: the auto loop as it would
    choose if its rounds cost what the fixed loops' do.

The measured rounds are saved as .npz (--outcomes); --reuse_outcomes replays them on other costs in seconds.

Speed-ups are over AR at the same costs. The JSON (--out) has every row; the plot (--plot) the speed-up of each
policy per batch size. Temperature 0 only: at T > 0 a round's outcome is a draw, and a replay of one draw per q
would favour the oracle.
"""
from __future__ import annotations

import json
import os
import platform
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from flax import nnx
from tqdm import tqdm

from experiments.run_record import code_version, write_json
from kdtree_jax import budget as budget_lib
from kdtree_jax import cli, model_dir, plots
from kdtree_jax.data import eval_prompts
from kdtree_jax.decode import DecodeSpec, Decoder, check_spec, draft_tree, prefill, verify_and_commit

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    def d(define, name, default, help_text, **kw):
        define(name, default, help=help_text, flag_values=fv, **kw)
    model_dir.define_model_flags(fv)
    d(flags.DEFINE_enum, "dtype", "float32", "the models' dtype for the outcomes (float32: the loop's output equals "
      "AR's, so the replay is the loop)", enum_values=["float32", "bfloat16"])
    d(flags.DEFINE_integer, "num_prompts", 32, "held-out prompts (bench_decode's, same seed)")
    d(flags.DEFINE_integer, "prompt_tokens", 64, "tokens per prompt")
    d(flags.DEFINE_integer, "max_new_tokens", 128, "tokens generated per prompt")
    d(flags.DEFINE_list, "budgets", ["4", "8", "16", "32", "64"], "the candidate budgets B >= 1 (AR is always one)")
    d(flags.DEFINE_string, "costs_from", "experiments/results/decode/decode.json", "a bench_decode JSON whose rows at "
      "temperature 0 price the rounds (--costs_of; each batch size it has for every budget here)")
    d(flags.DEFINE_float, "prefill_ms", None, "one call's prefill in ms, taken out of the fixed loops' seconds and "
      "charged once a call to every policy, where the JSON has no auto row that measured it (`costs.prefill_s`); "
      "unset: none taken out")
    d(flags.DEFINE_enum, "costs_of", "fixed_loops", "fixed_loops: a round at B costs what the fixed loop's did (its "
      "seconds over its batch rounds); auto_calibration: what the auto row's calibrated step costs said (its "
      "`costs`: the table the loop chose by)", enum_values=["fixed_loops", "auto_calibration"])
    d(flags.DEFINE_string, "outcomes", "", "the measured rounds (a(q, B), E(q, B)) as .npz (default: beside --out); "
      "written after measuring, read instead with --reuse_outcomes")
    d(flags.DEFINE_bool, "reuse_outcomes", False, "replay the rounds of --outcomes (measured with the same models, "
      "dtype, prompts, tokens and budgets) instead of measuring them: another device's costs in seconds")
    d(flags.DEFINE_integer, "chunk", 32, "rounds measured together (streams of one forward)")
    d(flags.DEFINE_integer, "seed", 0, "prompt choice (bench_decode's --seed)")
    d(flags.DEFINE_string, "out", "experiments/results/decode/budget_ceiling.json", "JSON output")
    d(flags.DEFINE_string, "plot", "experiments/results/decode/budget_ceiling.png", "PNG of the speed-ups ('' to skip)")
    cli.define_overwrite(fv)


class LoopTimes(NamedTuple):
    """A bench_decode JSON's rows at T = 0, {batch: {B: value}} (B = 0: AR)."""
    device: str
    seconds: dict  # fixed_loops: each fixed loop's seconds over all prompts (None under auto_calibration)
    batch_rounds: dict  # fixed_loops: its batch rounds where the JSON counts them (`budget_hist`; else None)
    calibrated: dict  # auto_calibration: the auto row's seconds of a round at each B (None under fixed_loops)
    tau: dict  # the fixed loops' tau, where the JSON has the row
    speedup: dict  # the fixed loops' measured speed-up over AR, where the JSON has the row
    auto_speedup: dict  # {batch: the auto row's measured speed-up over AR}, where the JSON has one
    prefill_s: dict  # {batch: one call's prefill (an auto row's `costs.prefill_s`; else --prefill_ms, else 0)}


class Inputs(NamedTuple):
    target: object  # ModelConfig
    drafter: object  # DrafterConfig
    tokenizer: object
    eos: tuple[int, ...]
    budgets: list[int]
    loops: LoopTimes
    outcomes: Outcomes | None  # --reuse_outcomes: the rounds to replay


class Outcomes(NamedTuple):
    """The measured rounds: R of them over all prompts, C budgets; column 0 is AR (no draft node)."""
    key: dict  # what they were measured for (`outcome_key`)
    accepted: np.ndarray  # [R, 1 + C] int: draft nodes the round's tree of each budget accepts, a(q, B)
    expected: np.ndarray  # [R, 1 + C] f32: the drafter's expected accepted nodes of that tree, E(q, B)
    score: np.ndarray  # [R, N + 1] f32: path log-probabilities of the largest tree's nodes (N its budget)
    path: np.ndarray  # [R, D + 1] int: the accept walk in it (node indices, root first, -1 past its end)
    owner: np.ndarray  # [R] int: the prompt each round belongs to (rounds in order of q within a prompt)
    off_ar: int  # rounds whose prefill token was not AR's (the replay follows AR's output)
    code: str  # the code version that measured them


def outcome_key(f, budgets: list[int]) -> dict:
    return {"target": f.target, "drafter": f.drafter, "dtype": f.dtype, "num_prompts": f.num_prompts,
            "prompt_tokens": f.prompt_tokens, "max_new_tokens": f.max_new_tokens, "seed": f.seed,
            "budgets": budgets}


def outcomes_path(f) -> str:
    return f.outcomes or os.path.splitext(f.out)[0] + ".npz"


def save_outcomes(path: str, o: Outcomes) -> None:
    np.savez_compressed(path, key=json.dumps(o.key), accepted=o.accepted, expected=o.expected, score=o.score,
                        path=o.path, owner=o.owner, off_ar=o.off_ar, code=o.code)


def load_outcomes(path: str, key: dict) -> Outcomes:
    """The rounds saved at path; refused when they were measured for anything other than `key`."""
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist; measure the rounds first (drop --reuse_outcomes)")
    with np.load(path) as z:
        saved = json.loads(str(z["key"]))
        diff = {k: (saved.get(k), key.get(k)) for k in key if k != "budgets" and saved.get(k) != key.get(k)}
        if not set(key["budgets"]) <= set(saved["budgets"]):
            diff["budgets"] = (saved["budgets"], key["budgets"])
        if diff:
            raise ValueError(f"{path} holds rounds measured for other settings (saved, asked): {diff}; pass the "
                             f"same flags (--budgets may name fewer) or measure again (drop --reuse_outcomes)")
        columns = [0] + [1 + saved["budgets"].index(b) for b in key["budgets"]]  # column 0: AR
        return Outcomes(key, z["accepted"][:, columns], z["expected"][:, columns], z["score"], z["path"], z["owner"],
                        int(z["off_ar"]), str(z["code"]) if "code" in z else "unknown")


def read_loop_times(path: str, budgets: list[int], costs_of: str = "fixed_loops", prefill_s: float | None = None,
                    settings: dict | None = None) -> LoopTimes:
    """The rows at temperature 0 of a bench_decode JSON, per batch size, priced as `costs_of` says. Batch sizes
    without a price for every budget of `budgets` (and AR) are left out, and so are those whose price needs a
    loop's batch rounds replayed when the JSON ran other `settings` (num_prompts, prompt_tokens, max_new_tokens)
    than these rounds; none left is an error, as is a JSON run with another top-k."""
    with open(path) as fh:
        results = json.load(fh)
    meta = results.get("meta", {})
    if meta.get("topk") is not None:
        raise ValueError(f"{path} ran with --topk={meta['topk']}; these rounds build trees with the default top-k: "
                         f"take another --costs_from")
    other = {k: (meta.get(k), v) for k, v in (settings or {}).items() if meta.get(k) != v}
    seconds, rounds, calibrated, tau, speedup, auto, prefill = {}, {}, {}, {}, {}, {}, {}
    for row in results.get("runs", []):
        if row.get("temperature") != 0 or row.get("policy") not in ("ar", "ddtree"):
            continue
        if row.get("exact") or row.get("check_finite") is False:
            continue
        batch = int(row["batch"])
        if row["budget"] == "auto":
            auto[batch] = row["speedup"]
            prefill[batch] = row["costs"].get("prefill_s")
            calibrated[batch] = dict(zip(row["costs"]["candidates"], row["costs"]["seconds"]))
            continue
        b = int(row["budget"])
        tau.setdefault(batch, {})[b] = row["tau"]
        speedup.setdefault(batch, {})[b] = row["speedup"]
        seconds.setdefault(batch, {})[b] = row["seconds"]
        hist = row.get("budget_hist")
        rounds.setdefault(batch, {})[b] = sum(hist.values()) if hist else row["rounds"] if batch == 1 else None
    if costs_of == "fixed_loops":
        calibrated = {}
    else:
        seconds = rounds = {}
    priced = seconds or calibrated
    need = [0] + budgets
    complete = sorted(s for s in priced if all(b in priced[s] for b in need))
    if other and seconds:  # a loop's batch rounds replayed on other prompts than its own would misprice it
        complete = [s for s in complete if all(rounds[s][b] is not None for b in need)]
    if not complete:
        have = {s: sorted(v) for s, v in priced.items()}
        why = (f"; where it lacks a loop's batch rounds they are replayed, which needs its prompts (JSON, here: "
               f"{other})" if other and seconds else "")
        raise ValueError(f"{path} prices no batch size at T = 0 for every budget of {need} by {costs_of} (it has "
                         f"{have}){why}; choose --budgets among them, another --costs_of or another --costs_from")
    device = results.get("meta", {}).get("device", "unknown")
    pick = lambda table: {s: {b: table.get(s, {}).get(b) for b in need} for s in complete}  # noqa: E731
    return LoopTimes(device, pick(seconds), pick(rounds), pick(calibrated), pick(tau), pick(speedup),
                     {s: auto.get(s) for s in complete}, {s: prefill.get(s) or prefill_s or 0.0 for s in complete})


def check(f) -> Inputs:
    """Every input before any weight is read: flags, output paths, the cost table, the models' files and fit, and
    the decode spec of the outcome rounds."""
    for name, minimum in (("num_prompts", 1), ("prompt_tokens", 1), ("max_new_tokens", 2), ("chunk", 1),
                          ("prefill_ms", 0)):
        cli.at_least(f, name, minimum)
    cli.seed(f)
    budgets = sorted(set(cli.int_list(f, "budgets", 1)))
    cli.output_path(f, "out")
    cli.output_path(f, "plot")
    outcomes = None
    if f.reuse_outcomes:
        with cli.about(f, "outcomes"):
            outcomes = load_outcomes(outcomes_path(f), outcome_key(f, budgets))
    else:
        cli.output_path(f, "outcomes", path=outcomes_path(f))
    with cli.about(f, "costs_from"):
        loops = read_loop_times(f.costs_from, budgets, f.costs_of,
                                None if f.prefill_ms is None else f.prefill_ms / 1e3,
                                {"num_prompts": f.num_prompts, "prompt_tokens": f.prompt_tokens,
                                 "max_new_tokens": f.max_new_tokens})
    target, drafter, tokenizer, eos = model_dir.model_configs(f, f.dtype)
    contexts = [[0] * (f.prompt_tokens + f.max_new_tokens - 2)] * f.chunk
    spec = outcome_spec(max(budgets), drafter.block_size)
    with cli.about(f, "budgets"):
        check_spec(spec, target, drafter, contexts, Decoder.default_cache_len(spec, contexts), None)
    model_dir.check_model_tensors(f, target, drafter)
    return Inputs(target, drafter, tokenizer, eos, budgets, loops, outcomes)


def outcome_spec(largest: int, block_size: int) -> DecodeSpec:
    """The spec of the measured rounds: ddtree at the largest budget, greedy, no stop token (a round's outcome must
    not depend on EOS), one token per prefill (the round's bonus)."""
    return DecodeSpec(policy="ddtree", budget=largest, block_size=block_size, temperature=0.0, max_new_tokens=1,
                      check_finite=True)


def round_outcomes(decoder: Decoder, spec: DecodeSpec, contexts: list[list[int]], budgets: list[int], chunk: int):
    """For each context (the committed tokens of a round, the prompt and AR's first q tokens): the round that starts
    there at T = 0 -> (bonus [n]: the prefill's token, AR's token q if the forwards agree; accepted [n, C]: draft
    nodes its tree accepts at each budget; expected [n, C]: the drafter's sum of the first B nodes' path
    probabilities; score [n, N + 1] and path [n, D + 1]: the largest tree's and its walk's), C = len(budgets).
    Rounds run `chunk` at a time, right-padded to one shape (one compile)."""
    longest = max(len(c) for c in contexts)
    cache_len = Decoder.default_cache_len(spec, [[0] * longest])
    sizes = jnp.asarray(budgets)

    def one_chunk(params, dparams, cache, dcache, tokens, lengths):
        target, drafter = nnx.merge(decoder.target_def, params), nnx.merge(decoder.drafter_def, dparams)
        st = prefill(target, drafter, spec, cache, dcache, tokens, lengths, jax.random.key(0))
        tree = draft_tree(target, drafter, spec, st)
        _, _, verdict, _, _ = verify_and_commit(target, drafter, spec, st, tree, st.keys, extend_context=False)
        alone = jnp.ones((1,), bool)
        accepted = jax.vmap(lambda p: budget_lib.accepted_at_each_budget(p[None], budgets, alone))(verdict.path)
        probs = jnp.exp(tree.score.astype(jnp.float32)).at[:, 0].set(0.0)  # the root is no draft node
        return st.bonus, accepted, jnp.cumsum(probs, axis=1)[:, sizes], tree.score, verdict.path

    fn = jax.jit(one_chunk)
    results = [[] for _ in range(5)]
    for start in tqdm(range(0, len(contexts), chunk), desc="rounds", unit="chunk"):
        part = contexts[start:start + chunk]
        part = part + [part[-1]] * (chunk - len(part))  # a short last chunk repeats its last context
        tokens = np.zeros((chunk, longest), np.int32)
        for i, c in enumerate(part):
            tokens[i, :len(c)] = c
        cache, dcache = decoder.new_caches(spec, chunk, cache_len)
        out = fn(decoder.target_params, decoder.drafter_params, cache, dcache, jnp.asarray(tokens),
                 jnp.asarray([len(c) for c in part], jnp.int32))
        n = min(chunk, len(contexts) - start)
        for store, value in zip(results, out):
            store.append(np.asarray(value)[:n])
    bonus, accepted, expected, score, path = (np.concatenate(r) for r in results)
    return bonus, np.rint(accepted).astype(int), expected, score, path


def fewest_seconds(accepted: np.ndarray, seconds: np.ndarray) -> float:
    """accepted [Q, C] (a(q, B) of one stream whose output is Q + 1 tokens, the first its prefill's), seconds [C] ->
    the fewest seconds of rounds that emit the other Q, over every sequence of budgets (dynamic programming over
    q)."""
    q_end = accepted.shape[0]
    best = np.zeros(q_end + 1)
    for q in range(q_end - 1, -1, -1):
        reach = np.minimum(q + accepted[q] + 1, q_end)
        best[q] = np.min(seconds + best[reach])
    return float(best[0])


class Rounds(NamedTuple):
    """Rows of `Outcomes` (leading dimension: rounds or streams)."""
    accepted: np.ndarray
    expected: np.ndarray
    score: np.ndarray
    path: np.ndarray


def replay(streams: list[Rounds], seconds: np.ndarray, policy) -> tuple[float, int]:
    """One batch of streams (each its rounds in order of q) decoded to the end with one budget index per round chosen
    by policy(rows, active) (rows: each stream's round now, a finished stream's last; active [S] bool), then told
    the outcome by policy.after(rows, active, c) if it has one -> (seconds, batch rounds)."""
    streams = [r for r in streams if len(r.accepted)]  # a prompt whose output is one token has no round
    q = np.zeros(len(streams), int)
    ends = np.array([len(r.accepted) for r in streams], int)
    total, rounds = 0.0, 0
    while (q < ends).any():
        active = q < ends
        now = np.minimum(q, ends - 1)
        rows = Rounds(*(np.stack([getattr(r, name)[i] for r, i in zip(streams, now)]) for name in Rounds._fields))
        c = policy(rows, active)
        if hasattr(policy, "after"):
            policy.after(rows, active, c)
        q = np.where(active, q + rows.accepted[:, c] + 1, q)
        total += seconds[c]
        rounds += 1
    return total, rounds


class AutoChooser:
    """`--budget=auto`'s chooser (`budget`: the forecast, the climb, the AR spells and probes), driven by the replayed
    rounds: the next round's B is the state's plan; after a round at B it sees what the loop would have seen (the
    tree built at `budget.build_budget`, the walk in its first B + 1 nodes). Its step costs are the replay's."""

    def __init__(self, labels: list[int], seconds: np.ndarray, depth: int):
        self.candidates, self.depth = tuple(labels), depth
        self.costs = jnp.asarray(seconds, jnp.float32)
        self.state = budget_lib.init_state(self.candidates, self.costs, depth)
        self._drafted = jax.jit(budget_lib.after_drafted_round, static_argnums=(3, 4, 6))
        self._ar = jax.jit(budget_lib.plan_after_ar, static_argnums=(1, 3))

    def __call__(self, rows: Rounds, active) -> int:
        return int(self.state.next_index)

    def after(self, rows: Rounds, active, c: int) -> None:
        b = self.candidates[c]
        if b == 0:
            self.state = self._ar(self.state, self.candidates, self.costs, self.depth)
            return
        build = budget_lib.build_budget(self.candidates, b)
        past = np.cumsum(rows.path > b, axis=1) > 0  # the walk in b's tree stops before its first node past b
        path = np.where(past, -1, rows.path)
        self.state = self._drafted(self.state, jnp.asarray(rows.score[:, :build + 1]), jnp.asarray(path), b,
                                   self.candidates, self.costs, self.depth, jnp.asarray(active))


def batch_row(streams: list[Rounds], seconds: np.ndarray, labels: list[int], auto: AutoChooser) -> dict:
    """(seconds, batch rounds) of each policy on one batch of streams; `auto` carries its state from batch to
    batch, as the decode loop's chooser does from call to call."""
    def best(values, active):
        return int(np.argmax((values[active].mean(0) + 1) / seconds))
    row = {f"B={b}": replay(streams, seconds, lambda r, m, c=c: c) for c, b in enumerate(labels)}
    row["oracle"] = replay(streams, seconds, lambda r, m: best(r.accepted, m))
    if len(streams) == 1:
        row["oracle"] = (fewest_seconds(streams[0].accepted, seconds), None)
    row["draft"] = replay(streams, seconds, lambda r, m: best(r.expected, m))
    row["auto"] = replay(streams, seconds, auto)
    return row


def round_seconds(loops: LoopTimes, batch: int, labels: list[int], groups) -> np.ndarray:
    """[C] seconds of one batch round at each budget of `labels`: the calibrated price, or a fixed loop's seconds
    less its calls' prefills over its batch rounds (`budget_hist`; where the JSON lacks them, the rounds the replay
    of that loop takes on these outcomes)."""
    seconds = []
    for c, b in enumerate(labels):
        if loops.seconds[batch][b] is None:  # auto_calibration: the loop's own price, prefill apart already
            seconds.append(loops.calibrated[batch][b])
            continue
        rounds = loops.batch_rounds[batch][b]
        if rounds is None:
            ones = np.ones(len(labels))
            rounds = sum(replay(g, ones, lambda r, m, c=c: c)[1] for g in groups)
        seconds.append((loops.seconds[batch][b] - len(groups) * loops.prefill_s[batch]) / rounds)
    return np.asarray(seconds)


def measure(f, inputs: Inputs) -> Outcomes:
    """AR's output for each prompt, then the round after each of its first tokens (`round_outcomes`)."""
    prompts = [list(p.ids) for p in eval_prompts(inputs.tokenizer, f.num_prompts, f.prompt_tokens, seed=f.seed)]
    target = model_dir.load_target(f.target, dtype=f.dtype)
    drafter = model_dir.load_drafter(f.drafter, target.cfg)
    decoder = Decoder(target, drafter)
    ar = DecodeSpec(policy="ar", max_new_tokens=f.max_new_tokens, eos_token_ids=inputs.eos)
    outputs = [decoder.generate([p], ar).tokens[0] for p in tqdm(prompts, desc="AR outputs", unit="prompt")]
    contexts, owner = [], []
    for i, (p, out) in enumerate(zip(prompts, outputs)):
        for q in range(len(out) - 1):  # the round after q + 1 emitted tokens; the last one emits nothing
            contexts.append(p + out[:q])
            owner.append(i)
    spec = outcome_spec(max(inputs.budgets), drafter.cfg.block_size)
    bonus, accepted, expected, score, path = round_outcomes(decoder, spec, contexts, inputs.budgets, f.chunk)
    disagree = int((bonus != np.concatenate([out[:-1] for out in outputs])).sum())
    if disagree:
        logging.warning("%d of %d rounds start from a token other than AR's (the prefill forward and AR's disagree "
                        "there): the replay follows AR's output", disagree, len(bonus))
    zero = np.zeros((len(bonus), 1), accepted.dtype)  # AR: a round accepts no draft node
    return Outcomes(outcome_key(f, inputs.budgets), np.concatenate([zero, accepted], axis=1),
                    np.concatenate([zero.astype(expected.dtype), expected], axis=1), score, path, np.asarray(owner),
                    disagree, code_version())


def run(f) -> None:
    inputs = check(f)
    start = time.time()
    o = inputs.outcomes
    if o is None:
        o = measure(f, inputs)
        save_outcomes(outcomes_path(f), o)
    prompts = range(f.num_prompts)
    owner = o.owner
    per_prompt = [Rounds(o.accepted[owner == i], o.expected[owner == i], o.score[owner == i], o.path[owner == i])
                  for i in range(len(prompts))]
    labels = [0] + inputs.budgets
    tokens = len(owner)  # emitted by rounds (each prefill emits one; a round for each of the other tokens)
    rows, seconds_per_round = [], {}
    for batch in inputs.loops.speedup:
        groups = [per_prompt[g:g + batch] for g in range(0, len(prompts), batch)]
        seconds = round_seconds(inputs.loops, batch, labels, groups)
        seconds_per_round[str(batch)] = dict(zip(map(str, labels), seconds.tolist()))
        totals, auto = {}, AutoChooser(labels, seconds, o.path.shape[1] - 1)
        for group in tqdm(groups, desc=f"replay, batch {batch}", unit="batch"):
            for name, (sec, rounds) in batch_row(group, seconds, labels, auto).items():
                sums = totals.setdefault(name, [0.0, 0])
                sums[0] += sec
                sums[1] += rounds or 0
        for sums in totals.values():  # every policy's calls prefill alike
            sums[0] += len(groups) * inputs.loops.prefill_s[batch]
        fixed = {f"B={b}": totals[f"B={b}"][0] for b in inputs.budgets}
        best_fixed = min(fixed, key=fixed.get)
        for name, (sec, rounds) in totals.items():
            b = int(name[2:]) if name.startswith("B=") else None
            rows.append({"batch": batch, "policy": name, "seconds": sec, "batch_rounds": rounds or None,
                         "tau": tokens / rounds if rounds and batch == 1 else None,
                         "speedup": totals["B=0"][0] / sec, "vs_best_fixed": fixed[best_fixed] / sec,
                         "best_fixed": best_fixed,
                         "tau_loop": inputs.loops.tau[batch][b] if b is not None else None,
                         "speedup_loop": inputs.loops.speedup[batch][b] if b is not None else
                         inputs.loops.auto_speedup[batch] if name == "auto" else None})
    results = {"meta": {"code": code_version(), "host": platform.node(), "backend": jax.default_backend(),
                        "dtype": f.dtype, "target": f.target, "drafter": f.drafter, "num_prompts": len(prompts),
                        "prompt_tokens": f.prompt_tokens, "max_new_tokens": f.max_new_tokens,
                        "budgets": inputs.budgets, "costs_from": f.costs_from, "costs_of": f.costs_of,
                        "costs_device": inputs.loops.device,
                        "seconds_per_round": seconds_per_round, "prefill_s": inputs.loops.prefill_s,
                        "rounds_measured": len(owner), "rounds_off_ar": o.off_ar,
                        "outcomes": outcomes_path(f), "outcomes_reused": f.reuse_outcomes, "outcomes_code": o.code,
                        "minutes": (time.time() - start) / 60},
               "rows": rows,
               "mean_accepted": {str(b): float(o.accepted[:, c].mean()) for c, b in enumerate(labels)},
               "mean_expected": {str(b): float(o.expected[:, c].mean()) for c, b in enumerate(labels)}}
    write_json(f.out, results)
    print_table(rows)
    if f.plot:
        plot_speedups(results, f.plot)
    print(f"wrote {f.out}")


def print_table(rows) -> None:
    print(f"{'batch':>5} {'policy':>8} {'tau':>6} {'tau loop':>8} {'speedup':>8} {'loop':>6} {'vs best fixed':>13}")
    for r in rows:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        tau_loop = "" if r["tau_loop"] is None else f"{r['tau_loop']:.2f}"
        loop = "" if r["speedup_loop"] is None else f"{r['speedup_loop']:.2f}x"
        print(f"{r['batch']:>5} {r['policy']:>8} {tau:>6} {tau_loop:>8} {r['speedup']:>7.2f}x {loop:>6} "
              f"{r['vs_best_fixed']:>12.3f}x")


def plot_speedups(results: dict, path: str) -> None:
    """Speed-up over AR of every policy, one group of bars per batch size."""
    batches = sorted({r["batch"] for r in results["rows"]})
    policies = list(dict.fromkeys(r["policy"] for r in results["rows"]))
    by = {(r["batch"], r["policy"]): r["speedup"] for r in results["rows"]}
    plots.grouped_bars(path, [f"batch {s}" for s in batches], {p: [by[(s, p)] for s in batches] for p in policies},
                      ylabel="speed-up over AR (replayed)",
                      title=f"per-round budget vs fixed B, T = 0: {results['meta']['target']}, round costs of "
                            f"{os.path.basename(results['meta']['costs_from'])} ({results['meta']['costs_device']})")


if __name__ == "__main__":
    cli.script(define_flags, run)
