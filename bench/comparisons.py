"""What the benchmarks that compare servers share (`bench.served_variants`, `bench.gpu_scaling`):
the jobs, each checked against the library's transcript, the run's header, and the plot of
every server's RTFx by concurrency."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.jobs import Job
from bench.references import with_references
from bench.served import MODELS, STATE_DIR, Settings, free_gpu_memory, make_jobs, served_checkpoint
from loadtest.provenance import provenance


def add_common_options(parser) -> None:
    """The options every comparison takes: where it writes, the load, the references, the time."""
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)),
                        help="client processes of the load generator (the same for every server)")
    parser.add_argument("--device", default="cuda", help="where the library decodes the reference transcripts")
    parser.add_argument("--tokens-per-second", type=float, help="forced lengths of random-weight models")
    parser.add_argument("--quick", action="store_true", help="short points: the CPU smoke run")
    parser.add_argument("--budget-s", type=float, default=560.0)


@dataclass(frozen=True)
class Prepared:
    settings: Settings
    checkpoint: str
    jobs: list[Job]


def prepare(args, say) -> Prepared:
    """The model's checkpoint and jobs, with the library's transcripts to compare with
    (args: model, quick, tokens_per_second, device, out)."""
    settings = Settings.quick() if args.quick else Settings()
    spec = MODELS[args.model]
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = served_checkpoint(spec)
    if spec.random and not args.tokens_per_second:
        raise SystemExit("random weights decode forced lengths: pass --tokens-per-second")
    jobs = with_references(make_jobs(spec, checkpoint, args.tokens_per_second, settings), checkpoint, args.device, say)
    free_gpu_memory()
    return Prepared(settings, checkpoint, jobs)


def header(program: str, args, jobs: list[Job], argv: list[str] | None) -> dict:
    """What every record of the run begins with: the model, provenance, the command, the clips."""
    return {"model": args.model, "run": provenance(), "clients": args.clients,
            "command": f"python -m {program} " + " ".join(argv if argv is not None else sys.argv[1:]),
            "clips": [job.describe() for job in jobs],
            "mean_clip_s": round(sum(j.audio.clip.duration_s for j in jobs) / len(jobs), 2)}


def best_point(record: dict) -> dict | None:
    """A server's point of the most good requests a second (failed points left out)."""
    points = [p for p in record["points"] if not p["failed"]]
    return max(points, key=lambda p: p["goodput_per_s"]) if points else None


def described_run(data: dict) -> str:
    """The record's first line: commit, machine, clients, clips and the command."""
    run = data["run"]
    return (f"Commit {run['commit']} (dirty: {run['dirty']}), {run['machine']['gpu']}, {run['machine']['cpu_count']} "
            f"CPUs; {data['clients']} client processes, {len(data['clips'])} clips (mean {data['mean_clip_s']} s); "
            f"command: `{data['command']}`.")


def plot_rtfx(series: list[tuple[str, list[dict]]], title: str, path: Path) -> None:
    """RTFx by concurrency, a line per (label, points) (failed points left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for label, points in series:
        counted = [p for p in points if not p["failed"]]
        axis.plot([p["concurrency"] for p in counted], [p["rtfx"] for p in counted], marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("requests in flight")
    axis.set_ylabel("RTFx (audio seconds per second)")
    axis.set_title(title)
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
