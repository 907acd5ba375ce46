"""bench/ and loadtest/ use the server's packages through their public names only.

A benchmark that reads a private attribute (`graphs._entries`) or patches a private
method (`batch._step_graph`) breaks silently when the engine is reorganised: the
name goes, and the benchmark fails on the GPU machine, where it is found last (the
breakdown of bench/gpu.py patched `_step_graph` long after the overlapped step had
removed it). So bench and loadtest import no `_name` from the server's packages and
reach no `_name` as an attribute, but on `self` and `cls` and the third-party names
FOREIGN lists.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("bench", "loadtest")
SERVER_PACKAGES = ("python_backend_lib", "clients", "gateway", "whisper_triton")
# Private names of other projects that they document for use, and why each is needed.
FOREIGN = {
    "_attn_implementation": "transformers' config: how its models are told to use SDPA attention",
    "_scaled_mm": "torch's FP8 product, the call fp8_linear makes: bench.fp8_products times it beside other scalings",
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str) -> list[str]:
    """Where `source` imports a private name of the server's packages, or reaches a
    private attribute of anything but `self` or `cls`: 'line: name' each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in SERVER_PACKAGES:
            found += [f"{node.lineno}: {alias.name}" for alias in node.names if is_private(alias.name)]
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in FOREIGN:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{node.lineno}: {node.attr}")
    return sorted(found, key=lambda use: int(use.split(":")[0]))


def test_a_reach_into_the_engine_is_found():
    source = (
        "from python_backend_lib.engine.batch import _failed\n"
        "from bench.report import _table\n"
        "entry = batch.graphs._by_batch[8]\n"
        "batch._step_graph = timed(batch._step_graph)\n"
        "self._finish()\n"
        "hf_config._attn_implementation = 'sdpa'\n"
    )
    assert private_uses(source) == ["1: _failed", "3: _by_batch", "4: _step_graph", "4: _step_graph"]


@pytest.mark.parametrize("tool", TOOLS)
def test_the_tools_use_public_names_only(tool):
    uses = {
        path.relative_to(ROOT).as_posix(): found
        for path in sorted((ROOT / tool).rglob("*.py"))
        if (found := private_uses(path.read_text(encoding="utf-8")))
    }
    assert not uses, f"private names used in {tool}/: {uses}"
