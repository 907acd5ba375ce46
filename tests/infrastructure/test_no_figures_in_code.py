"""The code says why; the records say how much. No comment or docstring of the server,
the gateway, the clients or a config.pbtxt holds a measured figure: a figure there is
never rerun, goes stale as the code changes, and names no commit. docs/ keeps them,
with machine, commit and how to rerun (docs/gpu.md, "Figures behind the defaults").

A measurement names its machine or a throughput: those are the marks looked for.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("python_backend_lib", "gateway", "clients", "whisper_triton")
MEASURED = re.compile(r"\b(H100|H200|A100|L4|EPYC|Xeon)\b|requests/s|req/s|\bRTFx\b|tokens/s")


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string that stands alone as a statement (docstrings)."""
    found = []
    previous = None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
        elif token.type == tokenize.STRING and (previous is None or previous.type in (tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT)):
            found += [(token.start[0] + i, line) for i, line in enumerate(token.string.splitlines())]
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            previous = token
    return found


def figures_in(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".pbtxt":
        lines = [(i, line) for i, line in enumerate(text.splitlines(), start=1) if "#" in line]
    else:
        lines = prose(text)
    return [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for i, line in lines if MEASURED.search(line)]


def test_a_measured_figure_in_a_comment_is_found():
    source = 'def f():\n    """Fast: 1,855 requests/s on an H100."""\n    x = "H100"  # a name, not prose\n    return x  # 8 ms on the EPYC\n'
    found = [(i, line) for i, line in prose(source) if MEASURED.search(line)]
    assert [i for i, _ in found] == [2, 4], found


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_comment_of_the_code_holds_a_measurement(folder):
    found = [hit for path in sorted((ROOT / folder).rglob("*.py")) for hit in figures_in(path)]
    assert not found, "figures belong in docs/, not in the code:\n" + "\n".join(found)


def test_no_config_comment_holds_a_measurement():
    found = [hit for path in sorted((ROOT / "model_repository").rglob("config.pbtxt")) for hit in figures_in(path)]
    assert not found, "figures belong in docs/, not in config.pbtxt:\n" + "\n".join(found)
