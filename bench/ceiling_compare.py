"""The ceiling phase of several `bench.served` runs side by side: one table and one plot.

    python -m bench.ceiling_compare docs/benchmarks/ceiling/*.json --out docs/benchmarks/ceiling

Each results file holds one run of `--phases ceiling` with its own instance
groups (`--instances`); the comparison is fair only between runs of one call
on one machine, which the table shows (commit, machine, date per run).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from bench.markdown import markdown_table


@dataclass(frozen=True)
class Variant:
    """One run's ceiling sweep and what it served."""

    name: str  # the results file's stem
    run: dict
    points: list[dict]

    @property
    def instances(self) -> str:
        groups = self.run.get("instances") or {}
        described = [f"{model} x{group['count']}" + (f" ({group['kind']})" if group.get("kind") else "")
                     for model, group in groups.items()]
        return ", ".join(described) or "as the commit ships them"

    @property
    def best(self) -> dict:
        return max(self.points, key=lambda p: p["goodput_per_s"])


def load_variant(path: Path) -> Variant:
    data = json.loads(path.read_text())
    (run,) = data["runs"]
    (model,) = data["models"].values()
    ceiling = model.get("ceiling") or {}
    if ceiling.get("error") or not ceiling.get("points"):
        raise ValueError(f"{path}: no ceiling sweep ({ceiling.get('error', 'no points')})")
    return Variant(path.stem, run, ceiling["points"])


def markdown(variants: list[Variant]) -> str:
    lines = ["# The ceiling with other instance counts", "",
             "`bench.served --phases ceiling`: the ensemble with a stand-in `whisper` that answers at once, "
             "so requests/s is what Triton and the preprocessing model carry. "
             "Made by `python -m bench.ceiling_compare`; the numbers are in the JSON files beside this one.", ""]
    lines.append(markdown_table(
        ["variant", "instances", "best req/s", "at concurrency", "p50 ms there", "host cores busy there",
         "commit", "machine", "date", "command"],
        [[v.name, v.instances, v.best["goodput_per_s"], v.best["concurrency"], v.best["latency_ms"]["p50"],
          v.best["host_busy_cores"], v.run["commit"][:10],
          f"{v.run['machine']['gpu'] or 'CPU'}, {v.run['machine']['cpu_count']} CPUs", v.run["date"],
          f"`{v.run['command']}`"] for v in variants]))
    concurrencies = sorted({p["concurrency"] for v in variants for p in v.points})
    lines += ["", "Good requests/s (p50 ms) by concurrency:", ""]
    rows = []
    for c in concurrencies:
        cells = []
        for v in variants:
            point = next((p for p in v.points if p["concurrency"] == c), None)
            cells.append(f"{point['goodput_per_s']} ({point['latency_ms']['p50']})" if point else None)
        rows.append([c, *cells])
    lines.append(markdown_table(["concurrency", *(v.name for v in variants)], rows))
    return "\n".join(lines) + "\n"


def plot(variants: list[Variant], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.8))
    for v in variants:
        axis.plot([p["concurrency"] for p in v.points], [p["goodput_per_s"] for p in v.points], marker="o",
                  label=f"{v.name}: {v.instances}")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("requests in flight (concurrency)")
    axis.set_ylabel("good requests/s")
    machines = sorted({v.run["machine"]["gpu"] or "CPU" for v in variants})
    axis.set_title(f"ceiling (stand-in whisper), {', '.join(machines)}")
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ceiling_compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results JSON files, one ceiling run each, in table order")
    parser.add_argument("--out", type=Path, required=True, help="writes ceiling.md and ceiling.png here")
    args = parser.parse_args(argv)
    variants = [load_variant(path) for path in args.results]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ceiling.md").write_text(markdown(variants))
    plot(variants, args.out / "ceiling.png")


if __name__ == "__main__":
    main()
