"""Where the stubs' threads spend their time under a served load: py-spy samples.

    python -m bench.profile_served --model tiny-random --tokens-per-second 2.732 --concurrency 1 128 --out OUT
    python -m bench.profile_served --model tiny --concurrency 2048 --stubs preprocessing whisper postprocessing --busy --out OUT

For each concurrency it starts the load through `transcribe` (gRPC, as
`bench.served` sends it), samples one stub process of each model named
(`--stubs`, default the `whisper` model's) with `py-spy record` (without pausing
it, one stack per thread) for `--seconds`, and writes the raw stacks and a
summary per thread: the frames a thread was in when sampled (its own time) and
the project's functions under which that time went. Idle frames are sampled
too, unless `--busy`: then the samples count the time a thread was on a core,
which is what bounds a host whose cores are all busy. At concurrency 1 only the
clip nearest 5 s is sent, as for the latency target. py-spy must be installed
and allowed to read the process (root, or ptrace permission).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import time
from pathlib import Path

from bench.load import LoadGenerator, PointPlan
from bench.served import MODELS, Settings, latency_job, make_jobs, served_checkpoint
from bench.server_process import ServeCommand, ServerProcess

STUBS = ("preprocessing", "whisper", "postprocessing")
OUR_CODE = re.compile(r"\((?:python_backend_lib|model_repository)/")
LINE = re.compile(r":\d+\)$")
TOP = 12


def stub_pids(model: str) -> list[int]:
    """The stub processes of `model`, one per instance (they are alike: one is sampled)."""
    pattern = f"/{model}/1/model.py"
    found = sorted(int(pid) for pid in subprocess.run(["pgrep", "-f", pattern], capture_output=True,
                                                       text=True).stdout.split())
    if not found:
        raise RuntimeError(f"no {model} stub is running")
    return found


def py_spy_command(pid: int, rate: int, seconds: float, busy: bool, output: Path) -> list[str]:
    """py-spy sampling `pid` without pausing it, one collapsed stack per thread; idle frames
    too, unless `busy`."""
    return ["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--duration", str(int(seconds)),
            "--format", "raw", "--threads", *([] if busy else ["--idle"]), "--nonblocking", "--output", str(output)]


def summarize(raw: str) -> str:
    """The collapsed stacks of `py-spy record --format raw --threads`, per thread."""
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    ours: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread, frames = frames[0], frames[1:]
        role = next((f.split(" ")[0] for f in frames if OUR_CODE.search(f)), None)
        key = f"{thread} [{role or 'other'}]"
        totals[key] += int(count)
        own[key][frames[-1] if frames else "(none)"] += int(count)
        for function in dict.fromkeys(LINE.sub(")", f) for f in frames if OUR_CODE.search(f)):
            ours[key][function] += int(count)
    lines = []
    for key, total in totals.most_common():
        top, n = own[key].most_common(1)[0]
        if n > 0.95 * total and ".wait (threading.py" in top:
            continue  # a poller asleep
        lines += [f"### {key}: {total} samples", "", "| own % | frame |", "|---|---|"]
        lines += [f"| {100 * n / total:.1f} | `{frame}` |" for frame, n in own[key].most_common(TOP)]
        lines += ["", "| inclusive % | project function |", "|---|---|"]
        lines += [f"| {100 * n / total:.1f} | `{frame}` |" for frame, n in ours[key].most_common(TOP)]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_served", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--tokens-per-second", type=float, help="forced lengths of random-weight models")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--stubs", nargs="+", choices=STUBS, default=["whisper"], help="the models sampled")
    parser.add_argument("--busy", action="store_true", help="leave idle frames out: samples count time on a core")
    parser.add_argument("--seconds", type=float, default=8.0, help="sampled per concurrency")
    parser.add_argument("--rate", type=int, default=400, help="py-spy samples per second")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = MODELS[args.model]
    checkpoint = served_checkpoint(spec)
    jobs = make_jobs(spec, checkpoint, args.tokens_per_second, Settings())
    short = latency_job(jobs)
    args.out.mkdir(parents=True, exist_ok=True)
    sampled = "time on a core (idle frames left out)" if args.busy else "idle frames included"
    report = [f"# py-spy samples of the {', '.join(args.stubs)} stubs, `{args.model}`", "",
              f"{args.rate} samples a second for {args.seconds:g} s, {sampled}.", ""]
    command = ServeCommand(checkpoint)
    with ServerProcess(command, args.out / "profile-server.log", 300.0):
        pids = {stub: stub_pids(stub) for stub in args.stubs}
        report += [f"The {stub} stub sampled: process {found[0]}, one of {len(found)}." for stub, found in pids.items()]
        for concurrency in args.concurrency:
            chosen = [short] if concurrency == 1 else jobs
            paths = {stub: args.out / f"profile-{stub}-c{concurrency}.txt" for stub in args.stubs}
            with LoadGenerator(command.grpc_url, [j.load_request() for j in chosen], processes=4) as load:
                load.run(PointPlan(concurrency, 0.0, 3.0, 60.0))  # warm-up
                samplers = [subprocess.Popen(py_spy_command(pids[stub][0], args.rate, args.seconds, args.busy, path))
                            for stub, path in paths.items()]
                time.sleep(0.5)
                result = load.run(PointPlan(concurrency, 0.0, args.seconds, 60.0))
                for sampler in samplers:
                    sampler.wait(timeout=args.seconds + 30)
            stats = result.stats
            report += ["", f"## concurrency {concurrency}: {stats.goodput_per_s:.1f} good requests/s, "
                       f"p50 {stats.latency_ms['p50']} ms"]
            print(report[-1], flush=True)
            for stub, path in paths.items():
                report += ["", f"### the {stub} stub", "", summarize(path.read_text()).replace("### ", "#### ")]
    (args.out / "profile.md").write_text("\n".join(report))


if __name__ == "__main__":
    main()
