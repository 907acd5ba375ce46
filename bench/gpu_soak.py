"""The GPU soak: the configurations people deploy, each at saturation, every request accounted for per instance.

    python -m bench.gpu_soak --out OUT --seconds 120 --soak tiny-1gpu --soak tiny-2gpu ...

Each soak (`SOAKS`) starts `whisper-triton serve` as a user would (its GPUs, MPS
on or off, `--quantize fp8` where the soak asks for it), then the load generator
keeps `concurrency` requests in flight for `--seconds`, every request with a
timeout. The requests mix the soak's kinds (`KINDS`: plain, word timestamps,
beams, translate), one kind per clip in turn.
With real weights each answer is judged against the library's transcript of its
clip; random weights decode freely, so every row runs as far as the text context
lets it, which is the length limit's stress. A soak may run live sessions
beside the batch load: Realtime sessions through a gateway, each streaming
recordings with pauses for the whole soak, every turn followed to its
transcript.

After the load, the soak waits until nothing is held, then judges (`problems`):
- every request answered, or refused as overloaded: no timeout, no INTERNAL,
  no answer that fails its check;
- every whisper instance answered at least FAIR_SHARE of the mean, and holds
  nothing after the settle;
- no failed decoder step and no stalled engine (`whisper_failed_steps_total`,
  `whisper_engine_stalled`);
- every live turn that ended got its transcript, and no session saw an error;
- no role's host memory, no GPU's memory and no whisper instance's PyTorch pools grew
  by more than MEMORY_GROWTH_LIMIT_GIB over the second half of the load
  (`bench.host.later_growth`).

Writes `gpu-soak.json` and `gpu-soak.md` into `--out`, after each soak, and the
servers' and gateways' logs; exits 1 when any soak has a problem.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.clips import load_clips
from bench.comparisons import described_run
from bench.host import MemoryWatch, later_growth
from bench.instance_balance import FAIR_SHARE, stalled
from bench.jobs import Job, free_jobs, real_jobs
from bench.load import LoadGenerator, PointPlan
from bench.references import with_references
from bench.served import MODELS, STATE_DIR, describe_point, free_gpu_memory, measure_point, served_checkpoint
from bench.server_process import ServeCommand, ServerProcess, checkout_label, checkout_record
from loadtest.metrics import per_instance
from loadtest.outcomes import is_overloaded
from loadtest.provenance import provenance

RESULTS = "gpu-soak"
# A request kind's parameters, added to every request of that kind.
KINDS: dict[str, dict[str, object]] = {
    "plain": {},
    "words": {"word_timestamps": True},
    "beams": {"beam_size": 5, "best_of": 5},
    "translate": {"task": "translate"},
}
SETTLE_TIMEOUT_S = 120.0  # after the load: until nothing is held, at most this long
LIVE_START_SPREAD_S = 2.0
# A live session sends its audio at the pace of speech; a chunk sent later than this
# means the soak's own sessions fell behind (their process starved), and its live
# figures no longer describe sessions at that pace.
LIVE_SEND_LAG_LIMIT_S = 1.0
# The server's memory is read this often during the load (`bench.host.MemoryWatch`). Over
# the load's second half no role's processes (all the whisper instances together, say),
# no GPU and no whisper instance's PyTorch pools may hold more than this much more: the engines take their KV pools and
# graphs at start, and what the allocators keep rises with the first minutes of the load
# and then holds; a leak of a few KiB a request grows by more than this over the
# hundreds of thousands of requests a soak's second half answers.
MEMORY_SAMPLE_S = 10.0
MEMORY_GROWTH_LIMIT_GIB = 0.5


@dataclass(frozen=True)
class Soak:
    """One configuration: what is served, on which GPUs, and the load it gets."""

    model: str  # a key of bench.served.MODELS
    gpus: str | None  # `serve --gpus` (None: the CPU, `--cpu`)
    mps: bool | None
    kinds: tuple[str, ...]  # of KINDS, one per clip in turn
    concurrency: int
    request_timeout_s: float
    live_sessions: int = 0  # Realtime sessions beside the batch load
    quantize: str | None = None  # `serve --quantize` (None: exact); the CPU smoke run serves exact
    engines: int | None = None  # `serve --engines` a GPU (None: auto); the CPU smoke run serves auto's


SOAKS: dict[str, Soak] = {
    "tiny-1gpu": Soak("tiny", "0", True, ("plain", "words", "beams"), 512, 60.0),
    "tiny-2gpu": Soak("tiny", "0,1", True, ("plain", "words", "beams"), 1024, 60.0, live_sessions=32),
    "tiny-2gpu-no-mps": Soak("tiny", "0,1", False, ("plain", "words", "beams"), 1024, 60.0),
    "base-mixed": Soak("base-random", "0", True, ("plain", "translate", "beams", "words"), 256, 180.0),
    "large-v3": Soak("large-v3", "0", True, ("plain",), 128, 180.0),
    "large-v3-fp8": Soak("large-v3", "0", True, ("plain",), 128, 180.0, quantize="fp8"),  # Hopper's opt-in
    # tiny's default before five engines (docs/benchmarks/engines.md, section 11), for a host
    # whose cores a GPU may favour fewer.
    "tiny-1gpu-4-engines": Soak("tiny", "0", True, ("plain", "words", "beams"), 512, 60.0, engines=4),
}  # fmt: skip


def say(message: str) -> None:
    print(f"[bench.gpu_soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


def soak_jobs(soak: Soak, checkpoint: str, device: str) -> list[Job]:
    """Every clip of the bench's mix, clip i as kind i mod len(kinds); real weights get references."""
    from python_backend_lib.checkpoints.configs import load_config

    eot = load_config(checkpoint).special.eot
    clips = load_clips()
    make = free_jobs if MODELS[soak.model].random else real_jobs
    jobs = [make([clip], eot, KINDS[soak.kinds[i % len(soak.kinds)]])[0] for i, clip in enumerate(clips)]
    return with_references(jobs, checkpoint, device, say)


# ------------------------------------------------------------------ live sessions beside


@dataclass
class LiveTally:
    sessions: int = 0  # session streams run (each session streams the recordings again while time is left)
    turns: int = 0  # turns the server's VAD ended
    completed: int = 0  # of those, turns whose transcript came
    errors: list[str] = field(default_factory=list)
    max_send_lag_s: float = 0.0


def live_soak(gateway_url: str, sessions: int, seconds: float) -> LiveTally:
    """`sessions` Realtime sessions streaming for about `seconds` (a process's entry point)."""
    return asyncio.run(_live_soak(gateway_url, sessions, seconds))


async def _live_soak(gateway_url: str, sessions: int, seconds: float) -> LiveTally:
    import numpy as np

    from bench.live_latency import Stream, live_session, stream_audio

    audio, _ = stream_audio()
    stream = Stream((np.clip(audio, -1, 1) * 32767).round().astype("<i2"), ())
    url = gateway_url.replace("http://", "ws://") + "/realtime?intent=transcription"
    tally, end = LiveTally(), time.monotonic() + seconds

    async def session(index: int) -> None:
        delay, first = LIVE_START_SPREAD_S * index / max(1, sessions), True
        while first or time.monotonic() + stream.seconds <= end:  # streams again while a whole stream fits
            first = False
            try:
                result = await live_session(url, stream, time.monotonic() + delay)
            except Exception as error:  # a session that broke is a problem of the soak, not of this loop
                tally.errors.append(f"{type(error).__name__}: {error}"[:300])
                return
            tally.sessions += 1
            tally.turns += result.turns
            tally.completed += len(result.turn_latencies_s)
            tally.errors += result.errors
            tally.max_send_lag_s = max(tally.max_send_lag_s, round(result.max_send_lag_s, 3))
            delay = 0.0

    await asyncio.gather(*(session(i) for i in range(sessions)))
    return tally


# ------------------------------------------------------------------ one soak


def on_cpu(soak: Soak, concurrency: int | None) -> Soak:
    """The harness's smoke run: the same soak served on the CPU, exact, as many engines as
    auto gives it, at `concurrency` (None: the soak's own)."""
    concurrency = concurrency or soak.concurrency
    return replace(soak, gpus=None, mps=None, concurrency=concurrency,
                   live_sessions=min(soak.live_sessions, concurrency), quantize=None, engines=None)


def serve_command(soak: Soak, checkpoint: str | None, checkout: Path | None) -> ServeCommand:
    return ServeCommand(checkpoint, None, soak.gpus, soak.engines, mps=soak.mps, quantize=soak.quantize,
                        checkout=checkout)


def run_soak(label: str, soak: Soak, args) -> dict:
    spec = MODELS[soak.model]
    checkpoint = served_checkpoint(spec)
    jobs = soak_jobs(soak, checkpoint, args.device)
    free_gpu_memory()
    if args.gpus:
        soak = replace(soak, gpus=args.gpus)
    if args.cpu:
        soak = on_cpu(soak, args.concurrency)
    command = serve_command(soak, checkpoint, args.checkout)
    record: dict = {"label": label, "soak": asdict(soak), "command": command.display, "seconds": args.seconds,
                    **checkout_record(args.checkout)}
    say(f"{label}: starting {command.display}")
    with ServerProcess(command, args.out / f"{label}-server.log", 600.0) as server:
        record["ready_s"] = server.ready_s
        metrics_url = command.metrics_url
        live = None
        with LoadGenerator(command.grpc_url, [job.load_request() for job in jobs], processes=args.clients) as load, \
                _gateway(soak, command, args.out / f"{label}-gateway.log") as gateway:
            pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            if gateway is not None:
                live = pool.submit(live_soak, gateway.url, soak.live_sessions, args.seconds)
            plan = PointPlan(soak.concurrency, 0.0, args.seconds, soak.request_timeout_s)  # every request counted
            with MemoryWatch(command.ports["grpc"], metrics_url, MEMORY_SAMPLE_S) as memory:
                _, point = measure_point(load, plan, command.grpc_url)
            record["memory"] = memory.samples
            record["memory_growth_gib"] = later_growth(memory.samples)
            say(f"{label}: memory over the load's second half (GiB): {record['memory_growth_gib']}")
            say(describe_point(label, point))
            if live is not None:
                record["live"] = asdict(live.result(timeout=args.seconds + 600))
                say(f"{label}: live {record['live']['turns']} turns, {record['live']['completed']} completed, "
                    f"{len(record['live']['errors'])} errors")
            pool.shutdown()
        record["point"] = point
        record.update(settle(metrics_url))
    return record


def _gateway(soak: Soak, command: ServeCommand, log: Path):
    import contextlib

    if not soak.live_sessions:
        return contextlib.nullcontext(None)
    from bench.live_latency import gateway_process

    return gateway_process(command.grpc_url, log)


def settle(metrics_url: str) -> dict:
    """Wait until no whisper instance holds a request (at most SETTLE_TIMEOUT_S), then read each one."""
    started = time.monotonic()
    while True:
        time.sleep(2.0)  # the engines publish their metrics every second
        held = per_instance(metrics_url, "whisper_requests_in_flight")
        if not any(held.values()) or time.monotonic() - started > SETTLE_TIMEOUT_S:
            break
    answered = per_instance(metrics_url, "whisper_requests_total", outcome="success")
    return {"settle_s": round(time.monotonic() - started, 1), "held_after": held, "answered": answered,
            "failed_steps": per_instance(metrics_url, "whisper_failed_steps_total"),
            "engine_stalled": per_instance(metrics_url, "whisper_engine_stalled"),
            "outcomes": {outcome: per_instance(metrics_url, "whisper_requests_total", outcome=outcome)
                         for outcome in ("client", "cancelled", "server", "overloaded", "unavailable")}}


def problems(record: dict) -> list[str]:
    """What is wrong with one soak's record (empty: it passed)."""
    if "error" in record:
        return [record["error"]]
    found = []
    point = record["point"]
    refused = {r: n for r, n in point["reasons"].items() if is_overloaded(*r.partition(": ")[::2])}
    refused_count = sum(refused.values())
    other = {s: n for s, n in point["statuses"].items() if s not in ("OK", "UNAVAILABLE")}
    if point["statuses"].get("UNAVAILABLE", 0) > refused_count:
        other["UNAVAILABLE (not overload)"] = point["statuses"]["UNAVAILABLE"] - refused_count
    if other:
        found.append(f"requests neither answered nor refused as overloaded: {other}; reasons {point['reasons']}; "
                     f"examples {point['problems']}")
    if not point["statuses"].get("OK"):
        found.append("no request answered")
    if low := stalled(record["answered"]):
        found.append(f"instances below {FAIR_SHARE:.0%} of the mean: {low}")
    for name in ("held_after", "failed_steps", "engine_stalled"):
        bad = {instance: value for instance, value in record[name].items() if value}
        if bad:
            found.append(f"{name}: {bad}")
    grown = {where: gib for where, gib in later_growth(record.get("memory", [])).items() if gib > MEMORY_GROWTH_LIMIT_GIB}
    if grown:
        found.append(f"memory grew over the load's second half (GiB): {grown} (limit {MEMORY_GROWTH_LIMIT_GIB:g})")
    live = record.get("live")
    if live is not None:
        if live["errors"]:
            found.append(f"live errors: {live['errors'][:3]}")
        if live["completed"] < live["turns"]:
            found.append(f"live turns without a transcript: {live['turns'] - live['completed']} of {live['turns']}")
        if not live["turns"]:
            found.append("no live turn ended")
        if live["max_send_lag_s"] > LIVE_SEND_LAG_LIMIT_S:
            found.append(f"live audio sent up to {live['max_send_lag_s']:g} s late (limit {LIVE_SEND_LAG_LIMIT_S:g} s)")
    return found


# ------------------------------------------------------------------ the record


def served_label(record: dict) -> str:
    """The soak's label, with the commit it served when that was another checkout's."""
    served = checkout_label(record)
    return f"{record['label']} ({served})" if served else record["label"]


def markdown(data: dict) -> str:
    lines = [f"# The GPU soak ({data['seconds']:g} s a configuration)", "", described_run(data), "",
             "| soak | command | concurrency | good req/s | statuses | answered per instance | live turns | "
             "problems |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["soaks"]:
        point = r.get("point", {})
        answered = ", ".join(f"{k} {int(v)}" for k, v in sorted(r.get("answered", {}).items()))
        live = r.get("live")
        turns = f"{live['completed']}/{live['turns']}" if live else ""
        lines.append(f"| {served_label(r)} | `{r.get('command', '')}` | {point.get('concurrency')} | "
                     f"{point.get('goodput_per_s')} | {point.get('statuses')} | {answered} | {turns} | "
                     f"{'; '.join(r['problems']) or 'none'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--soak", action="append", choices=sorted(SOAKS), help="default: every one, in order")
    parser.add_argument("--seconds", type=float, default=120.0, help="of load, per soak")
    parser.add_argument("--clients", type=int, default=8, help="client processes of the load generator")
    parser.add_argument("--device", default="cuda", help="where the library decodes the reference transcripts")
    parser.add_argument("--gpus", help="serve on these GPUs instead of the soak's (two soaks side by side)")
    parser.add_argument("--checkout", type=Path,
                        help="serve another checkout's code (`git archive` of an earlier commit, its commit in "
                             "DIR/COMMIT): the same soak, A against B on one machine")
    parser.add_argument("--cpu", action="store_true", help="serve on the CPU: a smoke run of the harness")
    parser.add_argument("--concurrency", type=int, help="with --cpu: requests in flight, and live sessions at most (default: the soak's)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    clips = load_clips()
    data = {"program": "bench.gpu_soak", "run": provenance(), "clients": args.clients, "seconds": args.seconds,
            "command": "python -m bench.gpu_soak " + " ".join(argv if argv is not None else sys.argv[1:]),
            "clips": [c.clip.name for c in clips], "mean_clip_s": round(sum(c.clip.duration_s for c in clips)
                                                                       / len(clips), 2), "soaks": []}
    for label in args.soak or list(SOAKS):
        try:
            record = run_soak(label, SOAKS[label], args)
        except Exception as error:  # keep the other soaks' records
            record = {"label": label, "error": f"{type(error).__name__}: {error}"}
        record["problems"] = problems(record)
        say(f"{label}: {'; '.join(record['problems']) or 'no problem'}")
        data["soaks"].append(record)
        (args.out / f"{RESULTS}.json").write_text(json.dumps(data, indent=1))
        (args.out / f"{RESULTS}.md").write_text(markdown(data))
    print(markdown(data))
    return 1 if any(r["problems"] for r in data["soaks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
