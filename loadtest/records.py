"""The figures docs/operating.md quotes, stored under docs/benchmarks/ by the tool that measured them.

Each record is two files: `<prefix>.json`, the numbers with their provenance
(`loadtest.provenance`: the commit and whether the tree differed from it, the
machine, the date, the command), and `<prefix>.md`, the same in words for a reader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from loadtest import provenance


def origin() -> dict:
    """The provenance of this run, with the load average at its start: the machine may be shared."""
    return {**provenance.provenance(), "load_average": round(os.getloadavg()[0], 2)}


def describe(origin: dict) -> str:
    """One Markdown paragraph: what ran, where and when."""
    machine = origin["machine"]
    commit = origin["commit"] or "unknown"
    dirty = " (with uncommitted changes)" if origin["dirty"] else ""
    return (
        f"Measured {origin['date']} at commit `{commit[:12]}`{dirty} on {machine['cpu']}, "
        f"{machine['cpu_count']} cores, {machine['memory_gib']:.0f} GiB (load average {origin['load_average']:.1f} "
        f"at the start; the machine is shared), Python {machine['python']}, torch {machine['torch']}, "
        f"with `{origin['command']}`."
    )


def write_record(prefix: Path, title: str, origin: dict, results: dict, markdown: list[str]) -> list[Path]:
    """`<prefix>.json` and `<prefix>.md` (a title, `describe(origin)`, then `markdown`); the paths written."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = prefix.with_suffix(".json"), prefix.with_suffix(".md")
    json_path.write_text(json.dumps({"provenance": origin, **results}, indent=1) + "\n")
    text = [f"# {title}", "", describe(origin), "", *markdown, "", f"The numbers: `{json_path.name}`."]
    markdown_path.write_text("\n".join(text) + "\n")
    return [json_path, markdown_path]
