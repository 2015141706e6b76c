"""docs/tour.md runs as written: its ```python blocks, in order, in one namespace; the tour's own asserts are
the checks. A traceback names the tour's file and line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.models import gemma3_path, smollm2_path

TOUR = Path(__file__).resolve().parent.parent / "docs" / "tour.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the block's first line of code, code) for every ```python block, in order."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in PYTHON_BLOCK.finditer(text)]


def run_blocks(text: str, filename: str) -> dict:
    """Execute the blocks in one namespace; each is compiled at its own line so tracebacks point into `filename`."""
    namespace: dict = {"__name__": "__tour__"}
    for line, code in python_blocks(text):
        exec(compile("\n" * (line - 1) + code, filename, "exec"), namespace)
    return namespace


def test_blocks_are_found_in_order_with_their_lines():
    text = "intro\n```python\nx = 1\n```\n\n```\nnot python\n```\n```python\ny = x + 1\nz = y\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = x + 1\nz = y\n")]
    assert run_blocks(text, "t.md")["z"] == 2


def test_a_failing_assert_in_a_block_fails_with_the_tour_line():
    text = "```python\na = 1\n```\ntext\n```python\nassert a == 2, 'drifted'\n```\n"
    with pytest.raises(AssertionError, match="drifted") as info:
        run_blocks(text, "t.md")
    assert info.traceback[-1].lineno + 1 == 6  # pytest's line numbers count from 0


def test_the_tour_runs_top_to_bottom(capsys):
    smollm2_path(), gemma3_path()  # skips when the packaged models are not installed
    text = TOUR.read_text()
    assert len(python_blocks(text)) >= 10
    ns = run_blocks(text, str(TOUR))
    out = capsys.readouterr().out
    assert "llama" in out and "' Paris'" in out
    assert ns["ours"].shape == (101, 576) and ns["err"] < 1e-3
