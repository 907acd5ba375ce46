"""Latency of one ~5 s clip at concurrency 1, in several rounds, for A/B comparisons of the server.

    python -m bench.latency_rounds --model tiny-random --tokens-per-second 2.732 --label freeze

Starts `whisper-triton serve` as shipped, warms it up, then measures `--rounds`
windows of `--seconds` each and prints one line per round (requests/s, p50,
p90, p99 in ms, and each model's mean time queued and in `execute` by Triton's
statistics). `bench.served` measures the same point once, inside its run.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.jobs import Job
from bench.load import LoadGenerator, PointPlan
from bench.model_phases import phase_means, settled_totals
from bench.served import MODELS, STATE_DIR, Settings, latency_job, make_jobs, served_checkpoint
from bench.server_process import ServeCommand, ServerProcess
from bench.stats import PointStats
from bench.triton_stats import settled_stats, stats_delta


@dataclass(frozen=True)
class Round:
    stats: PointStats  # the client's view of the window
    models: dict  # Triton's statistics over the window, per model (bench.triton_stats.stats_delta)
    request_ids: str  # what the ids of the window's requests start with, in Triton's trace
    phases: dict  # each model's own phases over the window, means in ms (`bench.model_phases`)


def one_clip_rounds(
    checkpoint: str, job: Job, log: Path, seconds: float, rounds: int, trace_file: Path | None = None
) -> Iterator[Round]:
    """Start `whisper-triton serve` as shipped, warm it up with `job`, then measure `rounds`
    windows of `seconds`, one request at a time: each window's statistics as it ends, the
    client's, Triton's per model and the preprocessing and whisper models' own phases (none
    of which needs a trace file, and so a clean stop).
    With trace_file, Triton traces every request into it (`bench.triton_trace.trace_files`)."""
    command = ServeCommand(checkpoint, trace_file=trace_file)
    with ServerProcess(command, log, 300.0):
        with LoadGenerator(command.grpc_url, [job.load_request()], processes=1) as load:
            load.run(PointPlan(1, 0.0, 3.0, 60.0))  # warm-up
            for _ in range(rounds):
                # Settled: the request before the window is counted before it, the window's last within it.
                before, totals = settled_stats(command.grpc_url), settled_totals(command.metrics_url)
                point = load.run(PointPlan(1, 0.0, seconds, 60.0))
                models = stats_delta(before, settled_stats(command.grpc_url))
                phases = phase_means(totals, settled_totals(command.metrics_url))
                yield Round(point.stats, models, point.request_ids, phases)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.latency_rounds", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--tokens-per-second", type=float, help="forced lengths of random-weight models")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--label", default="", help="printed at the start of each line")
    args = parser.parse_args(argv)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    spec = MODELS[args.model]
    checkpoint = served_checkpoint(spec)
    jobs = make_jobs(spec, checkpoint, args.tokens_per_second, Settings())
    log = STATE_DIR / f"latency-{args.label or 'server'}.log"
    for measured in one_clip_rounds(checkpoint, latency_job(jobs), log, args.seconds, args.rounds):
        latency = measured.stats.latency_ms
        models = " ".join(f"{name} {m['queue_ms']}+{m['execute_ms']}" for name, m in measured.models.items())
        print(
            f"{args.label} {measured.stats.goodput_per_s:.1f} req/s p50 {latency['p50']} p90 {latency['p90']} "
            f"p99 {latency['p99']} (ms queued+execute: {models})",
            flush=True,
        )


if __name__ == "__main__":
    main()
