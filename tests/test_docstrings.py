"""Every module says what it is in one sentence, briefly, and carries no timing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "pipesched"

MAX_FIRST_LINE = 100
MAX_LINES = 12

# A number followed by a unit of time or a percentage: "18 to 29 ms", "0.3 ms", "8%".
TIMING = re.compile(r"\d(?:[\d.,]*\d)?\s*(?:ms|s|µs|us|%)(?![\w])")

# issue 26: lead rewrites these modules now (their docstrings are too long or carry
# timings); remove each name once its rewrite lands.
EXEMPT: set[str] = set()

MODULES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def _docstring(rel: str) -> str:
    doc = ast.get_docstring(ast.parse((PACKAGE / rel).read_text()), clean=True)
    assert doc, f"{rel} has no module docstring"
    return doc


@pytest.mark.parametrize("rel", MODULES)
def test_a_module_docstring_opens_with_one_short_sentence(rel: str) -> None:
    if rel in EXEMPT:
        pytest.skip("issue 26: the lead rewrites this module")
    lines = _docstring(rel).splitlines()
    first = lines[0]
    assert len(first) < MAX_FIRST_LINE, f"{rel}: first line of {len(first)} chars"
    assert first.endswith("."), f"{rel}: first line is not a sentence: {first!r}"
    assert not re.search(r"[.!?]\s+[A-Z]", first), f"{rel}: first line of two sentences"
    assert len(lines) == 1 or lines[1] == "", f"{rel}: the first sentence runs past its line"
    assert len(lines) <= MAX_LINES, f"{rel}: docstring of {len(lines)} lines"


@pytest.mark.parametrize("rel", MODULES)
def test_a_module_docstring_carries_no_timing(rel: str) -> None:
    if rel in EXEMPT:
        pytest.skip("issue 26: the lead rewrites this module")
    found = TIMING.search(_docstring(rel))
    assert found is None, f"{rel}: {found.group(0)!r}: measurements belong in docs/, benchmarks/"


@pytest.mark.parametrize(
    "text",
    ["took 18 to 29 ms", "about 0.3 ms", "ran 8% slower", "1.3 us a call", "in 2.3 s"],
)
def test_the_timing_pattern_finds_a_measurement(text: str) -> None:
    assert TIMING.search(text)


@pytest.mark.parametrize("text", ["2 stages", "1F1B's peak", "p/3 shares", "sail-sg/zero-bubble"])
def test_the_timing_pattern_leaves_plain_numbers(text: str) -> None:
    assert not TIMING.search(text)
