"""Live turns against the offline transcript (issue 39, item 6): a long reading streamed
through the Realtime API at the speed of speech, its turns cut by `server_vad`, their
completed transcripts joined, against the whole file's transcript from the same server.

    python -m bench.live_quality --out /tmp/live-quality     # the packaged tiny.en, on the CPU
    python -m bench.live_quality --checkpoints default base --out /tmp/live-quality   # and base

Recordings: the 53 s sonnet reading (tests/data/audio) and the three-minute recording
of tests/long_recording.py (every test clip, 2.5 s of silence between them). Each is
one session with the gateway's default `server_vad`, the turns' transcripts joined in
turn order (`item_id`s in the order their audio was committed). The offline transcript
is `/v1/audio/transcriptions` on the same gateway and server, language "en". Words are
compared as the tests compare them (`tests.reference.normalize`: lower case, no
punctuation, hyphens split, numbers spelt out): the joined turns against the offline
transcript (how often the two read a word otherwise), and each against the recording's
own transcript (the manifest's; the three-minute recording's clips' in order), so that
a disagreement shows on which side the errors are. Writes `<out>/live-quality.json` and
`.md`; `--rescore JSON` scores a written record's transcripts again.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile
import soxr

from bench.clips import AUDIO_DIR
from bench.live_latency import MODEL, RATE, STARTUP_TIMEOUT_S, gateway_process
from bench.server_process import ServeCommand, ServerProcess
from loadtest.provenance import provenance

CHUNK_S = 0.1
TRAILING_SILENCE_S = 3.0  # after the audio, so that server_vad closes the last turn
EVENT_TIMEOUT_S = 600.0
TARGET_WER = 0.03
COMMITTED = "input_audio_buffer.committed"
COMPLETED = "conversation.item.input_audio_transcription.completed"


@dataclass(frozen=True)
class Result:
    recording: str
    audio_s: float
    turns: int
    empty_turns: int  # completed with no text
    live: str  # the completed turns, joined in order
    offline: str
    reference: str  # the recording's own transcript
    wer: float  # the joined turns against the offline transcript
    live_wer: float  # the joined turns against the reference
    offline_wer: float  # the offline transcript against the reference
    checkpoint: str = "default"  # the served checkpoint, as `serve --checkpoint` takes it


def wer(reference: str, hypothesis: str) -> float:
    from bench.beam_wer import edits
    from tests.reference import normalize

    ref = normalize(reference)
    return round(edits(ref, normalize(hypothesis)) / max(1, len(ref)), 4)


def scored(recording: str, audio_s: float, turns: int, empty: int, live: str, offline_text: str, reference: str,
           checkpoint: str = "default") -> Result:
    return Result(recording, audio_s, turns, empty, live, offline_text, reference,
                  wer(offline_text, live), wer(reference, live), wer(reference, offline_text), checkpoint)


def reference_text(name: str) -> str:
    if name == "long":
        from tests.long_recording import build

        return " ".join(build().reference_words)
    from loadtest.clips import read_manifest

    return next(r.transcript for r in read_manifest(AUDIO_DIR) if r.name == name)


def recording(name: str) -> tuple[np.ndarray, int]:
    if name == "long":
        from tests.long_recording import build

        built = build()
        return built.waveform.astype(np.float32), 16_000
    return soundfile.read(AUDIO_DIR / name, dtype="float32")


async def live_turns(url: str, pcm: np.ndarray) -> list[str]:
    """Stream `pcm` (24 kHz int16) with server_vad at the speed of speech, then silence;
    the completed turns' transcripts in the order their audio was committed."""
    from websockets.asyncio.client import connect

    committed, completed = [], {}
    async with connect(url.replace("http://", "ws://") + "/realtime?intent=transcription", max_size=None) as socket:
        async def receive(timeout: float) -> None:
            event = json.loads(await asyncio.wait_for(socket.recv(), timeout))
            if event["type"] == COMMITTED:
                committed.append(event["item_id"])
            elif event["type"] == COMPLETED:
                completed[event["item_id"]] = event["transcript"]

        await receive(EVENT_TIMEOUT_S)  # session.created
        await socket.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": RATE}, "transcription": {"model": MODEL,
                      "language": "en"}, "turn_detection": {"type": "server_vad"}}}}}))
        silence = np.zeros(int(TRAILING_SILENCE_S * RATE), dtype="<i2")
        audio, step, started = np.concatenate([pcm, silence]), int(CHUNK_S * RATE), time.monotonic()
        for index, offset in enumerate(range(0, len(audio), step)):
            chunk = base64.b64encode(audio[offset:offset + step].tobytes()).decode()
            await socket.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            due = started + (index + 1) * CHUNK_S
            while (wait := due - time.monotonic()) > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await receive(wait)
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while len(completed) < len(committed) or not committed:
            await receive(max(0.0, deadline - time.monotonic()))
    return [completed[item] for item in committed]


def offline(url: str, waveform: np.ndarray, rate: int) -> str:
    from openai import OpenAI

    buffer = io.BytesIO()
    soundfile.write(buffer, waveform, rate, format="WAV", subtype="FLOAT")
    client = OpenAI(base_url=url, api_key="not-needed", timeout=EVENT_TIMEOUT_S)
    return client.audio.transcriptions.create(model=MODEL, file=("recording.wav", buffer.getvalue()),
                                              language="en").text.strip()


def markdown(results: list[Result], record: dict) -> str:
    run = record["provenance"]
    lines = [
        "# Live turns against the offline transcript", "",
        f"Commit {run['commit'][:7]} (dirty: {run['dirty']}), {run['machine']['cpu']}, "
        f"{run['machine']['cpu_count']} CPUs; `{run['command']}`. Target: WER at most {TARGET_WER}.", "",
        "| checkpoint | recording | audio | turns | empty turns | the joined turns against the offline transcript "
        "(WER) | the joined turns against the reference | the offline transcript against the reference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.checkpoint} | {r.recording} | {r.audio_s} s | {r.turns} | {r.empty_turns} | {r.wer:.4f} | "
                     f"{r.live_wer:.4f} | {r.offline_wer:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recordings", nargs="+", default=["sonnet1_longform.wav", "long"],
                        help="files in tests/data/audio, or long (tests/long_recording.py's)")
    parser.add_argument("--rescore", type=Path, help="score this written live-quality.json's transcripts again")
    parser.add_argument("--checkpoints", nargs="+", default=["default"],
                        help="served one after another, as `whisper-triton serve --checkpoint` takes them")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rescore:
        record = json.loads(args.rescore.read_text())
        results = [scored(r["recording"], r["audio_s"], r["turns"], r["empty_turns"], r["live"], r["offline"],
                          reference_text(r["recording"]), r.get("checkpoint", "default")) for r in record["results"]]
        return write(args.out, results, record["provenance"])
    results = []
    for checkpoint in args.checkpoints:
        command = ServeCommand(checkpoint=None if checkpoint == "default" else checkpoint)
        with ServerProcess(command, args.out / f"serve-{checkpoint}.log", STARTUP_TIMEOUT_S):
            with gateway_process(command.grpc_url, args.out / f"gateway-{checkpoint}.log") as gateway:
                for name in args.recordings:
                    waveform, rate = recording(name)
                    pcm = (np.clip(soxr.resample(waveform, rate, RATE), -1, 1) * 32767).astype("<i2")
                    print(f"{checkpoint}, {name}: streaming {len(pcm) / RATE:.1f} s", flush=True)
                    turns = asyncio.run(live_turns(gateway.url, pcm))
                    live = " ".join(t.strip() for t in turns if t.strip())
                    results.append(scored(name, round(len(waveform) / rate, 1), len(turns),
                                          sum(not t.strip() for t in turns), live, offline(gateway.url, waveform, rate),
                                          reference_text(name), checkpoint))
                    print(f"{checkpoint}, {name}: {len(turns)} turns, WER {results[-1].wer:.4f}", flush=True)
    return write(args.out, results, provenance())


def write(out: Path, results: list[Result], run: dict) -> int:
    record = {"provenance": run, "target_wer": TARGET_WER, "results": [asdict(r) for r in results]}
    (out / "live-quality.json").write_text(json.dumps(record, indent=1))
    (out / "live-quality.md").write_text(markdown(results, record))
    print(markdown(results, record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
