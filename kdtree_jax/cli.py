"""The entry point of every experiments/ script: absl flags, every input checked first, bad input reported in one line.

    from kdtree_jax import cli

    def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
        flags.DEFINE_integer("max_new_tokens", 32, "...", flag_values=fv)

    def check(f) -> Inputs:      # every input, before any weight is read or anything is compiled
        cli.at_least(f, "max_new_tokens", 1)
        ...

    def run(f) -> None:
        inputs = check(f)
        ...

    if __name__ == "__main__":
        cli.script(define_flags, run)

A bad flag value, or a ValueError / OSError raised while the script runs (the engine raises ValueError for every
input it refuses, naming the problem and the fix; OSError is a file that cannot be read, TimeoutError a join that did
not happen), prints `error: <message>` (one line) on stderr and exits with status 2, without a traceback. `--debug`
re-raises instead, traceback included. `refusal` runs the same parse + check in the calling process (no exit), which
is how the tests try every flag of every script with bad values without starting a process per case.

The flag checks here name the flag as the user typed it (`--budgets=4,x: 'x' is not an integer`), and the path checks
refuse an output that would be written over (without --overwrite), into a directory, or under a file. The process
flags (--coordinator, --num_processes, --process_id, --join_timeout_s) are shared by the scripts that can run over
several processes; `join_processes` says whom it waits for and gives up after --join_timeout_s.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import threading
import time
from typing import Any, Callable, NoReturn

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_bool("debug", False, "on bad input, raise with the Python traceback instead of printing one "
                  "'error: ...' line")

USAGE_EXIT_CODE = 2
INPUT_ERRORS = (ValueError, OSError)  # what the engine raises for input it refuses (see the module docstring)
MAX_INT = 2 ** 31 - 1  # an integer flag past this would overflow the int32 arrays it sizes
MAX_SEED = MAX_INT  # seeds go to jax.random.key, numpy and nnx.Rngs: all take this range


def run(main: Callable[[list[str]], object]) -> None:
    """absl's app.run(main) with bad flags and refused input reported as `error: <message>` (exit 2)."""
    app.run(_reporting_errors(main), flags_parser=_parse_flags)


def script(define_flags: Callable[[flags.FlagValues], None], run_script: Callable[[Any], object]) -> None:
    """Define the script's flags on the global FlagValues and run run_script(FLAGS) as `run` does; a positional
    argument (e.g. a value given without its --flag=) is refused."""
    define_flags(FLAGS)

    def main(argv):
        if len(argv) > 1:
            raise ValueError(f"unexpected argument {argv[1]!r}: every input is a flag (--name=value); see --help")
        return run_script(FLAGS)
    run(main)


def fail(message: str) -> NoReturn:
    """Print `error: <message>` on stderr and exit with status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_EXIT_CODE)


def message(error: BaseException) -> str:
    """The one line `run` prints (after 'error: ') for a refused input."""
    if isinstance(error, flags.Error):
        text = f"{error}; see --help for the flags"
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())  # one line, whatever the message held


def refusal(define_flags: Callable[[flags.FlagValues], None], check: Callable[[Any], object],
            argv: list[str]) -> str | None:
    """In this process: parse `argv` with the script's flags and run its check; the message `script` would print
    (without 'error: '), or None when the input is accepted. Any other exception propagates (it would be a
    traceback)."""
    fv = flags.FlagValues()
    define_flags(fv)
    try:
        rest = fv(["script", *argv])
        if len(rest) > 1:
            raise ValueError(f"unexpected argument {rest[1]!r}")
        check(fv)
    except (flags.Error, *INPUT_ERRORS) as e:
        return message(e)
    return None


def _reporting_errors(main):
    @functools.wraps(main)
    def wrapped(argv):
        try:
            return main(argv)
        except INPUT_ERRORS as e:
            if FLAGS.debug:
                raise
            fail(message(e))
    return wrapped


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return FLAGS(argv)
    except flags.Error as e:
        fail(message(e))


# ----------------------------------------------------------------------------------------------- flag checks

def shown(f, name: str) -> str:
    """`--name=value` as the user typed it (a list joined by commas)."""
    value = getattr(f, name)
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return f"--{name}={value}"


def refuse(f, name: str, why: str) -> NoReturn:
    raise ValueError(f"{shown(f, name)}: {why}")


def dataclass_fields(f, name: str, config_type) -> dict:
    """A flag of field=integer pairs (0 / 1 for a boolean field), a list or a comma-separated string (empty: none),
    e.g. `--tiling=block_n=64,fma=1` -> {field: value} of the dataclass config_type; refuses an unknown field or a
    value that is not an integer."""
    fields = {field.name: field.type for field in dataclasses.fields(config_type)}
    values = {}
    pairs = getattr(f, name)
    for pair in (pairs.split(",") if pairs else []) if isinstance(pairs, str) else pairs:
        field, sep, text = pair.partition("=")
        if not sep or field not in fields or not text.isdigit() or (fields[field] == "bool" and text not in "01"):
            refuse(f, name, f"{pair!r} is not field=integer (0 or 1 for a boolean) with a field of "
                            f"{config_type.__name__}: {sorted(fields)}")
        values[field] = bool(int(text)) if fields[field] == "bool" else int(text)
    return values


def at_least(f, name: str, minimum: int | float, why: str = "") -> None:
    """An integer or float flag (None allowed: 'not given') must be finite and >= minimum."""
    value = getattr(f, name)
    if value is None:
        return
    if not math.isfinite(value) or value < minimum:
        refuse(f, name, f"must be {'an integer' if isinstance(value, int) else 'a finite number'} >= {minimum}{why}")
    if isinstance(value, int) and value > MAX_INT:
        refuse(f, name, f"must be <= {MAX_INT}")


def at_most(f, name: str, maximum: int | float, why: str) -> None:
    value = getattr(f, name)
    if value is not None and value > maximum:
        refuse(f, name, f"must be <= {maximum}: {why}")


def seed(f, name: str = "seed") -> None:
    value = getattr(f, name)
    if not 0 <= value <= MAX_SEED:
        refuse(f, name, f"must lie in [0, {MAX_SEED}]")


def int_list(f, name: str, minimum: int) -> list[int]:
    """A list flag of integers >= minimum, at least one."""
    values = list(getattr(f, name) or [])
    if not values:
        refuse(f, name, "is empty; give at least one value")
    out = []
    for text in values:
        try:
            value = int(text.strip())
        except ValueError:
            refuse(f, name, f"{text!r} is not an integer")
        if not minimum <= value <= MAX_INT:
            refuse(f, name, f"{value} must lie in [{minimum}, {MAX_INT}]")
        out.append(value)
    return out


def budgets(f, name: str, minimum: int) -> list[int | None]:
    """A flag of tree budgets: 'auto' (None: chosen each round) or integers in [minimum, MAX_INT], at least one."""
    values = getattr(f, name)
    values = [values] if isinstance(values, str) else list(values or [])
    if not values:
        refuse(f, name, "is empty; give at least one value")
    out = []
    for text in (v.strip().lower() for v in values):
        if text == "auto":
            out.append(None)
        elif not text.isdigit() or not minimum <= int(text) <= MAX_INT:
            refuse(f, name, f"{text!r} must be 'auto' or an integer number of tree nodes B in [{minimum}, {MAX_INT}]")
        else:
            out.append(int(text))
    return out


def on_off(f, name: str) -> list[bool]:
    """A list flag of 'on' / 'off' (a mode timed one way or both: 'on,off'), each at most once -> [True / False]."""
    values = [v.strip().lower() for v in getattr(f, name) or []]
    if not values or any(v not in ("on", "off") for v in values) or len(set(values)) != len(values):
        refuse(f, name, "must be 'on', 'off' or 'on,off'")
    return [v == "on" for v in values]


def float_list(f, name: str, minimum: float) -> list[float]:
    """A list flag of finite numbers >= minimum, at least one."""
    values = list(getattr(f, name) or [])
    if not values:
        refuse(f, name, "is empty; give at least one value")
    out = []
    for text in values:
        try:
            value = float(text.strip())
        except ValueError:
            refuse(f, name, f"{text!r} is not a number")
        if not math.isfinite(value) or value < minimum:
            refuse(f, name, f"{text.strip()} must be a finite number >= {minimum}")
        out.append(value)
    return out


@contextlib.contextmanager
def about(f, name: str):
    """A ValueError / OSError raised inside (reading the file or directory a flag names) is reported with the flag
    in front: `--init=DIR: <what is wrong>` (unless its message starts with the flag at fault already)."""
    try:
        yield
    except INPUT_ERRORS as e:
        text = message(e)
        if text.startswith("--"):  # it names the flag at fault already
            raise
        raise ValueError(f"{shown(f, name)}: {text}") from None


# ----------------------------------------------------------------------------------------------- outputs

def define_overwrite(fv: flags.FlagValues) -> None:
    flags.DEFINE_bool("overwrite", False, "replace output files (or an output directory) that already exist",
                      flag_values=fv)


def output_path(f, name: str, *, directory: bool = False, path: str | None = None, may_exist: bool = False) -> None:
    """The path of flag `name` (or `path`, derived from it) can be written: not an existing directory (a file) or
    file (a directory), not under a file, in a writable place, and not there already unless --overwrite (or
    may_exist: the script reads it first, e.g. --append). '' is no output."""
    path = getattr(f, name) if path is None else path
    if not path:
        return
    where = shown(f, name) if path == getattr(f, name) else f"{shown(f, name)} ({path})"
    if directory and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{where} is a file; name a directory to write")
    if not directory and os.path.isdir(path):
        raise ValueError(f"{where} is a directory; name a file to write")
    if os.path.exists(path) and not may_exist and not getattr(f, "overwrite", False):
        raise ValueError(f"{where} exists; pass --overwrite to replace it, or name another path")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{where} cannot be written: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{where} cannot be written: no write permission in {parent}")


# ----------------------------------------------------------------------------------------------- processes

def define_process_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("coordinator", "", "host:port of process 0: join --num_processes processes with "
                        "jax.distributed before the mesh is made (one process per GPU or per host)", flag_values=fv)
    flags.DEFINE_integer("num_processes", 1, "processes joined at --coordinator", flag_values=fv)
    flags.DEFINE_integer("process_id", 0, "this process's index, 0 .. num_processes - 1 (with --coordinator)",
                         flag_values=fv)
    flags.DEFINE_float("join_timeout_s", 300.0, "give up joining the other processes after this many seconds",
                       flag_values=fv)


def check_process_flags(f) -> None:
    if not f.coordinator and (f.num_processes != 1 or f.process_id):
        refuse(f, "num_processes" if f.num_processes != 1 else "process_id",
               "needs --coordinator=host:port (process 0's address, the same for every process); without it this "
               "would run as one process alone")
    at_least(f, "num_processes", 1)
    if not 0 <= f.process_id < f.num_processes:
        refuse(f, "process_id", f"must lie in [0, --num_processes={f.num_processes})")
    if f.coordinator:
        host, _, port = f.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            refuse(f, "coordinator", "is not host:port (e.g. 10.0.0.1:8476 or 127.0.0.1:8476)")
    at_least(f, "join_timeout_s", 1)


def join_processes(f) -> None:
    """jax.distributed.initialize at --coordinator (nothing without it), saying on stderr whom this process waits
    for; after --join_timeout_s without every process joined, `error: ...` and exit 2 (JAX's own timeout aborts the
    process with a C++ stack trace, so a watchdog thread ends it first)."""
    if not f.coordinator:
        return
    import jax

    n, i, timeout = f.num_processes, f.process_id, f.join_timeout_s
    waits_for = (f"processes 1..{n - 1} to connect" if i == 0 else
                 f"process 0 at {f.coordinator} and the other {n - 2} processes" if n > 2 else
                 f"process 0 at {f.coordinator}")
    print(f"process {i} of {n}: joining at {f.coordinator}, waiting up to {timeout:g} s for {waits_for}",
          file=sys.stderr, flush=True)
    joined = threading.Event()
    start = time.monotonic()

    def watchdog():
        if not joined.wait(timeout):
            print(f"error: --coordinator={f.coordinator}: process {i} of {n} gave up after "
                  f"{time.monotonic() - start:.0f} s waiting for {waits_for}; start all --num_processes={n} "
                  f"processes with the same --coordinator (each with its own --process_id), or raise "
                  f"--join_timeout_s", file=sys.stderr, flush=True)
            os._exit(USAGE_EXIT_CODE)
    threading.Thread(target=watchdog, daemon=True).start()
    jax.distributed.initialize(coordinator_address=f.coordinator, num_processes=n, process_id=i,
                               initialization_timeout=int(timeout) + 60)
    joined.set()
