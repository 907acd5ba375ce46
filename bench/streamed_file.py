"""A file's streamed transcript: how soon its first segment comes, against the whole transcript.

    python -m bench.streamed_file --out DIR                      # starts `whisper-triton serve`
    python -m bench.streamed_file --triton-grpc HOST:PORT --out DIR
    python -m bench.streamed_file --gateway --out DIR            # and the gateway's stream=True
    python -m bench.streamed_file --concurrency 16 64 --out DIR  # then streamed requests kept in flight

One request at a time, for each recording: the batch path (`transcribe`, unary gRPC)
and the streamed path (`transcribe_stream` over `stream_infer`, as
`WhisperClient.stream` reads it), alternately, `--repeats` times each after a
warm-up of both. Reported per recording: the batch answer's latency, the streamed
request's time to its first segment and to its final response, and whether the
streamed transcript equals the batch one. On a GPU host it also records each
server process's GPU memory as nvidia-smi lists it (the `whisper_stream` engine
is the streamed path's own cost), after the requests.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.clips import AUDIO_DIR
from bench.host import ServerProcesses, query_gpus
from bench.live_latency import gateway_process
from bench.server_process import ServeCommand, ServerProcess
from bench.stats import percentile_summary
from loadtest.provenance import provenance

# A long-form recording (two windows: its first segments come once the first is decoded)
# and one of a single window, where the streamed path can only add its own overhead.
RECORDINGS = ("sonnet1_longform.wav", "jfk.wav")
STARTUP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class FileTimes:
    recording: str
    audio_s: float
    requests: int  # each path's timed requests
    batch_p50_ms: float  # the whole transcript from `transcribe`
    first_segment_p50_ms: float  # the streamed path's first response with a segment
    streamed_final_p50_ms: float  # its final response
    first_over_batch: float  # first_segment_p50_ms / batch_p50_ms
    updates: int  # responses with new segments in the last streamed request
    equal: bool  # every streamed final transcript equals the batch transcript
    # With --gateway: the openai client's `stream=True` through the gateway (server-sent events).
    sse_first_delta_p50_ms: float | None = None  # its first transcript.text.delta
    sse_done_p50_ms: float | None = None  # its transcript.text.done
    sse_first_over_batch: float | None = None  # sse_first_delta_p50_ms / batch_p50_ms
    sse_deltas: int | None = None  # deltas in the last streamed request
    sse_equal: bool | None = None  # every time, the deltas joined = the done text = the batch text


def _ms(seconds: list[float]) -> float:
    return round(1e3 * statistics.median(seconds), 1)


@dataclass(frozen=True)
class SseTimes:
    first_delta_s: float
    done_s: float
    deltas: int
    equal: bool  # the deltas joined = the done text = `text`


def time_sse(gateway: str, path: Path, text: str) -> SseTimes:
    """One `stream=True` transcription of `path` through the gateway, by the openai client."""
    import openai

    started, first, deltas = time.perf_counter(), None, []
    with openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0, timeout=600) as client, path.open("rb") as f:
        for event in client.audio.transcriptions.create(model="whisper-1", file=f, stream=True):
            if event.type == "transcript.text.delta":
                first = first if first is not None else time.perf_counter() - started
                deltas.append(event.delta)
            elif event.type == "transcript.text.done":
                done = time.perf_counter() - started
                if first is None:
                    raise RuntimeError(f"{path.name}: the stream ended without a delta")
                return SseTimes(first, done, len(deltas), "".join(deltas) == event.text == text)
    raise RuntimeError(f"{path.name}: the stream ended without transcript.text.done")


def time_file(url: str, path: Path, repeats: int, gateway: str | None = None) -> FileTimes:
    """`repeats` batch and streamed requests of one recording, alternately, after one of each;
    with a gateway, a `stream=True` transcription through it after each streamed request."""
    import soundfile

    from clients.api import WhisperClient

    audio = path.read_bytes()
    client = WhisperClient(url, "grpc")
    batch_s, first_s, final_s, equal, updates, sse = [], [], [], True, 0, []
    try:
        for attempt in range(repeats + 1):
            started = time.perf_counter()
            batch = client.outputs(audio)
            batch_time = time.perf_counter() - started
            started, first, final_time, updates = time.perf_counter(), None, None, 0
            for update in client.stream(audio):
                if update.new_segments:
                    updates += 1
                    if first is None:
                        first = time.perf_counter() - started
                if update.final:
                    final_time = time.perf_counter() - started
                    equal = equal and update.outputs == batch
            if first is None or final_time is None:
                raise RuntimeError(f"{path.name}: the stream ended without a segment or a final response")
            streamed_sse = time_sse(gateway, path, batch.text) if gateway else None
            if attempt:  # the first round warms both paths up
                batch_s.append(batch_time)
                first_s.append(first)
                final_s.append(final_time)
                sse += [streamed_sse] if streamed_sse else []
    finally:
        client.close()
    batch_ms = _ms(batch_s)
    times = FileTimes(path.name, round(soundfile.info(str(path)).duration, 2), repeats, batch_ms, _ms(first_s),
                      _ms(final_s), round(_ms(first_s) / batch_ms, 3), updates, equal)  # fmt: skip
    if not sse:
        return times
    first_delta_ms = _ms([t.first_delta_s for t in sse])
    return dataclasses.replace(
        times, sse_first_delta_p50_ms=first_delta_ms, sse_done_p50_ms=_ms([t.done_s for t in sse]),
        sse_first_over_batch=round(first_delta_ms / batch_ms, 3), sse_deltas=sse[-1].deltas,
        sse_equal=all(t.equal for t in sse),
    )  # fmt: skip


@dataclass(frozen=True)
class LoadTimes:
    """`--concurrency`: streamed requests of one recording kept in flight for a while."""

    recording: str
    concurrency: int
    seconds: float
    answered: int  # streams that ended with the whole transcript, equal to the batch one
    wrong: int  # streams whose final outputs differed from the batch ones (any field of any output)
    failed: int  # streams that ended in an error or the client's timeout (`LOAD_TIMEOUT_S`)
    rtfx: float  # the answered streams' audio over the wall time
    final_p50_ms: float | None
    final_p90_ms: float | None
    responses_per_stream: float  # responses with new segments, on average over the answered
    wrong_text: int = 0  # of the wrong, those whose text differed (else only the segments' other fields)


# Each streamed request of a load gives up after this long (it then counts as failed).
LOAD_TIMEOUT_S = 120.0


def time_load(url: str, path: Path, concurrency: int, seconds: float) -> LoadTimes:
    """`concurrency` clients, each streaming `path` again and again for `seconds` (the last
    streams started before the end finish), every final transcript compared with the
    batch one; a warm-up stream first."""
    import soundfile

    from clients.api import WhisperClient

    audio = path.read_bytes()
    with WhisperClient(url, "grpc", timeout_s=LOAD_TIMEOUT_S) as client:
        expected = client.outputs(audio)
        list(client.stream(audio))
    finals, updates, outcomes = [], [], collections.Counter()
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def worker() -> None:
        with WhisperClient(url, "grpc", timeout_s=LOAD_TIMEOUT_S) as client:
            while time.perf_counter() < deadline:
                started, count, outcome, text_differs = time.perf_counter(), 0, "failed", False
                try:
                    for update in client.stream(audio):
                        count += bool(update.new_segments)
                        if update.final:
                            outcome = "answered" if update.outputs == expected else "wrong"
                            text_differs = update.outputs.text != expected.text
                except Exception:  # TranscriptionError (an error reply, the client's timeout), a broken stream
                    outcome = "failed"
                with lock:
                    outcomes[outcome] += 1
                    outcomes["wrong text"] += outcome == "wrong" and text_differs
                    if outcome == "answered":
                        finals.append(time.perf_counter() - started)
                        updates.append(count)

    began = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    audio_s = soundfile.info(str(path)).duration
    latency = percentile_summary(finals)
    return LoadTimes(path.name, concurrency, round(wall, 1), outcomes["answered"], outcomes["wrong"],
                     outcomes["failed"], round(audio_s * outcomes["answered"] / wall, 1),
                     latency["p50"], latency["p90"],
                     round(statistics.mean(updates), 2) if updates else 0.0, outcomes["wrong text"])  # fmt: skip


def markdown(record: dict) -> str:
    made = record["provenance"]
    lines = [
        "# A file's streamed transcript: first segment against the whole transcript",
        "",
        f"{made['date']}, commit `{made['commit']}`{' (changed)' if made['dirty'] else ''}, "
        f"{made['machine'].get('gpu') or made['machine']['cpu']}, {made['machine']['cpu_count']} CPUs; "
        f"{record['checkpoint']}. One request at a time, the two paths alternately. "
        f"Command: `{made['command']}`.",
        "",
        "| recording | audio s | requests | batch p50 ms | first segment p50 ms | streamed final p50 ms | "
        "first / batch | updates with segments | streamed = batch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    files = [FileTimes(**row) for row in record["files"]]
    for f in files:
        lines.append(f"| {f.recording} | {f.audio_s} | {f.requests} | {f.batch_p50_ms} | **{f.first_segment_p50_ms}** | "
                     f"{f.streamed_final_p50_ms} | {f.first_over_batch} | {f.updates} | {f.equal} |")  # fmt: skip
    if any(f.sse_first_delta_p50_ms is not None for f in files):
        lines += ["", "Through the gateway, the openai client's `stream=True` (server-sent events), after each "
                  "streamed request:", "",
                  "| recording | first delta p50 ms | done p50 ms | first delta / batch | deltas | deltas joined = "
                  "done = batch |", "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {f.recording} | **{f.sse_first_delta_p50_ms}** | {f.sse_done_p50_ms} | {f.sse_first_over_batch} "
                  f"| {f.sse_deltas} | {f.sse_equal} |" for f in files]  # fmt: skip
    loads = [LoadTimes(**row) for row in record.get("loads", [])]
    if loads:
        lines += ["", "Streamed requests kept in flight (`--concurrency`), each final transcript against the batch one:",
                  "", "| recording | concurrency | seconds | answered | wrong (text) | failed | RTFx | final p50 ms | "
                  "final p90 ms | responses with segments per stream |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {x.recording} | {x.concurrency} | {x.seconds} | {x.answered} | {x.wrong} ({x.wrong_text}) | {x.failed} | "
                  f"**{x.rtfx}** | {x.final_p50_ms} | {x.final_p90_ms} | {x.responses_per_stream} |" for x in loads]
    memory = record.get("gpu_memory")
    if memory:
        lines += ["", "GPU memory after the requests, by nvidia-smi's compute processes (GiB):", "",
                  "| process | GiB |", "|---|---|"]  # fmt: skip
        lines += [f"| {role} | {gib} |" for role, gib in memory["by_role_gib"].items()]
        lines += [f"| pid {pid} (not the server's: the MPS server, or a PID outside this namespace) | {gib} |"
                  for pid, gib in memory["other_processes_gib"].items()]  # fmt: skip
        lines += ["", f"Every GPU's memory in use: {memory['gpus_used_gib']} GiB."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.streamed_file", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recordings", nargs="+", default=list(RECORDINGS), help=f"files of {AUDIO_DIR}")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--checkpoint", help="as `whisper-triton serve --checkpoint` takes it (default: packaged)")
    parser.add_argument("--triton-grpc", help="a running server's gRPC address (HOST:PORT) instead of starting one")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[],
                        help="then keep this many streamed requests of each recording in flight (each count in turn)")
    parser.add_argument("--load-seconds", type=float, default=30.0, help="how long each --concurrency load lasts")
    parser.add_argument("--gateway", action="store_true",
                        help="also time `stream=True` through a gateway started in front of the server")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def measure(url: str) -> list[dict]:
        with contextlib.ExitStack() as stack:
            gateway = stack.enter_context(gateway_process(url, args.out / "gateway.log")).url if args.gateway else None
            files = []
            for name in args.recordings:
                times = time_file(url, AUDIO_DIR / name, args.repeats, gateway)
                print(f"[streamed-file] {times}", flush=True)
                files.append(asdict(times))
            for name in args.recordings:
                for concurrency in args.concurrency:
                    load = time_load(url, AUDIO_DIR / name, concurrency, args.load_seconds)
                    print(f"[streamed-file] {load}", flush=True)
                    record.setdefault("loads", []).append(asdict(load))
            return files

    record = {"checkpoint": args.checkpoint or "packaged tiny.en", "provenance": provenance()}
    if args.triton_grpc:
        record["files"] = measure(args.triton_grpc)
    else:
        command = ServeCommand(args.checkpoint)
        with ServerProcess(command, args.out / "server.log", STARTUP_TIMEOUT_S):
            record["files"] = measure(command.grpc_url)
            if query_gpus():
                record["gpu_memory"] = ServerProcesses.find(command.ports["grpc"]).gpu_memory()
    (args.out / "streamed-file.json").write_text(json.dumps(record, indent=1, default=str))
    (args.out / "README.md").write_text(markdown(record))
    print(markdown(record), flush=True)


if __name__ == "__main__":
    main()
