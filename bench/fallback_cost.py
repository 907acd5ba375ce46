"""What the temperature fallback costs on one clip: the library alone on the CPU, real base.

    python -m bench.fallback_cost [--clip PATH] [--repeats 5]

Transcribes and translates the clip with the shipped fallback, and translates it with
fallback off (temperature_increment 0), each `--repeats` times after one warm-up: the
median, lowest and highest wall time, the temperatures of the segments kept, and the
text. docs/parameters.md's "Temperature fallback" quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import time

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.core.options import DecodingOptions, Task, TranscribeOptions
from python_backend_lib.transcription.pipeline import Pipeline

CLIP = "tests/data/multilingual/ja_mfa_cv_ja_24511055.mp3"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fallback_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clip", default=CLIP)
    parser.add_argument("--checkpoint", default="base")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    audio = decode_audio(open(args.clip, "rb").read())
    print(f"{args.clip}: {len(audio) / 16000:.2f} s")
    translate = DecodingOptions(task=Task.TRANSLATE, timestamps=True)
    variants = {
        "transcribed, fallback on (shipped)": TranscribeOptions(decoding=DecodingOptions(timestamps=True)),
        "translated, fallback on (shipped)": TranscribeOptions(decoding=translate),
        "translated, fallback off (temperature_increment 0)": TranscribeOptions(decoding=translate,
                                                                                 temperature_increment=0),
    }
    pipeline = Pipeline.load(args.checkpoint, device="cpu")
    try:
        pipeline.transcribe(audio, variants["translated, fallback off (temperature_increment 0)"])  # warm-up
        for name, options in variants.items():
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                result = pipeline.transcribe(audio, options)
                times.append(time.perf_counter() - started)
            temperatures = sorted({segment.temperature for segment in result.segments})
            print(f"{name}: median {statistics.median(times):.2f} s (lowest {min(times):.2f}, highest "
                  f"{max(times):.2f}); temperatures kept {temperatures}; {result.text!r}", flush=True)
    finally:
        pipeline.close()


if __name__ == "__main__":
    main()
