"""The project speaks of itself in the present: no tracked file (code, comments, tests, docs,
notebooks, file names) names a past round of work or a tracker's issue number. History lives in
git; where a comment needs provenance it gives a date or a commit.

The patterns are built from pieces so that this file does not match itself.
"""

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
             "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
             "thirtieth|fortieth|(?:twenty|thirty|forty)-\\w+|\\d+(?:st|nd|rd|th)")
_WORK = "sess" + "ion"
PATTERNS = [
    re.compile(r"\bissues?\s+#?\d+", re.I),  # a tracker's numbers
    re.compile(r"\bissues?" + r":\s", re.I),  # headings that name work items after a colon
    re.compile(rf"\b(?:{_ORDINALS})\s+(?:and\s+(?:{_ORDINALS})\s+)?{_WORK}s?\b", re.I),
    re.compile(rf"\b(?:this|last|previous|earlier|next|later|that)\s+{_WORK}(?:'s)?\b(?!\s*(?:fixture|scope))", re.I),
]
NAME_PATTERN = re.compile(rf"{_WORK}\d+|issue\d+", re.I)
BINARY = {".safetensors", ".gguf", ".png", ".gz", ".so"}


def tracked_files() -> list[pathlib.Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):  # an sdist or a copy without git: walk it
        return [p for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts and ".git" not in p.parts]


def offending_lines(text: str) -> list[tuple[int, str]]:
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
            if any(p.search(line) for p in PATTERNS)]


@pytest.mark.parametrize("line", [
    "as measured in the " + "twenty-fifth " + _WORK,
    "BENCHMARKS.md, " + "issue " + "11, item 2",
    "## Serving engine (" + "issue" + "s: " + "foundation)",
    "the plain fallback, as in the " + "last " + _WORK,
    "a run of the " + "12th " + _WORK,
])
def test_the_check_catches_history(line):
    assert offending_lines(line), line


@pytest.mark.parametrize("line", [
    "Session fixtures share one load of the real model",
    "scope=\"session\"",
    "measured 2026-12-05 (git 47a0ab1)",
    "a tissue of lies",  # not an issue number
])
def test_the_check_passes_the_present(line):
    assert not offending_lines(line), line


def test_no_tracked_file_names_past_work():
    found = []
    for path in tracked_files():
        rel = path.relative_to(ROOT)
        if NAME_PATTERN.search(str(rel)):
            found.append(f"{rel}: the file name")
        if path.suffix in BINARY or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{rel}:{n}: {line[:120]}" for n, line in offending_lines(text)]
    assert not found, "history in tracked files (give a date or a commit instead):\n" + "\n".join(found)
