"""Every whisper engine answers its share: one long load point per server variant, judged per instance.

    python -m bench.instance_balance --gpus 0,1 --variant mps=mps:on --variant no-mps=mps:off \\
        --concurrency 1024 --seconds 60 --out OUT

For each variant in turn (as `bench.served_variants` takes them: `mps:on`,
`log_mel_output:host`, `whisper=4`...), `whisper-triton serve --gpus ...` serves
the bench's clips to the load generator at `--concurrency` for `--seconds`, every
request with a timeout and every one counted (no warm-up: a stall comes with the
first requests). Then each `whisper` instance's answered requests are read
from the metrics: one that answered less than FAIR_SHARE of the mean is stalled,
whatever the total says. While one is, or a request went unanswered, py-spy (when
installed) dumps every whisper stub's stacks, native frames included, into OUT.

Writes `instance-balance.json` and `instance-balance.md` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.comparisons import add_common_options, described_run, header, prepare
from bench.load import LoadGenerator, PointPlan
from bench.served import describe_point, measure_point
from bench.served_variants import parse_variant, repository_for
from bench.server_process import ServeCommand, ServerProcess
from loadtest.metrics import per_instance
from loadtest.processes import stub_processes
from python_backend_lib.contract import tensor_names

RESULTS = "instance-balance"
# An instance that answered less than this share of the mean per instance is stalled.
FAIR_SHARE = 0.25
# After the point, requests still held this long are lost: nothing answers them.
SETTLE_S = 15.0


def say(message: str) -> None:
    print(f"[bench.instance_balance {time.strftime('%H:%M:%S')}] {message}", flush=True)


def stalled(answered: dict[str, float]) -> list[str]:
    """The instances that answered less than FAIR_SHARE of the mean."""
    if not answered:
        return []
    mean = sum(answered.values()) / len(answered)
    return sorted(name for name, count in answered.items() if count < FAIR_SHARE * mean)


def dump_stacks(grpc_port: int, path: Path) -> None:
    """Every whisper stub's threads, Python and native frames, by py-spy (skipped without it)."""
    spy = shutil.which("py-spy")
    if spy is None:
        path.write_text("py-spy is not installed\n")
        return
    with path.open("w") as out:
        for stub in stub_processes(grpc_port):
            if stub.model != tensor_names.WHISPER_NAME:
                continue
            out.write(f"===== whisper stub pid {stub.pid}\n")
            out.flush()
            subprocess.run([spy, "dump", "--native", "--pid", str(stub.pid)], stdout=out, stderr=subprocess.STDOUT,
                           timeout=60, check=False)


def run_variant(variant, checkpoint: str, requests: list, args, timeout_s: float) -> dict:
    command = ServeCommand(checkpoint, repository_for(variant) if variant else None, args.gpus,
                           mps=variant.mps if variant else None)
    label = variant.label if variant else "shipped"
    log_path = args.out / f"{RESULTS}-{label}.log"
    record: dict = {"label": label, "spec": variant.spec if variant else "", "command": command.display,
                    "log": log_path.name}
    say(f"{label}: starting {command.display}")
    with ServerProcess(command, log_path, 300.0) as server:
        record["ready_s"] = server.ready_s
        metrics_url = command.metrics_url
        with LoadGenerator(command.grpc_url, requests, processes=args.clients) as load:
            plan = PointPlan(args.concurrency, 0.0, args.seconds, timeout_s)  # no warm-up: every request counted
            _, point = measure_point(load, plan, command.grpc_url)
        say(describe_point(label, point))
        time.sleep(2.0)  # the engines' metrics are published every second
        answered = per_instance(metrics_url, "whisper_requests_total", outcome="success")
        held = per_instance(metrics_url, "whisper_requests_in_flight")
        record.update(point=point, answered=answered, held_after=held, stalled=stalled(answered))
        say(f"{label}: answered per instance {answered}; held after the load {held}")
        if record["stalled"] or any(held.values()):
            say(f"{label}: stalled {record['stalled']}; dumping the whisper stubs' stacks")
            dump_stacks(command.ports["grpc"], args.out / f"stacks-{label}.txt")
            time.sleep(SETTLE_S)
            record["held_after_settle"] = per_instance(metrics_url, "whisper_requests_in_flight")
    return record


def markdown(data: dict) -> str:
    lines = [f"# Every whisper instance's share ({data['model']}, --gpus {data['gpus']})", "", described_run(data), "",
             "| variant | concurrency | s | good req/s | statuses | answered per instance | stalled | held after |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["variants"]:
        p = r.get("point", {})
        answered = ", ".join(f"{k} {int(v)}" for k, v in sorted(r.get("answered", {}).items()))
        held = sum(r.get("held_after", {}).values())
        lines.append(f"| {r['label']} | {p.get('concurrency')} | {p.get('window_s')} | {p.get('goodput_per_s')} | "
                     f"{p.get('statuses')} | {answered} | {r.get('stalled', r.get('error'))} | {held:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instance_balance", description=__doc__.split("\n\n")[0])
    add_common_options(parser)
    parser.add_argument("--gpus", default="0,1")
    parser.add_argument("--concurrency", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--request-timeout-s", type=float, default=60.0)
    parser.add_argument("--variant", type=parse_variant, action="append", metavar="LABEL=SPEC",
                        help="a server variant (bench.served_variants); default: the shipped server")
    args = parser.parse_args(argv)
    prepared = prepare(args, say)
    requests = [job.load_request() for job in prepared.jobs]
    data = {**header("bench.instance_balance", args, prepared.jobs, argv), "gpus": args.gpus, "variants": []}
    for variant in args.variant or [None]:
        try:
            data["variants"].append(run_variant(variant, prepared.checkpoint, requests, args, args.request_timeout_s))
        except Exception as error:  # keep the other variants' records
            label = variant.label if variant else "shipped"
            data["variants"].append({"label": label, "error": f"{type(error).__name__}: {error}"})
            say(f"{label} failed: {error}")
        (args.out / f"{RESULTS}.json").write_text(json.dumps(data, indent=1))
        (args.out / f"{RESULTS}.md").write_text(markdown(data))
    print(markdown(data))
    return 1 if any(r.get("stalled") or r.get("error") for r in data["variants"]) else 0


if __name__ == "__main__":
    sys.exit(main())
