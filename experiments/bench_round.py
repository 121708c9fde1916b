"""Per-round cost of the decode loop on the device, stage by stage, and the loop's own overhead.

    PYTHONPATH=. python3 experiments/bench_round.py                 # shipped code_target + drafter checkpoints
    PYTHONPATH=. python3 experiments/bench_round.py --config=tiny --init=random --drafter=random \\
        --budgets=0,8 --streams=2 --prompt_len=8 --rounds=4 --reps=3        # CPU smoke run
    PYTHONPATH=. python3 experiments/bench_round.py --streams=8 --budgets=0,8,32,auto --temperatures=0,1
        # the cost of sampling (T = 1) against greedy rounds, and the auto loop's measured step costs
    PYTHONPATH=. python3 experiments/bench_round.py --streams=1,8 --budgets=0,32 --exact=on,off
        # where the exact mode's extra time goes, stage by stage (the target's forward: prefill, verify, commit)

For each (streams, budget) (budget 0 = ar, else ddtree with B nodes), from the state after prefilling random prompts
of --prompt_len tokens:
  * each stage of a round as its own jitted function on that state: draft (the drafter's block), build (ops.tree_build),
    verify (the target's forward over the B+1 nodes), accept (argmax per node, or a sample per node at T > 0, +
    ops.tree_accept: `decode.walk_tree`), commit (KV compaction + the drafter context of the accepted tokens); their
    sum. The emitted-token bookkeeping of a round is in none of them;
  * `round`: one whole `decode_round` in one jit (one dispatch; the bookkeeping included);
  * `while_loop`: prefill + the `lax.while_loop` exactly as `Decoder.generate` compiles it, up to --rounds rounds;
    per round = (loop - prefill) / rounds, prefill timed on its own;
  * `fixed_loop`: the same prefill + rounds as a `lax.fori_loop` with a fixed trip count (no data-dependent predicate).
    XLA:GPU reads a while loop's predicate back to the host and waits for it every iteration unless the trip count
    is known, so `while_loop - fixed_loop` per round is the cost of that round trip;
  * overhead = while_loop per round - sum of the stages.
`auto` (a budget of --budgets): the auto loop's step costs per candidate of --auto_budgets (`Decoder.step_costs`,
wall clock: the cost model `--budget=auto` chooses by) and its while loop per round with those costs, with the
budgets it chose; no stage split.
Times are device spans from profiler traces (experiments/timing.time_jobs; wall clock where there is no device
trace, e.g. on the CPU), median of --reps calls; caches are donated and made fresh for every call, as in the loop.
On the GPU the loops also report device busy time, device events and device-to-host copies per round.

--out defaults to experiments/results/decode/round_<backend>.json, and the plot of the stage times goes beside it
(.png).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
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

from experiments.run_record import code_version
from experiments.timing import Job, rel_err, time_jobs
from kdtree_jax import budget as budget_lib
from kdtree_jax import config as config_lib
from kdtree_jax import cli, model_dir, plots
from kdtree_jax.decode import (DecodeSpec, Decoder, LoopState, budget_counts, check_spec, commit_kv, decode_round,
                               prefill, root_only_tree, split_each, walk_tree)
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer
from pallas_kernels import batch_invariant, ops

F = flags.FLAGS


def define_flags(fv: flags.FlagValues = F) -> None:
    def d(define, name, default, help_text, **kw):
        define(name, default, help=help_text, flag_values=fv, **kw)
    d(flags.DEFINE_string, "config", "code_target", f"model preset of a random target: {sorted(config_lib.PRESETS)}")
    d(flags.DEFINE_string, "init", "checkpoints/target", "'random' (at --config), a target checkpoint directory of "
      "ours or an HF model directory")
    d(flags.DEFINE_string, "drafter", "checkpoints/drafter", "'random', a drafter checkpoint directory of ours or a "
      "DFlash drafter directory")
    d(flags.DEFINE_integer, "block_size", 16, "block size L of a random drafter; a checkpointed drafter has its own, "
      "and another value given here is refused")
    d(flags.DEFINE_list, "budgets", ["0", "8", "32", "128"], "tree budgets B; 0 = ar (no draft, a root-only tree); "
      "'auto' = the auto loop over --auto_budgets")
    d(flags.DEFINE_list, "auto_budgets", [str(b) for b in budget_lib.DEFAULT_CANDIDATES], "the budgets of an auto "
      "case")
    d(flags.DEFINE_list, "temperatures", ["0"], "sampling temperatures (0 = greedy)")
    d(flags.DEFINE_list, "exact", ["off"], "the target's batch-invariant forward (DecodeSpec.exact): 'on', 'off', or "
      "'on,off' (each case both ways, one after the other)")
    d(flags.DEFINE_list, "streams", ["1", "8"], "streams decoded together")
    d(flags.DEFINE_integer, "prompt_len", 64, "tokens per (random) prompt")
    d(flags.DEFINE_integer, "rounds", 32, "rounds of the timed loops (the while loop stops earlier if every stream is "
      "done)")
    d(flags.DEFINE_integer, "seed", 0, "seed of random init and prompts")
    d(flags.DEFINE_integer, "rounds_per_check", 1, "the Decoder loop's rounds between stop-condition checks")
    d(flags.DEFINE_float, "time_budget_s", 480.0, "start no new case past this many seconds (the JSON is written per "
      "case)")
    d(flags.DEFINE_string, "out", "", "where the JSON results go ('' for "
      "experiments/results/decode/round_<backend>.json)")
    d(flags.DEFINE_integer, "reps", 10, "timed calls per measurement (median reported)")
    d(flags.DEFINE_bool, "plot", True, "also write a PNG of the results beside the JSON")
    cli.define_overwrite(fv)


class Inputs(NamedTuple):
    target: config_lib.ModelConfig
    drafter: config_lib.DrafterConfig
    block_size: int | None  # the --block_size to load the drafter with (None: a checkpoint's own)
    budgets: list  # integer B, or None for auto
    auto_budgets: tuple
    temperatures: list
    exact: list  # [bool]: each case in each
    streams: list
    out: str


def check(f) -> Inputs:
    """Every input before any weight is read: flags, output paths, the target and drafter files and their fit, and
    the decode spec of every case."""
    for name, minimum in (("block_size", 2), ("prompt_len", 1), ("rounds", 1), ("rounds_per_check", 1),
                          ("time_budget_s", 0), ("reps", 1)):
        cli.at_least(f, name, minimum)
    cli.seed(f)
    budgets = cli.budgets(f, "budgets", 0)
    auto_budgets = tuple(cli.int_list(f, "auto_budgets", 0))
    temperatures = cli.float_list(f, "temperatures", 0)
    exact_modes = cli.on_off(f, "exact")
    streams = cli.int_list(f, "streams", 1)
    out = f.out or f"experiments/results/decode/round_{jax.default_backend()}.json"
    cli.output_path(f, "out", path=out)
    if f.plot:
        cli.output_path(f, "out", path=os.path.splitext(out)[0] + ".png")
    block_size = f.block_size if f["block_size"].present or f.drafter == model_dir.RANDOM else None
    if f.init == model_dir.RANDOM and f.config not in config_lib.PRESETS:
        cli.refuse(f, "config", f"is not a preset; choose one of {sorted(config_lib.PRESETS)}")
    with cli.about(f, "init"):
        target = model_dir.target_config(f.init, preset=f.config)
    with cli.about(f, "drafter"):
        drafter = drafter_config(f.drafter, target, block_size)
    prompts = [[0] * f.prompt_len] * max(streams)
    for num_streams in streams:
        for budget in budgets:
            for temperature, exact in itertools.product(temperatures, exact_modes):
                spec = case_spec(budget, auto_budgets, temperature, drafter.block_size, f.rounds, f.rounds_per_check,
                                 exact)
                check_spec(spec, target, drafter, prompts[:num_streams], Decoder.default_cache_len(spec, prompts),
                           None)
    with cli.about(f, "init"):
        model_dir.check_tensors(f.init, target)
    with cli.about(f, "drafter"):
        model_dir.check_tensors(f.drafter, target, drafter)
    return Inputs(target, drafter, block_size, budgets, auto_budgets, temperatures, exact_modes, streams, out)


def case_spec(budget: int | None, auto_budgets: tuple, temperature: float, block_size: int, rounds: int,
              rounds_per_check: int, exact: bool = False) -> DecodeSpec:
    """One case: budget 0 = ar, B = ddtree with B nodes, None = ddtree choosing among auto_budgets (its loop plans
    each round: rounds_per_check 1); exact: the target's batch-invariant forward."""
    return DecodeSpec(policy="ar" if budget == 0 else "ddtree", budget=budget or 0,
                      auto_budgets=auto_budgets if budget is None else (), block_size=block_size,
                      temperature=temperature, max_new_tokens=rounds + 1,
                      rounds_per_check=rounds_per_check if budget is not None else 1, exact=exact)


def drafter_config(value: str, target: config_lib.ModelConfig, block_size: int | None) -> config_lib.DrafterConfig:
    """The drafter's config (no tensor read): random for code_target is the code_target's own drafter config."""
    if value == model_dir.RANDOM and target.name == "code_target":
        return config_lib.code_drafter(target)
    return model_dir.drafter_config(value, target, block_size=block_size)


STAGES = ("draft", "build", "verify", "accept", "commit")


# ------------------------------------------------------------------------------------------------------ models
def load_models(init: str, preset: str, drafter_init: str, block_size: int | None, seed: int
                ) -> tuple[Transformer, Drafter]:
    """The target (random at `preset`, a checkpoint of ours or an HF directory: kdtree_jax.model_dir) and its drafter
    (random: the code_target's own drafter config for code_target, the tiny drafter config otherwise; a checkpoint of
    ours or a DFlash directory)."""
    target = model_dir.load_target(init, preset=preset, seed=seed)
    if drafter_init == model_dir.RANDOM and target.cfg.name == "code_target":
        return target, Drafter(drafter_config(drafter_init, target.cfg, block_size), target.cfg, nnx.Rngs(seed + 1))
    return target, model_dir.load_drafter(drafter_init, target.cfg, block_size=block_size, seed=seed + 1)


# ------------------------------------------------------------------------------------------------------ stages
@dataclasses.dataclass
class RoundFunctions:
    """Jitted functions of one DecodeSpec; every one takes the target and drafter params first, so that weights are
    arguments as in the loop (not constants folded into the executable)."""
    prefill: object
    stages: dict
    round: object
    while_loop: object


def round_functions(decoder: Decoder, spec: DecodeSpec, num_streams: int, prompt_len: int,
                    cache_len: int) -> RoundFunctions:
    def models(params, dparams):
        target = nnx.merge(decoder.target_def, params)
        drafter = nnx.merge(decoder.drafter_def, dparams) if spec.policy != "ar" else None
        return target, drafter

    def prefill_fn(params, dparams, cache, dcache, tokens, lengths, key):
        return prefill(*models(params, dparams), spec, cache, dcache, tokens, lengths, key)

    def draft(params, dparams, bonus, length, dcache):
        target, drafter = models(params, dparams)
        return drafter.draft(target.embed, target.logits, bonus, length, dcache, length)

    def build(draft_logits, bonus):
        if spec.policy == "ar":
            return root_only_tree(bonus)
        return ops.tree_build(draft_logits, bonus, spec.tree_budget, spec.tree_topk)

    def verify(params, dparams, cache, tree):
        target, drafter = models(params, dparams)
        layer_ids = drafter.cfg.target_layer_ids if drafter is not None else ()
        return target(tree.tokens, cache.length[:, None] + tree.depth, cache, tree.visible, hidden_layers=layer_ids,
                      exact=spec.exact)

    def accept(tree, logits, keys):
        return walk_tree(spec, tree, logits, split_each(keys)[1])  # the keys decode_round samples with

    def commit(params, dparams, cache, dcache, hidden, verdict, active):
        """The end of decode_round: compaction, then the drafter context of the root and accepted nodes."""
        return commit_kv(models(params, dparams)[1], cache, dcache, hidden, verdict, active)

    def one_round(params, dparams, state):
        return decode_round(*models(params, dparams), spec, state)

    jit = functools.partial(jax.jit, **batch_invariant.jit_options(spec.exact))   # as the decoder's loop compiles
    stages = {"build": jit(build), "verify": jit(verify, donate_argnums=2), "accept": jit(accept),
              "commit": jit(commit, donate_argnums=(2, 3))}
    if spec.policy != "ar":
        stages["draft"] = jit(draft)
    return RoundFunctions(jit(prefill_fn, donate_argnums=(2, 3)), stages, jit(one_round, donate_argnums=2),
                          decoder.compiled_loop(spec, num_streams, prompt_len, cache_len))


def fixed_loop(decoder: Decoder, spec: DecodeSpec, rounds: int):
    """Decoder's prefill + loop with a fixed trip count: `lax.fori_loop` over `rounds` rounds instead of the
    while_loop on (rounds left) & (a stream still going). Finished streams are frozen by decode_round itself."""
    def run(params, dparams, cache, dcache, tokens, lengths, key, controls):
        del controls  # the loop's controls, unused here: a fixed budget, a fixed trip count
        target = nnx.merge(decoder.target_def, params)
        drafter = nnx.merge(decoder.drafter_def, dparams) if spec.policy != "ar" else None
        state = prefill(target, drafter, spec, cache, dcache, tokens, lengths, key)
        return jax.lax.fori_loop(0, rounds, lambda _, st: decode_round(target, drafter, spec, st), state)
    return jax.jit(run, donate_argnums=(2, 3))


def copies(tree):
    """A fresh device copy of every array (for a donated argument)."""
    return jax.tree.map(jnp.copy, tree)


# ------------------------------------------------------------------------------------------------------ one case
def measure(decoder: Decoder, target_cfg, spec: DecodeSpec, num_streams: int, prompt_len: int, reps: int,
            seed: int) -> dict:
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(4, target_cfg.vocab_size, (num_streams, prompt_len)), jnp.int32)
    lengths = jnp.full((num_streams,), prompt_len, jnp.int32)
    prompts = [[0] * prompt_len] * num_streams  # shapes only: the cache size and the host-side checks
    cache_len = Decoder.default_cache_len(spec, prompts)
    decoder.validate(spec, prompts, cache_len)
    fns = round_functions(decoder, spec, num_streams, prompt_len, cache_len)
    params, dparams = decoder.target_params, decoder.drafter_params
    key = jax.random.key(seed)

    def loop_args():
        return (params, dparams, *decoder.new_caches(spec, num_streams, cache_len), tokens, lengths, key)

    # The realistic state of every stage: a prefilled batch, then one round's intermediates.
    state: LoopState = fns.prefill(*loop_args())
    length = state.cache.length
    inputs = {"draft": lambda: (params, dparams, state.bonus, length, state.dcache)}
    draft = fns.stages["draft"](*inputs["draft"]()) if "draft" in fns.stages else None
    inputs["build"] = lambda: (draft, state.bonus)
    tree = fns.stages["build"](*inputs["build"]())
    inputs["verify"] = lambda: (params, dparams, copies(state.cache), tree)
    fwd = fns.stages["verify"](*inputs["verify"]())
    inputs["accept"] = lambda: (tree, fwd.logits, state.keys)
    verdict = fns.stages["accept"](*inputs["accept"]())
    inputs["commit"] = lambda: (params, dparams, copies(fwd.cache), copies(state.dcache), fwd.hidden, verdict,
                                ~state.done)
    staged = fns.stages["commit"](*inputs["commit"]())
    whole = fns.round(params, dparams, copies(state))

    final = fns.while_loop(*loop_args(), decoder.controls(spec))
    rounds = int(final.rounds)
    taus = np.asarray(final.taus)[:rounds]
    fixed = fixed_loop(decoder, spec, rounds)
    final_fixed = fixed(*loop_args(), decoder.controls(spec))
    checks = dict(stages_length_equal=bool(np.array_equal(staged[0].length, whole.cache.length)),
                  stages_vs_round_rel_err=max(rel_err(a, b) for a, b in zip(
                      jax.tree.leaves(staged), jax.tree.leaves((whole.cache, whole.dcache)))),
                  fixed_loop_same_output=bool(np.array_equal(final.out, final_fixed.out)
                                              and np.array_equal(final.num_out, final_fixed.num_out)))

    jobs = [Job(name, fns.stages[name], fresh_args=inputs[name]) for name in STAGES if name in fns.stages]
    jobs += [Job("round", fns.round, fresh_args=lambda: (params, dparams, copies(state))),
             Job("prefill", fns.prefill, fresh_args=loop_args),
             Job("while_loop", fns.while_loop, fresh_args=lambda: (*loop_args(), decoder.controls(spec))),
             Job("fixed_loop", fixed, fresh_args=lambda: (*loop_args(), decoder.controls(spec)))]
    t = time_jobs(jobs, reps)

    def per_round(job: str, field: str = "us"):
        if field not in t[job]:
            return None
        return (t[job][field] - t["prefill"][field]) / max(rounds, 1)

    stages_us = {name: t[name]["us"] for name in STAGES if name in t}
    stages_sum = sum(stages_us.values())
    while_round, fixed_round = per_round("while_loop"), per_round("fixed_loop")
    return dict(policy=spec.policy, budget=spec.tree_budget, temperature=spec.temperature, exact=spec.exact,
                streams=num_streams, prompt_len=prompt_len, cache_len=cache_len, rounds=rounds,
                tau_mean=float(taus[taus > 0].mean()) if (taus > 0).any() else 0.0,
                stages_us=stages_us, stages_sum_us=stages_sum, round_us=t["round"]["us"], prefill_us=t["prefill"]["us"],
                while_loop_us=t["while_loop"]["us"], fixed_loop_us=t["fixed_loop"]["us"],
                while_per_round_us=while_round, fixed_per_round_us=fixed_round,
                overhead_us=while_round - stages_sum, overhead_vs_round_us=while_round - t["round"]["us"],
                predicate_us=while_round - fixed_round,
                while_busy_per_round_us=per_round("while_loop", "busy_us"),
                fixed_busy_per_round_us=per_round("fixed_loop", "busy_us"),
                while_events_per_round=per_round("while_loop", "device_events"),
                while_d2h_per_round=per_round("while_loop", "d2h_copies"),
                fixed_d2h_per_round=per_round("fixed_loop", "d2h_copies"),
                checks=checks, timing_method=t["while_loop"]["method"], timings=t)


def measure_auto(decoder: Decoder, target_cfg, spec: DecodeSpec, num_streams: int, prompt_len: int,
                 seed: int) -> dict:
    """The auto loop on random prompts: its step costs (`Decoder.step_costs`, the cost model) and its while loop
    per round (wall clock, prefill subtracted) with the budgets chosen."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(4, target_cfg.vocab_size, (num_streams, prompt_len)).tolist()
    cache_len = Decoder.default_cache_len(spec, prompts)
    costs = decoder.step_costs(spec, prompts, cache_len)
    decoder.generate(prompts, spec, seed=seed, cache_len=cache_len, costs=costs)  # warm up
    res = decoder.generate(prompts, spec, seed=seed, cache_len=cache_len, costs=costs)
    return dict(policy=spec.policy, budget="auto", temperature=spec.temperature, exact=spec.exact,
                streams=num_streams, prompt_len=prompt_len, cache_len=cache_len, rounds=res.rounds,
                tau_mean=float(res.taus[res.taus > 0].mean()) if (res.taus > 0).any() else 0.0,
                step_costs_us={b: 1e6 * t for b, t in zip(costs.candidates, costs.seconds)},
                prefill_us=1e6 * costs.prefill_s,
                while_per_round_us=1e6 * (res.seconds - costs.prefill_s) / res.rounds_run,
                budget_hist=budget_counts(res.budgets), budget_rounds=res.budgets.tolist(), timing_method="wall")


# ------------------------------------------------------------------------------------------------------ output
def print_auto(row) -> None:
    costs = " ".join(f"B={b}:{us:.0f}" for b, us in row["step_costs_us"].items())
    chosen = " ".join(f"{b}:{n}" for b, n in row["budget_hist"].items())
    exact = " exact" if row["exact"] else ""
    print(f"auto T={row['temperature']:g} S={row['streams']}{exact}: step costs (us) {costs} | while/r "
          f"{row['while_per_round_us']:.1f} us, tau {row['tau_mean']:.2f}, rounds by B {chosen}", flush=True)


def print_table(rows) -> None:
    head = (f"{'policy':>7} {'B':>4} {'T':>3} {'S':>3} {'exact':>5} | " + " ".join(f"{s:>8}" for s in STAGES)
            + f" {'sum':>8} | {'round':>8} {'while/r':>8} {'fixed/r':>8} | {'overhead':>8} {'pred/r':>7} | "
            f"{'tau':>5} {'rounds':>6}")
    print(f"us per round ({rows[0]['timing_method'] if rows else '-'} time)\n{head}")
    for r in rows:
        stages = " ".join(f"{r['stages_us'][s]:8.1f}" if s in r["stages_us"] else f"{'-':>8}" for s in STAGES)
        print(f"{r['policy']:>7} {r['budget']:>4} {r['temperature']:>3g} {r['streams']:>3} "
              f"{'on' if r.get('exact') else 'off':>5} | {stages} "
              f"{r['stages_sum_us']:8.1f} | "
              f"{r['round_us']:8.1f} {r['while_per_round_us']:8.1f} {r['fixed_per_round_us']:8.1f} | "
              f"{r['overhead_us']:8.1f} {r['predicate_us']:7.1f} | {r['tau_mean']:5.2f} {r['rounds']:>6}", flush=True)


def run(f) -> None:
    logging.set_verbosity(logging.ERROR)  # keep checkpoint-library chatter out of the table
    start = time.time()
    inputs = check(f)
    out = inputs.out
    target, drafter = load_models(f.init, f.config, f.drafter, inputs.block_size, f.seed)
    decoder = Decoder(target, drafter)
    block = drafter.cfg.block_size
    results = dict(meta=dict(code=code_version(), jax=jax.__version__, backend=jax.default_backend(),
                             device=jax.devices()[0].device_kind,
                             host=platform.node(), date=time.strftime("%Y-%m-%d %H:%M:%S"), model=target.cfg.name,
                             init=f.init, drafter=f.drafter, block_size=block, reps=f.reps,
                             kernels=ops.uses_kernel()), rows=[])
    cases = itertools.product(inputs.temperatures, inputs.streams, inputs.budgets, inputs.exact)
    for temperature, num_streams, budget, exact in cases:
        if time.time() - start > f.time_budget_s:
            results["rows"].append(dict(budget="auto" if budget is None else budget, temperature=temperature,
                                        exact=exact, streams=num_streams, skipped="time budget"))
            continue
        spec = case_spec(budget, inputs.auto_budgets, temperature, block, f.rounds, f.rounds_per_check, exact)
        if spec.auto:
            row = measure_auto(decoder, target.cfg, spec, num_streams, f.prompt_len, f.seed)
            print_auto(row)
        else:
            row = measure(decoder, target.cfg, spec, num_streams, f.prompt_len, f.reps, f.seed)
            print_table([row])
        results["rows"].append(row)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    print()
    print_table([r for r in results["rows"] if "skipped" not in r and "stages_us" in r])
    for r in results["rows"]:
        if r.get("budget") == "auto" and "skipped" not in r:
            print_auto(r)
    results["meta"]["wall_s"] = time.time() - start
    with open(out, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    print(f"wrote {out} in {time.time() - start:.0f} s", flush=True)
    if f.plot:
        plot_stages(results, os.path.splitext(out)[0] + ".png")


def plot_stages(results: dict, path: str) -> None:
    """Stacked bars of the stage times of each measured case, next to one decode_round in one jit."""
    plt = plots.pyplot()
    rows = [r for r in results["rows"] if "stages_us" in r]
    labels = [f"{r['policy']} B={r['budget']} T={r['temperature']:g} S={r['streams']}"
              + (" exact" if r.get("exact") else "") for r in rows]
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.6 * len(rows)))
    left = np.zeros(len(rows))
    for stage in STAGES:
        width = np.array([r["stages_us"].get(stage, 0.0) for r in rows])
        ax.barh(labels, width, left=left, label=stage)
        left += width
    ax.scatter([r["round_us"] for r in rows], labels, color="black", marker="|", s=300, label="one round, one jit",
               zorder=3)
    ax.set_xlabel("device time per round (us)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    meta = results["meta"]
    ax.set_title(f"decode round by stage: {meta['model']} on {meta['device']}", fontsize=9)
    plots.save(fig, path)


if __name__ == "__main__":
    cli.script(define_flags, run)
