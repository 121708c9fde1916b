"""Where the tree-verify attention kernel's warps wait, from Nsight Compute's stall samples per SASS instruction.

On the GPU (the report's source page as CSV; `profile_attention.py`'s docstring has the ncu line for the summary):

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --kernel-name regex:tree_verify_attention_mgpu \
        --launch-skip 1 --launch-count 1 --section WarpStateStats --section SourceCounters -o REP \
        python3 experiments/kernels/profile_attention.py ...
    ncu --import REP.ncu-rep --page source --print-source sass --csv > REP.csv

then anywhere: `python3 experiments/kernels/ncu_stalls.py --csv=REP.csv --out=experiments/results/NAME.csv` writes the
per-instruction table (offset, SASS, samples, executions, stall reasons) and prints the breakdown (with `--json`
also writes it): each warpgroup's share of the samples (the producer and the two consumers, told apart by their
`setmaxnreg`), and within it what the warps wait for. A `SYNCS...TRYWAIT` (an mbarrier try-wait) and the branch that
retries it are classed by the barrier: in the producer, a free slot; in a consumer, a barrier at an address computed
at run time is a cache block's (the kernel reads each consumer's slot at run time), one at a fixed address that the
producer arms for a TMA load is the q tile's, any other fixed one the other warpgroup's (row max, p, sums). The
kernel's layout of `pallas_kernels/tree_verify_attention_mgpu.py` is assumed: one producer, consumers after it.
ptxas puts the try-waits' retry loops after the kernel's last EXIT; their samples, if any, are shown apart.
"""
from __future__ import annotations

import collections
import csv
import json
import os
import re

from absl import flags, logging

from kdtree_jax import cli

flags.DEFINE_string("csv", None, "ncu's source page of one kernel as CSV (`--page source --print-source sass --csv`)",
                    required=True)
flags.DEFINE_string("out", "", "where to write the per-instruction table (CSV; empty: not written)")
flags.DEFINE_string("json", "", "where to write the breakdown (JSON; empty: not written)")
F = flags.FLAGS

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
STALLS = ("long_sb", "barrier", "selected", "wait", "not_selected", "mio", "short_sb", "math", "no_inst", "lg",
          "dispatch", "branch_resolving", "membar", "sleep", "drain", "imc", "misc", "tex")
WAIT = re.compile(r"SYNCS\.PHASECHK\.TRANS64\.TRYWAIT P\d+, "
                  r"\[(?P<base>[UR]+\d+)(?:\+URZ)?(?:\+0x(?P<offset>[0-9a-f]+))?\]")
ARMED = re.compile(r"SYNCS\.ARRIVE\.TRANS64 RZ, \[UR\d+\+0x(?P<offset>[0-9a-f]+)\]")
RETRY_WINDOW = 5     # a try-wait's retry branch follows it within this many instructions
ORDER = ("prologue", "producer", "consumer", "retries")   # the regions in the order printed (by their first word)


def read_source_page(path: str) -> list[dict]:
    """ncu's source-page CSV -> one dict per SASS instruction: offset (from the kernel's first), sass, samples,
    executed and each stall reason's samples (`STALLS`)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 3 or rows[0][:1] != ["Kernel Name"] or SAMPLES not in rows[1]:
        raise ValueError(f"{path}: not an ncu source page of one kernel with stall samples (want its first line "
                         f"'Kernel Name', a header with {SAMPLES!r}: ncu --import REP --page source "
                         f"--print-source sass --csv of a report taken with --section SourceCounters)")
    header = {name: i for i, name in enumerate(rows[1])}
    base = int(rows[2][header["Address"]], 16)

    def count(row, name):
        i = header.get(name)
        return int(row[i]) if i is not None and row[i] not in ("", "-") else 0

    return [dict(offset=int(r[header["Address"]], 16) - base, sass=r[header["Source"]].strip(),
                 samples=count(r, SAMPLES), executed=count(r, EXECUTED),
                 **{s: count(r, f"stall_{s}") for s in STALLS}) for r in rows[2:]]


def breakdown(instructions: list[dict]) -> dict:
    """{warpgroup: {what: samples}}, the total, and the consumers' samples together as fractions ({what: share}), by
    the classes of the module docstring."""
    starts = [i["offset"] for i in instructions if "USETMAXREG" in i["sass"]]
    if len(starts) < 2:
        raise ValueError(f"{len(starts)} setmaxnreg instructions: not the warp-specialized attention kernel (a "
                         f"producer and consumers, each starting with one)")
    last_exit = max((i["offset"] for i in instructions if "EXIT" in i["sass"]), default=instructions[-1]["offset"])

    def region(offset):
        if offset > last_exit:
            return "retries out of line"
        if offset < starts[0]:
            return "prologue"
        if offset < starts[1]:
            return "producer"
        return f"consumer {sum(offset >= s for s in starts[1:]) - 1}"

    armed = {int(m["offset"], 16) for i in instructions if region(i["offset"]) == "producer"
             for m in [ARMED.search(i["sass"])] if m}
    shares = collections.defaultdict(collections.Counter)
    waiting, since = None, RETRY_WINDOW + 1
    for i in instructions:
        where, sass = region(i["offset"]), i["sass"]
        wait = WAIT.search(sass)
        if wait:
            since = 0
            if where == "producer":
                waiting = "a free slot"
            elif wait["offset"] is None or not wait["base"].startswith("UR"):
                waiting = "a cache block"
            else:
                waiting = "the q tile" if int(wait["offset"], 16) in armed else "the other warpgroup"
        since += 1
        if "BRA" in sass and since <= RETRY_WINDOW and waiting:
            what = f"waits for {waiting}"
        elif "WARPGROUP.DEPBAR" in sass:
            what = "waits for its wgmma"
        elif re.search(r"HGMMA|WARPGROUP\.ARRIVE", sass):
            what = "issues wgmma"
        elif re.search(r"UTMASTG|UBLKCP|UTMACMDFLUSH|DEPBAR\.LE SB0|CCTL", sass):
            what = "writes its partial"
        else:
            what = "softmax, statistics, other"
        if where in ("prologue", "producer", "retries out of line") and what != "waits for a free slot":
            what = "other"
        shares[where][what] += i["samples"]
    ordered = sorted(shares.items(), key=lambda item: ORDER.index(item[0].split()[0]))
    consumers = sum((c for w, c in shares.items() if w.startswith("consumer")), collections.Counter())
    own = sum(consumers.values())
    return dict(samples=sum(i["samples"] for i in instructions),
                warpgroups={w: {what: n for what, n in c.most_common() if n} for w, c in ordered},
                consumers={what: n / own for what, n in consumers.most_common()} if own else {})


def main(_):
    instructions = read_source_page(F.csv)
    result = breakdown(instructions)
    total = result["samples"]
    print(f"{F.csv}: {total} stall samples, {len(instructions)} SASS instructions")
    for where, what in result["warpgroups"].items():
        print(f"  {where:19s} {100 * sum(what.values()) / total:5.1f}%  "
              + ", ".join(f"{w} {100 * n / total:.1f}%" for w, n in what.items()))
    print("  the consumers' samples: " + ", ".join(f"{w} {100 * x:.0f}%" for w, x in result["consumers"].items()))
    if F.out:
        with open(F.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(instructions[0]))
            writer.writeheader()
            writer.writerows(instructions)
        logging.info("wrote %s", F.out)
    if F.json:
        with open(F.json, "w") as f:
            json.dump(dict(source=os.path.basename(F.csv), **result), f, indent=1)
        logging.info("wrote %s", F.json)


if __name__ == "__main__":
    cli.run(main)
