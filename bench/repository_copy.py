"""Variants of the model repository for a benchmark: a copy, with a model replaced
(bench.standin) or other instance counts (--instances of bench.cpu and bench.served)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path


def copy_repository(directory: Path, source: Path | None = None) -> Path:
    """Copy the model repository `source` (default: the packaged one) to `directory`, emptied first."""
    from python_backend_lib.apps.server import packaged_model_repository

    source = source or packaged_model_repository()
    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(source, directory, ignore=shutil.ignore_patterns("__pycache__"))
    return directory


def parse_instances(items: list[str]) -> dict[str, int]:
    """`MODEL=COUNT` items (the benchmarks' --instances) as {model: count}."""
    counts = {}
    for item in items:
        model, _, count = item.partition("=")
        if not model or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--instances takes MODEL=COUNT with a count of 1 or more, e.g. preprocessing=4; got {item!r}")
        counts[model] = int(count)
    return counts


def repository_with_instances(counts: dict[str, int], directory: Path, source: Path | None = None) -> Path:
    """A copy of the repository where each named model has `count` instances."""
    copy_repository(directory, source)
    for model, count in counts.items():
        config = directory / model / "config.pbtxt"
        text, n = re.subn(r"count:\s*\d+", f"count: {count}", config.read_text())
        if n != 1:
            raise ValueError(f"{config}: expected one instance count, found {n}")
        config.write_text(text)
    return directory
