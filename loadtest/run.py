"""A bounded, headless load test of a running server, with CSV and HTML reports.

    python -m loadtest.run --http-url localhost:8000 --grpc-url localhost:8001 \\
        --users 4 --spawn-rate 2 --run-time 30s --csv-prefix out/loadtest/run

Runs locust without its web UI for --run-time, printing its stats table as it
goes, and writes locust's reports (<prefix>_stats.csv and the other CSVs,
<prefix>.html) and the final numbers (<prefix>_summary.json); with --record,
also the figures to keep (<record>.json and <record>.md, with the commit and
the machine: docs/benchmarks/loadtest is the one docs/operating.md quotes). Exits
non-zero when any request failed, when locust itself failed, or when no
request completed at all.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from clients.connection import AddressError, Protocol, parse_address
from gateway.api_key import API_KEY_ENV
from loadtest import records
from loadtest.clips import DEFAULT_AUDIO_DIR, Summary

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
USER_CLASSES = {"grpc": "GrpcTranscribeUser", "http": "HttpTranscribeUser", "live": "LiveUser"}
# After --run-time, users get this long to finish the request in flight.
STOP_TIMEOUT_S = 60
EXIT_ON_FAILURE = 3  # distinct from locust's own 1 (failed requests) and 2 (bad usage)
# locust is not a dependency of the server: the `loadtest` extra brings it.
INSTALL_HINT = "pip install -e '.[loadtest]'"
LOCUST_OUTPUT_KEPT = 20  # the last lines of locust's stderr, for the cause of a failure


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-url", default="localhost:8000", help="Triton's HTTP address, host:port or http://")
    parser.add_argument("--grpc-url", default="localhost:8001", help="Triton's gRPC address, host:port or grpc://")
    parser.add_argument(
        "--protocols", default="grpc,http", help=f"comma-separated, from {sorted(USER_CLASSES)} (users split evenly)"
    )
    parser.add_argument("--users", type=int, default=4, help="concurrent users")
    parser.add_argument("--spawn-rate", type=float, default=2.0, help="users started per second")
    parser.add_argument("--run-time", default="30s", help="how long to send requests, e.g. 20s, 2m")
    parser.add_argument("--csv-prefix", type=Path, default=Path("out/loadtest/run"), help="report files' prefix")
    parser.add_argument("--gateway-url", default="http://localhost:9000/v1",
                        help="the gateway's base URL, for --protocols live (its Realtime sessions)")
    parser.add_argument("--audio-dir", type=Path, default=DEFAULT_AUDIO_DIR, help="clips and their manifest.tsv")
    parser.add_argument("--max-clip-seconds", type=float, default=60.0, help="leave out longer clips")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request fails")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None, metavar="KEY",
                        help=f"the gateway's API key, for --protocols live (default: ${API_KEY_ENV})")
    parser.add_argument(
        "--record", type=Path, help="after a passing run, write <RECORD>.json and <RECORD>.md (e.g. docs/benchmarks/loadtest)"
    )
    args = parser.parse_args(argv)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    unknown = sorted(set(protocols) - set(USER_CLASSES))
    if unknown or not protocols:
        parser.error(f"--protocols must name some of {sorted(USER_CLASSES)}, got {args.protocols!r}")
    if args.users < 1 or args.spawn_rate <= 0:
        parser.error("--users must be at least 1 and --spawn-rate above 0")
    args.protocols = tuple(dict.fromkeys(protocols))
    for name, protocol in (("http_url", Protocol.HTTP), ("grpc_url", Protocol.GRPC)):
        try:
            address = parse_address(getattr(args, name), protocol)
        except AddressError as error:
            parser.error(f"--{name.replace('_', '-')}: {error}")
        if address.tls:
            parser.error(f"--{name.replace('_', '-')}: the load test speaks plain HTTP, not https")
        setattr(args, name, address.location)
    return args


def summary_path(args: argparse.Namespace) -> Path:
    return Path(f"{args.csv_prefix}_summary.json")


def locust_command(args: argparse.Namespace) -> list[str]:
    """The locust command line for a headless run of `args`."""
    return [
        sys.executable, "-m", "locust",
        "--locustfile", str(LOCUSTFILE),
        "--headless",
        "--users", str(args.users),
        "--spawn-rate", str(args.spawn_rate),
        "--run-time", args.run_time,
        "--stop-timeout", str(STOP_TIMEOUT_S),
        "--csv", str(args.csv_prefix),
        "--html", f"{args.csv_prefix}.html",
        "--exit-code-on-error", "1",
        "--triton-http", args.http_url,
        "--triton-grpc", args.grpc_url,
        "--gateway-url", args.gateway_url,
        "--audio-dir", str(args.audio_dir),
        "--max-clip-seconds", str(args.max_clip_seconds),
        "--request-timeout", str(args.request_timeout),
        "--summary-json", str(summary_path(args)),
        *(USER_CLASSES[p] for p in args.protocols),
    ]


def run_locust(command: list[str]) -> tuple[int, str]:
    """Run locust, its stderr passed on as it comes; (exit status, its last line)."""
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace")
    last: collections.deque[str] = collections.deque(maxlen=LOCUST_OUTPUT_KEPT)
    for line in process.stderr:
        sys.stderr.write(line)
        if line.strip():
            last.append(line.strip())
    return process.wait(), (last[-1] if last else "nothing")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("locust") is None:
        print(f"loadtest: locust is not installed; install the load-test extra: {INSTALL_HINT}", file=sys.stderr)
        return EXIT_ON_FAILURE
    args.csv_prefix.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"loadtest: {args.users} users ({', '.join(args.protocols)}) for {args.run_time} against "
        f"http={args.http_url} grpc={args.grpc_url}",
        flush=True,
    )
    if args.api_key:  # to locust through its environment, not its command line, which others can read
        os.environ[API_KEY_ENV] = args.api_key
    status, last_line = run_locust(locust_command(args))

    summary_json = summary_path(args)
    if not summary_json.is_file():
        print(f"loadtest: FAILED: locust stopped (exit status {status}) before its summary: {last_line}",
              file=sys.stderr)
        return status or EXIT_ON_FAILURE
    summary = Summary.from_json(summary_json.read_text(encoding="utf-8"))
    print("\n".join(["", "loadtest summary:", *summary.table(), *(f"error: {e}" for e in summary.errors)]))
    print(f"reports: {args.csv_prefix}_stats.csv, {args.csv_prefix}.html, {summary_json}")
    cause = f"first error: {summary.errors[0]}" if summary.errors else f"locust said: {last_line}"
    if summary.total.failures:
        print(f"loadtest: FAILED: {summary.total.failures} of {summary.total.requests} requests failed; {cause}",
              file=sys.stderr)
        return status or EXIT_ON_FAILURE
    if status != 0:
        print(f"loadtest: FAILED: locust exit status {status}; {cause}", file=sys.stderr)
        return status
    if summary.total.requests == 0:
        print(f"loadtest: FAILED: no request completed; {cause}", file=sys.stderr)
        return EXIT_ON_FAILURE
    if args.record:
        for path in records.write_record(args.record, "Load test", records.origin(), record(args, summary), markdown(args, summary)):
            print(f"wrote {path}")
    print("loadtest: passed")
    return 0


def record(args: argparse.Namespace, summary: Summary) -> dict:
    settings = {"users": args.users, "spawn_rate": args.spawn_rate, "run_time": args.run_time,
                "protocols": list(args.protocols), "max_clip_seconds": args.max_clip_seconds}  # fmt: skip
    return {"settings": settings, **json.loads(summary.to_json())}


def markdown(args: argparse.Namespace, summary: Summary) -> list[str]:
    rows = [
        f"| {row.request_type} | {row.name} | {row.requests} | {row.failures} | {row.median_ms:.0f} "
        f"| {row.p95_ms:.0f} | {row.requests_per_s:.2f} |"
        for row in (*summary.rows, summary.total)
    ]
    return [
        f"{args.users} locust users ({', '.join(args.protocols)}, split evenly) for {args.run_time}, each sending the "
        f"test clips of up to {args.max_clip_seconds:g} s at random to the `transcribe` model, back to back.",
        "",
        "| type | name | requests | failures | median ms | p95 ms | req/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]


if __name__ == "__main__":
    sys.exit(main())
