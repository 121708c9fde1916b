"""The house a newcomer finds: every file of experiments/ named in BUILD_NOTES, results by topic, each notes file
opening with `## Now` (current numbers linked to current results), and no markdown link that leads nowhere."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
RESULTS = EXPERIMENTS / "results"
NOTES = sorted((EXPERIMENTS / "notes").glob("*.md"))
NOW_WITHIN_LINES = 10  # `## Now` opens the notes file: within its first lines
NOW_MAX_LINES = 45  # and stays short: the current numbers and the open gaps, the history below
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _files(folder: pathlib.Path, skip=()) -> list[pathlib.Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and not any(part in p.relative_to(folder).parts for part in skip))


def _now_section(path: pathlib.Path) -> list[str]:
    lines = path.read_text().split("\n")
    start = lines.index("## Now")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _links(path: pathlib.Path, text: str | None = None) -> list[pathlib.Path]:
    text = path.read_text() if text is None else text
    return [(path.parent / m.group(1)).resolve() for m in LINK.finditer(text) if "://" not in m.group(1)]


def test_every_experiments_file_is_named_in_build_notes():
    guide = (ROOT / "BUILD_NOTES.md").read_text()
    unnamed = [str(p.relative_to(ROOT)) for p in _files(EXPERIMENTS, skip=("results", "notes"))
               if p.name != "__init__.py" and p.name not in guide]
    assert not unnamed, f"{unnamed}: name each file of experiments/ in BUILD_NOTES.md with its purpose, or delete it"


def test_results_live_in_topic_folders_without_patches():
    loose = [p.name for p in RESULTS.iterdir() if p.is_file()]
    assert not loose, f"{loose}: results go in experiments/results/<topic>/ (superseded ones in <topic>/archive/)"
    patches = [str(p.relative_to(RESULTS)) for p in _files(RESULTS) if p.suffix in (".patch", ".diff")]
    assert not patches, f"{patches}: a patch is code, not a result; git history keeps it"


@pytest.mark.parametrize("notes", NOTES, ids=lambda p: p.name)
def test_notes_open_with_a_short_now_linked_to_current_results(notes):
    lines = notes.read_text().split("\n")
    assert "## Now" in lines[:NOW_WITHIN_LINES], f"{notes.name}: open with a `## Now` section"
    now = _now_section(notes)
    assert len(now) <= NOW_MAX_LINES, f"{notes.name}: `## Now` has {len(now)} lines; keep it to the current state"
    results = [p for p in _links(notes, "\n".join(now)) if RESULTS in p.parents]
    stale = [str(p.relative_to(RESULTS)) for p in results if "archive" in p.relative_to(RESULTS).parts]
    assert not stale, f"{notes.name}: `## Now` links superseded results {stale}"


def test_markdown_links_lead_somewhere():
    docs = [ROOT / "README.md", ROOT / "BUILD_NOTES.md", *NOTES, ROOT / "tests" / "fixtures" / "README.md",
            ROOT / "checkpoints" / "README.md"]
    broken = [f"{d.relative_to(ROOT)} -> {p}" for d in docs for p in _links(d) if not p.exists()]
    assert not broken, broken
