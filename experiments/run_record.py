"""What a benchmark script records of its run: the code's revision, and its JSON results written where asked."""
from __future__ import annotations

import json
import os
import subprocess


def code_version() -> str:
    """The code's revision: a REV file at the root (a copy of the tree made for a device run, without git), else git's
    short HEAD (with '+changes' when the tree differs from it), else 'unknown'."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rev = os.path.join(root, "REV")
    if os.path.exists(rev):
        with open(rev) as f:
            return f.read().strip()
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def write_json(path: str, results: dict) -> None:
    """results as indented JSON at path (its directory made; values JSON cannot hold written as strings)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
