"""How `vad_filter` changes throughput on the CPU: the VAD's own cost, and a served
recording transcribed with and without it.

Two recordings made of the test clips (tests/data/audio): `sparse`, three clips
with 8 to 30 s of faint noise between them (four fifths not speech, as in
tests/served/test_vad_served.py), and `dense`, the 53 s sonnet read without long pauses.
Each is sent to one `whisper-triton serve` (the packaged tiny.en) `--repeats`
times, one request at a time, with vad_filter off and on; the VAD alone is timed
in this process on one thread, as preprocessing runs it.

    python -m bench.vad --out docs/benchmarks/vad
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile

from bench.clips import AUDIO_DIR, wav_bytes
from bench.server_process import ServeCommand, ServerProcess
from python_backend_lib.audio import vad
from python_backend_lib.core.geometry import SAMPLE_RATE

SPARSE = (8.0, "jfk.wav", 30.0, "sense_and_sensibility_01_austen_64kb-0870.wav", 25.0, "goforward.wav", 12.0)
DENSE = ("sonnet1_longform.wav",)
NOISE_RMS = 0.003


def recording(pieces: tuple) -> np.ndarray:
    rng = np.random.default_rng(29)
    parts = []
    for piece in pieces:
        if isinstance(piece, str):
            parts.append(soundfile.read(AUDIO_DIR / piece, dtype="float32")[0])
        else:
            parts.append((rng.standard_normal(round(piece * SAMPLE_RATE)) * NOISE_RMS).astype(np.float32))
    return np.concatenate(parts)


def transcribe_seconds(grpc_url: str, audio: bytes, vad_filter: bool) -> tuple[float, str]:
    import tritonclient.grpc

    client = tritonclient.grpc.InferenceServerClient(grpc_url)
    tensor = tritonclient.grpc.InferInput("AUDIO", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[audio]], dtype=np.object_))
    parameters = {"response_format": "text", **({"vad_filter": True} if vad_filter else {})}
    started = time.perf_counter()
    response = client.infer("transcribe", [tensor], parameters=parameters)
    elapsed = time.perf_counter() - started
    client.close()
    return elapsed, response.as_numpy("TEXT")[0, 0].decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/vad"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    recordings = {"sparse": recording(SPARSE), "dense": recording(DENSE)}
    rows = []
    vad.speech_timestamps(recordings["dense"][:SAMPLE_RATE])  # load the ONNX session once
    with tempfile.TemporaryDirectory() as folder, ServerProcess(
        ServeCommand(checkpoint=None), Path(folder) / "serve.log", startup_timeout_s=600
    ) as server:
        for name, waveform in recordings.items():
            seconds = len(waveform) / SAMPLE_RATE
            started = time.perf_counter()
            spans = vad.speech_timestamps(waveform)
            vad_alone = time.perf_counter() - started
            kept = sum(s.end - s.start for s in spans) / SAMPLE_RATE
            audio = wav_bytes(waveform)
            transcribe_seconds(server.command.grpc_url, audio, False)  # warm up this recording's shapes
            for vad_filter in (False, True):
                times = [transcribe_seconds(server.command.grpc_url, audio, vad_filter) for _ in range(args.repeats)]
                median = statistics.median(t for t, _ in times)
                rows.append(dict(
                    recording=name, audio_s=round(seconds, 2), vad_filter=vad_filter,
                    speech_kept_s=round(kept, 2) if vad_filter else round(seconds, 2),
                    vad_alone_s=round(vad_alone, 3) if vad_filter else 0.0,
                    median_s=round(median, 2), runs_s=[round(t, 2) for t, _ in times],
                    rtfx=round(seconds / median, 1), text=times[0][1],
                ))  # fmt: skip
                print(rows[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"command": "python -m bench.vad --out " + str(args.out), "machine": platform.processor() or platform.machine(),
              "server": "whisper-triton serve (packaged tiny.en, CPU)", "rows": rows}
    (args.out / "vad.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = ["| recording | audio s | vad_filter | speech kept s | VAD alone s | median s | RTFx |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['recording']} | {r['audio_s']} | {'on' if r['vad_filter'] else 'off'} | {r['speech_kept_s']} "
                     f"| {r['vad_alone_s']} | {r['median_s']} | {r['rtfx']} |")
    (args.out / "vad.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
