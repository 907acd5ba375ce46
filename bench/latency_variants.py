"""One ~5 s clip alone through the engine, several versions of it side by side: a record with
its table and plot, from `bench.latency_breakdown` runs.

    python -m bench.latency_variants --out docs/benchmarks/latency/NAME \
        "before=RUNS/tiny-before-1/latency-breakdown.json" "after=RUNS/tiny-after-1/latency-breakdown.json" ...
    python -m bench.latency_variants --out docs/benchmarks/latency/NAME --from-record NAME/latency-variants.json

Each input is LABEL=PATH; runs of one label and model are repeats, interleaved with the
others' in the call that made them, so that their spread shows the host's. A run's code
is the checkout it ran from (`latency_breakdown.library_record`), else the run's commit.
Writes latency-variants.json (the runs, labelled), latency-variants.md and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.large_models import labelled
from bench.markdown import markdown_table


def code(run: dict) -> str:
    return (run.get("library", {}).get("checkout_commit") or run["provenance"]["commit"] or "?")[:7]


def grouped(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Runs by (model, label), in the order first seen."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["record"]["model"], run["label"]), []).append(run["record"])
    return groups


def rows(runs: list[dict]) -> list[list]:
    table = []
    for (model, label), records in grouped(runs).items():
        p50s = [r["engine"]["latency_ms"]["p50"] for r in records]
        kernels = records[0]["engine"]["kernels"]
        busy = statistics.mean(r["engine"]["kernels"]["gpu_busy_ms_per_request"] for r in records)
        table.append([model, label, ", ".join(sorted({code(r) for r in records})), " / ".join(map(str, p50s)),
                      round(statistics.mean(p50s), 2), kernels["kernels_per_step"], round(busy, 3)])  # fmt: skip
    return table


def markdown(data: dict) -> str:
    first = data["runs"][0]["record"]
    made = first["provenance"]
    lines = [
        "# One ~5 s clip alone through the engine, version beside version",
        "",
        f"{first['machine']}; the engine alone (`Pipeline`, no Triton), one request at a time, the clip of "
        f"{first['clip_s']} s; random weights decoding forced lengths. Call of {made['date']}, "
        f"`{made.get('call') or 'by hand'}`; runs interleaved, labels in turn. Each run's command is in "
        "latency-variants.json.",
        "",
        *([data["note"], ""] if data.get("note") else []),
        markdown_table(["model", "variant", "code", "p50 ms, each run", "p50 mean", "kernels a graph step",
                        "GPU busy ms a request"], rows(data["runs"])),  # fmt: skip
    ]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = grouped(data["runs"])
    models = list(dict.fromkeys(model for model, _ in groups))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        labels = [label for m, label in groups if m == model]
        for x, label in enumerate(labels):
            p50s = [r["engine"]["latency_ms"]["p50"] for r in groups[model, label]]
            busy = [r["engine"]["kernels"]["gpu_busy_ms_per_request"] for r in groups[model, label]]
            ax.scatter([x] * len(p50s), p50s, color="tab:blue", label="p50, each run" if x == 0 else None)
            ax.scatter([x] * len(busy), busy, color="tab:orange", marker="_", s=300,
                       label="GPU busy a request" if x == 0 else None)  # fmt: skip
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlim(-0.5, len(labels) - 0.5)
        ax.set_ylim(bottom=0)
        ax.set_title(model)
        ax.set_ylabel("ms")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--from-record", type=Path, help="a latency-variants.json written before: drawn again")
    parser.add_argument("--note", help="how the runs were made, where their commands do not say it all")
    parser.add_argument("runs", type=labelled, nargs="*", help="LABEL=PATH of bench.latency_breakdown")
    args = parser.parse_args(argv)
    if args.from_record:
        data = json.loads(args.from_record.read_text(encoding="utf-8"))
    elif args.runs:
        data = {"runs": [{"label": label, "record": json.loads(path.read_text(encoding="utf-8"))}
                         for label, path in args.runs], "note": args.note}  # fmt: skip
    else:
        parser.error("LABEL=PATH runs are needed, unless --from-record")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.from_record:
        (args.out / "latency-variants.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    (args.out / "latency-variants.md").write_text(markdown(data), encoding="utf-8")
    plot(data, args.out / "latency-variants.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
