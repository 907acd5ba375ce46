"""One ~5 s clip alone through the engine, several versions of it side by side: a record with
its table and plot, from `bench.latency_breakdown` runs.

    python -m bench.latency_variants --out OUT --model tiny-random large-v3 --tokens-per-second 2.732 \
        --rounds 3 --variant before=.before --variant after=. --cpus 0-7
    python -m bench.latency_variants --out docs/benchmarks/latency/NAME \
        "before=RUNS/tiny-before-1/latency-breakdown.json" "after=RUNS/tiny-after-1/latency-breakdown.json" ...
    python -m bench.latency_variants --out docs/benchmarks/latency/NAME --from-record NAME/latency-variants.json

With `--variant LABEL=DIR`, it runs them: for each model, `--rounds` rounds of every
variant in turn, each run `bench.latency_breakdown` in a process of its own started in
DIR (a `git archive` of another commit's python_backend_lib with its COMMIT, or `.` for
this repository), so that Python imports DIR's library first: the working folder comes
before PYTHONPATH, so a run started here with DIR on PYTHONPATH would import this
repository's library instead. PYTHONPATH holds this repository, for `bench` itself;
`--cpus` pins every run to the same cores; each run's own files go under OUT/runs.
Otherwise each input is LABEL=PATH of a run made before.

Runs of one label and model are repeats, interleaved with the others', so that their
spread shows the host's. A run's code is the checkout it ran from
(`latency_breakdown.library_record`), else the run's commit. Writes latency-variants.json
(the runs, labelled), latency-variants.md and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.large_models import labelled
from bench.markdown import markdown_table


def code(run: dict) -> str:
    """The checkout's commit, else the run's, "(changed)" where the run's tree differed from it."""
    checkout = run.get("library", {}).get("checkout_commit")
    if checkout:
        return checkout[:7]
    made = run["provenance"]
    return (made["commit"] or "?")[:7] + (" (changed)" if made.get("dirty") else "")


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


def step_parts(runs: list[dict]) -> list[str]:
    """The engine thread's labels of the decoder step, of the checkpoint before it and of the
    step's parts that every run has, in the first run's order (versions may split a step
    otherwise: the checkpoint took over a part's work on 2026-12-02)."""
    from bench.latency_breakdown import CHECKPOINT, STEP, STEP_PART

    threads = [run["record"]["engine"].get("engine_thread") or {} for run in runs]
    return [name for name in threads[0] if (name in (STEP, CHECKPOINT) or name.startswith(STEP_PART))
            and all(name in thread for thread in threads)]


def host_rows(runs: list[dict]) -> list[list]:
    """Per model and label, the engine thread's host time a call of the decoder step and of
    each of its parts (us, mean over the runs), and beside it the mean of each run's time
    against that run's admission (`latency_breakdown.ADMIT`). A host's pace drifts from run
    to run; admission's code is the same in both versions of a change to the steps, so the
    ratio shows the change where the p50 is lost in the drift. Empty when a run lacks them."""
    from bench.latency_breakdown import ADMIT

    parts = step_parts(runs)  # those every run has
    if not parts or not all(ADMIT in (run["record"]["engine"].get("engine_thread") or {}) for run in runs):
        return []
    table = []
    for (model, label), records in grouped(runs).items():
        calls = [r["engine"]["engine_thread"] for r in records]
        row: list = [model, label]
        for name in parts:
            micros = statistics.mean(1e3 * c[name]["ms_per_call"] for c in calls)
            against = statistics.mean(c[name]["ms_per_call"] / c[ADMIT]["ms_per_call"] for c in calls)
            row.append(f"{micros:.1f} ({against:.3f})")
        table.append(row)
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
    if host := host_rows(data["runs"]):
        from bench.latency_breakdown import STEP_PART

        names = [name.removeprefix(STEP_PART) for name in step_parts(data["runs"])]
        lines += ["", "The engine thread's host time a call, us (mean over the runs), and in brackets each run's "
                  "time against its own admission's, averaged: admission's code is the same in every version, so "
                  "the bracket shows a change to a step's host work where the host's pace drifts.", "",
                  markdown_table(["model", "variant", *names], host)]  # fmt: skip
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


def variant(text: str) -> tuple[str, Path]:
    """LABEL=DIR, as argparse's `type`: DIR a folder holding a python_backend_lib."""
    label, path = labelled(text)
    if not (path / "python_backend_lib").is_dir():
        raise argparse.ArgumentTypeError(f"{path} holds no python_backend_lib to run")
    return label, path


def run_variants(args, say=print) -> list[dict]:
    """Every model's rounds of every variant in turn, each a `bench.latency_breakdown` of its own."""
    from loadtest.provenance import REPO_ROOT

    # The repository first on PYTHONPATH for `bench` itself; the library comes from `folder`.
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))}
    runs = []
    for model in args.model:
        for round_ in range(1, args.rounds + 1):
            for label, folder in args.variant:
                out = args.out / "runs" / f"{model}-{label}-{round_}"
                command = [sys.executable, "-m", "bench.latency_breakdown", "--model", model, "--out", str(out.resolve()),
                           *(["--tokens-per-second", str(args.tokens_per_second)] if args.tokens_per_second else []),
                           *args.breakdown_args]  # fmt: skip
                if args.cpus:
                    command = ["taskset", "-c", args.cpus, *command]
                subprocess.run(command, cwd=folder, env=environ, check=True, stdout=subprocess.DEVNULL)
                record = json.loads((out / "latency-breakdown.json").read_text(encoding="utf-8"))
                runs.append({"label": label, "record": record})
                say(f"[latency-variants] {model} {label} round {round_}: p50 "
                    f"{record['engine']['latency_ms']['p50']} ms, code {code(record)}")  # fmt: skip
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--from-record", type=Path, help="a latency-variants.json written before: drawn again")
    parser.add_argument("--note", help="how the runs were made, where their commands do not say it all")
    parser.add_argument("runs", type=labelled, nargs="*", help="LABEL=PATH of bench.latency_breakdown")
    parser.add_argument("--variant", type=variant, action="append", default=[], metavar="LABEL=DIR",
                        help="run bench.latency_breakdown from DIR's library (`.`: this repository's)")
    parser.add_argument("--model", nargs="+", default=["tiny-random"], help="with --variant")
    parser.add_argument("--tokens-per-second", type=float, help="with --variant: forced lengths of random weights")
    parser.add_argument("--rounds", type=int, default=3, help="with --variant")
    parser.add_argument("--cpus", help="with --variant: taskset's list of cores for every run, e.g. 0-7")
    parser.add_argument("--breakdown-args", nargs=argparse.REMAINDER, default=[],
                        help="with --variant: the rest of the line goes to each bench.latency_breakdown")
    args = parser.parse_args(argv)
    if args.from_record:
        data = json.loads(args.from_record.read_text(encoding="utf-8"))
    elif args.variant:
        from loadtest.provenance import invocation

        data = {"runs": run_variants(args), "note": args.note or f"`{invocation()}`"}
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
