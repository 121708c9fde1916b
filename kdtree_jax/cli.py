"""The entry point of every experiments/ script: absl flags, and bad input reported in one line.

    from kdtree_jax import cli
    ...
    if __name__ == "__main__":
        cli.run(main)

A bad flag value, or a ValueError / OSError raised while the script runs (the engine raises ValueError for every
input it refuses, naming the problem and the fix; OSError is a file that cannot be read), prints
`error: <message>` on stderr and exits with status 2, without a traceback. `--debug` re-raises instead, traceback
included.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable, NoReturn

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_bool("debug", False, "on bad input, raise with the Python traceback instead of printing one "
                  "'error: ...' line")

USAGE_EXIT_CODE = 2
INPUT_ERRORS = (ValueError, OSError)  # what the engine raises for input it refuses (see the module docstring)


def run(main: Callable[[list[str]], object]) -> None:
    """absl's app.run(main) with bad flags and refused input reported as `error: <message>` (exit 2)."""
    app.run(_reporting_errors(main), flags_parser=_parse_flags)


def fail(message: str) -> NoReturn:
    """Print `error: <message>` on stderr and exit with status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_EXIT_CODE)


def _reporting_errors(main):
    @functools.wraps(main)
    def wrapped(argv):
        try:
            return main(argv)
        except INPUT_ERRORS as e:
            if FLAGS.debug:
                raise
            fail(str(e) or type(e).__name__)
    return wrapped


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return FLAGS(argv)
    except flags.Error as e:
        fail(f"{e}; see --help for the flags")
