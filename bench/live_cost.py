"""What a live session costs the server, per second of its audio: one long turn.

A Realtime transcription session (/v1/realtime on the gateway, turn_detection off)
streams one recording (default: the 53 s sonnet reading, one turn with no commit
until its end) at the speed of speech (`--speed`), then commits it; `--repeats`
sessions one after another. Measured on the server while each session runs:

- the whisper model's requests (the hypotheses, and the completed turn's one) and
  decoder steps, from its metrics; and the server's processes' CPU seconds, per
  second of the session's audio (on the CPU, the engine's time);
- the session's side: the first delta after the audio began, the deltas sent
  while the audio was sent, and whether the deltas joined lose or misread words
  of the completed transcript.

    python -m bench.live_cost --out /tmp/live-cost --repeats 3   # the packaged tiny.en, on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import difflib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile
import soxr

from bench.clips import AUDIO_DIR
from bench.host import ServerProcesses
from bench.live_latency import RATE, STARTUP_TIMEOUT_S, gateway_process
from bench.live_quality import reference_text, wer
from bench.server_process import ServeCommand, ServerProcess
from gateway.local_agreement import comparison_key
from loadtest.metrics import whisper_samples
from loadtest.provenance import commit_info, machine_info

CHUNK_S = 0.1
EVENT_TIMEOUT_S = 600.0
REQUESTS = 'whisper_requests_total{outcome="success"}'


@dataclass(frozen=True)
class Row:
    audio_s: float
    whisper_requests: int  # the hypotheses and the completed turn's transcription
    decode_steps: int
    server_cpu_s: float
    server_cpu_s_per_audio_s: float
    cpu_s_per_request: float
    steps_per_request: float
    first_delta_s: float | None  # after the audio began
    deltas_while_sent: int
    words: int  # in the completed transcript
    lost: int  # of them, missing from the deltas joined
    misread: int  # words of the deltas that differ from the transcript's
    completed_after_commit_s: float
    transcript: str
    deltas_wer: float | None = None  # the deltas joined against the recording's own transcript
    completed_wer: float | None = None  # the completed transcript against it


def steps(samples: dict[str, float]) -> float:
    return sum(value for name, value in samples.items() if name.startswith("whisper_decode_steps_total"))


async def session(url: str, pcm: np.ndarray, speed: float) -> dict:
    """Stream `pcm` (24 kHz int16) as one turn, commit it; the events with their times."""
    from websockets.asyncio.client import connect

    events: list[tuple[float, dict]] = []
    async with connect(url.replace("http://", "ws://") + "/realtime?intent=transcription", max_size=None) as socket:
        async def read_until(kind: str, deadline: float) -> None:
            while not events or events[-1][1]["type"] != kind:
                message = await asyncio.wait_for(socket.recv(), max(0.0, deadline - time.monotonic()))
                events.append((time.monotonic(), json.loads(message)))

        await read_until("session.created", time.monotonic() + EVENT_TIMEOUT_S)
        await socket.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": RATE}, "transcription": {"model": "whisper-1",
                      "language": "en"}, "turn_detection": None}}}}))
        await read_until("session.updated", time.monotonic() + EVENT_TIMEOUT_S)
        step, started = int(CHUNK_S * RATE), time.monotonic()
        for index, offset in enumerate(range(0, len(pcm), step)):
            chunk = base64.b64encode(pcm[offset:offset + step].tobytes()).decode()
            await socket.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            due = started + (index + 1) * CHUNK_S / speed
            while (wait := due - time.monotonic()) > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    events.append((time.monotonic(), json.loads(await asyncio.wait_for(socket.recv(), wait))))
        sent_at, sent_events = time.monotonic(), len(events)
        await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await read_until("conversation.item.input_audio_transcription.completed", time.monotonic() + EVENT_TIMEOUT_S)
    return {"events": events, "started": started, "sent_at": sent_at, "sent_events": sent_events}


def row(audio_s: float, run: dict, before: dict, after: dict, cpu_s: float, reference: str) -> Row:
    events = run["events"]
    deltas = [(t, e["delta"]) for t, e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    completed = next(e for _, e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    said = [comparison_key(w) for w in "".join(d for _, d in deltas).split()]
    heard = [comparison_key(w) for w in completed["transcript"].split()]
    opcodes = difflib.SequenceMatcher(a=said, b=heard, autojunk=False).get_opcodes()
    requests = int(after.get(REQUESTS, 0) - before.get(REQUESTS, 0))
    decoded = int(steps(after) - steps(before))
    committed_at = run["sent_at"]
    return Row(
        audio_s=round(audio_s, 1), whisper_requests=requests, decode_steps=decoded,
        server_cpu_s=round(cpu_s, 1), server_cpu_s_per_audio_s=round(cpu_s / audio_s, 3),
        cpu_s_per_request=round(cpu_s / max(requests, 1), 3), steps_per_request=round(decoded / max(requests, 1), 1),
        first_delta_s=round(deltas[0][0] - run["started"], 2) if deltas else None,
        deltas_while_sent=sum(1 for _, e in events[:run["sent_events"]]
                              if e["type"] == "conversation.item.input_audio_transcription.delta"),
        words=len(heard), lost=sum(j2 - j1 for op, _, _, j1, j2 in opcodes if op == "insert"),
        misread=sum(i2 - i1 for op, i1, i2, _, _ in opcodes if op in ("replace", "delete")),
        completed_after_commit_s=round(events[-1][0] - committed_at, 2), transcript=completed["transcript"],
        deltas_wer=wer(reference, "".join(d for _, d in deltas)), completed_wer=wer(reference, completed["transcript"]),
    )


def markdown(rows: list[Row], header: str) -> str:
    lines = [header, "", "| audio | whisper requests | decoder steps | server CPU s | "
             "CPU s per audio s | CPU s per request | steps per request | first delta | deltas while sent | "
             "words lost / misread of | completed after commit | WER of the deltas / the completed transcript "
             "against the recording's own |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r.audio_s} s | {r.whisper_requests} | {r.decode_steps} | {r.server_cpu_s} | "
                     f"**{r.server_cpu_s_per_audio_s}** | {r.cpu_s_per_request} | {r.steps_per_request} | "
                     f"{r.first_delta_s} s | {r.deltas_while_sent} | {r.lost} / {r.misread} of {r.words} | "
                     f"{r.completed_after_commit_s} s | {r.deltas_wer} / {r.completed_wer} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recording", default="sonnet1_longform.wav", help="in tests/data/audio")
    parser.add_argument("--repeats", type=int, default=1, help="sessions, one after another")
    parser.add_argument("--speed", type=float, default=1.0, help="times the speed of speech")
    parser.add_argument("--checkpoint", help="as `whisper-triton serve --checkpoint` takes it (default: packaged)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    audio, rate = soundfile.read(AUDIO_DIR / args.recording, dtype="float32")
    pcm = (np.clip(soxr.resample(audio, rate, RATE), -1, 1) * 32767).astype("<i2")
    audio_s = len(pcm) / RATE
    reference = reference_text(args.recording)  # the manifest read once, not per session
    command = ServeCommand(checkpoint=args.checkpoint)
    rows = []
    with ServerProcess(command, args.out / "serve.log", STARTUP_TIMEOUT_S):
        processes = ServerProcesses.find(command.ports["grpc"])
        metrics_url = command.metrics_url
        with gateway_process(command.grpc_url, args.out / "gateway.log") as gateway:
            for _ in range(args.repeats):
                before, cpu_before = whisper_samples(metrics_url), processes.cpu_seconds()
                run = asyncio.run(session(gateway.url, pcm, args.speed))
                after, cpu_after = whisper_samples(metrics_url), processes.cpu_seconds()
                cpu_s = sum(cpu_after[p] - cpu_before[p] for p in cpu_before
                            if cpu_before[p] is not None and cpu_after.get(p) is not None)
                rows.append(row(audio_s, run, before, after, cpu_s, reference))
                print(markdown(rows[-1:], ""), flush=True)
    commit, machine = commit_info(), machine_info()
    header = (f"# A live session's cost on the server\n\nCommit {commit.commit[:7]}"
              f"{' (with uncommitted changes)' if commit.dirty else ''}, {machine['cpu']}, {machine['cpu_count']} "
              f"cores; {args.recording} ({audio_s:.1f} s) as one turn at {args.speed:g}x the speed "
              f"of speech; command: `python -m bench.live_cost --out {args.out} --repeats {args.repeats}`.")
    (args.out / "live-cost.json").write_text(json.dumps({"rows": [asdict(r) for r in rows]}, indent=1))
    (args.out / "live-cost.md").write_text(markdown(rows, header))
    print(markdown(rows, header), flush=True)


if __name__ == "__main__":
    main()
