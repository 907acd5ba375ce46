"""One server on one GPU against the same server on several, in one run: what a second GPU adds.

    python -m bench.gpu_scaling --model tiny --gpus 0 0,1 --out OUT     # scripts/gpu_run.sh scaling

For each `--gpus` value in turn, `whisper-triton serve --gpus <value>` serves the
same clips to the same load generator (the same client processes), swept by
doubling concurrency from `--start` until two points in a row fall short of the
best goodput (or `--max-concurrency`): several GPUs saturate at a higher
concurrency than one, so each sweep runs past its own peak.
Each point records, besides the load generator's figures, what could be the
limit: the host's busy cores, each role's processes (tritonserver, every
model's stubs: the busiest one near 1.0 core is bound by its interpreter lock),
the load generator's own CPU, and each GPU's utilisation. The scaling is the
best goodput of the last value over the first's.

Writes `gpu-scaling.json` and `gpu-scaling.md` (the table, the ratio and the
readings at each best point) and `gpu-scaling.png` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.comparisons import add_common_options, best_point, described_run, header, plot_rtfx, prepare
from bench.load import LoadGenerator, PointPlan
from bench.served import (
    POINT_MARGIN_S,
    Settings,
    describe_point,
    measure_point,
)
from bench.served_variants import parse_variant, repository_for
from bench.server_process import ServeCommand, ServerProcess
from bench.stats import PointStats, saturation

RESULTS = "gpu-scaling.json"


def say(message: str) -> None:
    print(f"[bench.gpu_scaling {time.strftime('%H:%M:%S')}] {message}", flush=True)


def sweep_one(gpus: str, checkpoint: str, requests: list, args, settings: Settings, deadline: float) -> dict:
    """One server on `gpus`, swept from args.start; its record."""
    repository = repository_for(args.variant) if args.variant else args.model_repository
    variant = args.variant
    command = ServeCommand(checkpoint, repository, gpus, checkout=variant and variant.checkout, mps=variant.mps if variant else None)
    log_path = args.out / f"scaling-gpus-{gpus.replace(',', '-')}.log"
    record: dict = {"gpus": gpus, "command": command.display, "points": [], "log": log_path.name}
    say(f"--gpus {gpus}: starting {command.display}")
    with ServerProcess(command, log_path, settings.startup_s) as server:
        record["ready_s"] = server.ready_s
        measured: list[PointStats] = []
        with LoadGenerator(command.grpc_url, requests, processes=args.clients) as load:
            concurrency = args.start
            while concurrency <= args.max_concurrency:
                if deadline - time.monotonic() < settings.warmup_s + settings.point_s + POINT_MARGIN_S:
                    record["stopped"] = f"out of time before concurrency {concurrency}"
                    break
                plan = PointPlan(concurrency, settings.warmup_s, settings.point_s, settings.timeout_s)
                result, point = measure_point(load, plan, command.grpc_url)
                record["points"].append(point)
                measured.append(result.stats)
                say(describe_point(f"--gpus {gpus}", point) + f", server {point['server_cores']}, "
                    f"GPUs {point['gpus_utilisation_pct']} %")
                if past_peak(measured):
                    break
                concurrency *= 2
        found = saturation(measured)
        record["saturation"] = asdict(found) if found else None
    return record


def past_peak(points: list[PointStats], after: int = 2) -> bool:
    """The sweep's best goodput came `after` points ago or earlier (failed points do not count)."""
    counted = [p.goodput_per_s for p in points if not p.failed]
    return bool(counted) and counted.index(max(counted)) <= len(counted) - 1 - after


def memory_total(point: dict) -> str:
    """The server's host memory at a point's end, every role's together (points measured before it was recorded: -)."""
    memory = point.get("server_memory_gib")
    return f"{sum(memory.values()):.1f}" if memory else "-"


def identical(point: dict) -> str:
    """Answers equal to the library's transcript of their clip decoded alone: all of them, then
    those with a sampled (fallback) window (points measured before these were compared: -)."""
    if not point.get("compared"):
        return "-"
    text = f"{point['exact']} of {point['compared']}"
    if "compared_sampled" in point:
        text += f" (sampled {point['exact_sampled']} of {point['compared_sampled']})"
    return text


def markdown(data: dict) -> str:
    lines = [f"# One server on {' against '.join(r['gpus'] for r in data['servers'])} GPUs ({data['model']})", "",
             described_run(data), "",
             "| --gpus | concurrency | good req/s | RTFx | p50 ms | p99 ms | host cores busy | load generator cores "
             "| server cores by role (busiest process) | server host memory GiB | GPU busy % | identical to alone |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for record in data["servers"]:
        for p in record["points"]:
            roles = ", ".join(f"{role} {r['cores']} ({r['busiest']})" for role, r in p["server_cores"].items())
            lines.append(f"| {record['gpus']} | {p['concurrency']} | {p['goodput_per_s']} | {p['rtfx']} | "
                         f"{p['latency_ms']['p50']} | {p['latency_ms']['p99']} | {p['host_busy_cores']} | "
                         f"{p['client_cpu_cores']} | {roles} | {memory_total(p)} | {p['gpus_utilisation_pct']} | "
                         f"{identical(p)} |")
    lines += ["", f"**Scaling: {data.get('scaling')}** (best goodput of `--gpus {data['servers'][-1]['gpus']}` over "
              f"`--gpus {data['servers'][0]['gpus']}`)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_scaling", description=__doc__.split("\n\n")[0])
    add_common_options(parser)
    parser.add_argument("--gpus", nargs="+", default=["0", "0,1"], help="`serve --gpus` values, compared in this order")
    parser.add_argument("--start", type=int, default=64, help="the first concurrency of each sweep")
    parser.add_argument("--max-concurrency", type=int, default=4096, help="the last concurrency of a sweep at most")
    parser.add_argument("--model-repository", type=Path)
    parser.add_argument("--variant", type=parse_variant, metavar="LABEL=SPEC",
                        help="serve this variant of the repository (as bench.served_variants takes it)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    prepared = prepare(args, say)
    settings, checkpoint, jobs = prepared.settings, prepared.checkpoint, prepared.jobs
    requests = [job.load_request() for job in jobs]
    data = {**header("bench.gpu_scaling", args, jobs, argv), "variant": args.variant.spec if args.variant else None,
            "servers": []}
    say(f"{len(requests)} clips, mean {data['mean_clip_s']} s; {args.clients} client processes")
    for index, gpus in enumerate(args.gpus):
        left = len(args.gpus) - index
        share_deadline = time.monotonic() + (deadline - time.monotonic()) / left
        try:
            data["servers"].append(sweep_one(gpus, checkpoint, requests, args, settings, share_deadline))
        except Exception as error:  # keep the other servers' records
            data["servers"].append({"gpus": gpus, "points": [], "error": f"{type(error).__name__}: {error}"})
            say(f"--gpus {gpus} failed: {error}")
        bests = [best_point(r) for r in data["servers"]]
        if bests[0] and bests[-1]:
            data["scaling"] = round(bests[-1]["goodput_per_s"] / bests[0]["goodput_per_s"], 3)
        (args.out / RESULTS).write_text(json.dumps(data, indent=1))
    (args.out / "gpu-scaling.md").write_text(markdown(data))
    plot_rtfx([(f"--gpus {r['gpus']}", r["points"]) for r in data["servers"]],
              f"{data['model']}: one server on one GPU and on several, {data['run']['machine']['gpu']}",
              args.out / "gpu-scaling.png")
    say(f"scaling {data.get('scaling')}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
