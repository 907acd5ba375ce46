"""Chosen load points of the served path, for A/B comparisons of server variants in one call.

    python -m bench.points --model tiny-random --tokens-per-second 2.732 --concurrency 1 256 512 --label base --out OUT
    python -m bench.points ... --engines 2 --label two-engines --out OUT
    python -m bench.points ... --env WHISPER_TRITON_SOMETHING=1 --label variant --out OUT

Starts `whisper-triton serve` (`--engines` per GPU; a copy of the repository when
`--instances` is given; `--env` is set for the server's processes), then measures each
concurrency as `bench.served` measures a sweep point: warm-up, a measured
window, every answer judged, Triton's per-model statistics at the window's
edges. Concurrency 1 sends only the clip nearest 5 s, as the latency target
does. Each invocation appends one variant to `--results` (default
OUT/points.json) and prints one line per point; variants measured one after
another on one machine are side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.load import LoadGenerator, PointPlan
from bench.repository_copy import add_instances_option, repository_with_instances
from bench.served import (
    MODELS,
    STATE_DIR,
    Settings,
    describe_point,
    latency_job,
    make_jobs,
    measure_point,
    served_checkpoint,
)
from bench.server_process import ServeCommand, ServerProcess
from loadtest.provenance import provenance


def environment_item(item: str) -> tuple[str, str]:
    """One --env item, NAME=VALUE, as argparse's `type`."""
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {item!r}")
    return name, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.points", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--tokens-per-second", type=float, help="forced lengths of random-weight models")
    parser.add_argument("--concurrency", type=int, nargs="+", required=True)
    parser.add_argument("--seconds", type=float, default=6.0, help="measured window per point")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--clients", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)))
    parser.add_argument("--label", required=True, help="the variant's name in the results")
    parser.add_argument("--env", action="append", type=environment_item, default=[], metavar="NAME=VALUE",
                        help="set for the server (repeatable)")
    parser.add_argument("--engines", type=int, help="whisper engines per GPU (`serve --engines`; default auto)")
    add_instances_option(parser)
    parser.add_argument("--out", type=Path, required=True, help="server logs and the results")
    parser.add_argument("--results", type=Path, help="the JSON variants are appended to (default OUT/points.json)")
    args = parser.parse_args(argv)
    args.results = args.results or args.out / "points.json"
    args.instances = dict(args.instances)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    spec = MODELS[args.model]
    checkpoint = served_checkpoint(spec)
    jobs = make_jobs(spec, checkpoint, args.tokens_per_second, Settings())
    repository = None
    if args.instances:
        repository = repository_with_instances(args.instances, STATE_DIR / f"points-{args.label}-repository")
    os.environ.update(dict(args.env))  # the server inherits it
    command = ServeCommand(checkpoint, repository, engines=args.engines)
    variant = {"label": args.label, "model": args.model, "env": dict(args.env), "engines": args.engines or "auto",
               "instances": {m: g.describe() for m, g in args.instances.items()}, **provenance(), "points": []}
    started = time.monotonic()
    with ServerProcess(command, args.out / f"points-{args.label}.log", 300.0) as server:
        variant["ready_s"] = server.ready_s
        for concurrency in args.concurrency:
            chosen = [latency_job(jobs)] if concurrency == 1 else jobs
            with LoadGenerator(command.grpc_url, [j.load_request() for j in chosen],
                               processes=1 if concurrency == 1 else args.clients) as load:
                plan = PointPlan(concurrency, args.warmup_s, args.seconds, 60.0)
                _, point = measure_point(load, plan, command.grpc_url)
            variant["points"].append(point)
            print(describe_point(f"[{args.label} {time.monotonic() - started:.0f} s]", point), flush=True)
    results = json.loads(args.results.read_text()) if args.results.exists() else {"variants": []}
    results["variants"].append(variant)
    args.results.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
