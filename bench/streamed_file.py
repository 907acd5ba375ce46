"""A file's streamed transcript: how soon its first segment comes, against the whole transcript.

    python -m bench.streamed_file --out DIR                      # starts `whisper-triton serve`
    python -m bench.streamed_file --triton-grpc HOST:PORT --out DIR

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
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.clips import AUDIO_DIR
from bench.host import ServerProcesses, query_gpus
from bench.server_process import ServeCommand, ServerProcess
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


def _ms(seconds: list[float]) -> float:
    return round(1e3 * statistics.median(seconds), 1)


def time_file(url: str, path: Path, repeats: int) -> FileTimes:
    """`repeats` batch and streamed requests of one recording, alternately, after one of each."""
    import soundfile

    from clients.api import WhisperClient

    audio = path.read_bytes()
    client = WhisperClient(url, "grpc")
    batch_s, first_s, final_s, equal, updates = [], [], [], True, 0
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
            if attempt:  # the first round warms both paths up
                batch_s.append(batch_time)
                first_s.append(first)
                final_s.append(final_time)
    finally:
        client.close()
    batch_ms = _ms(batch_s)
    return FileTimes(path.name, round(soundfile.info(str(path)).duration, 2), repeats, batch_ms, _ms(first_s),
                     _ms(final_s), round(_ms(first_s) / batch_ms, 3), updates, equal)  # fmt: skip


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
    for f in map(lambda row: FileTimes(**row), record["files"]):
        lines.append(f"| {f.recording} | {f.audio_s} | {f.requests} | {f.batch_p50_ms} | **{f.first_segment_p50_ms}** | "
                     f"{f.streamed_final_p50_ms} | {f.first_over_batch} | {f.updates} | {f.equal} |")  # fmt: skip
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
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def measure(url: str) -> list[dict]:
        files = []
        for name in args.recordings:
            times = time_file(url, AUDIO_DIR / name, args.repeats)
            print(f"[streamed-file] {times}", flush=True)
            files.append(asdict(times))
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
