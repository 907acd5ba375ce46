"""What word alignment costs the engine thread, which runs it between decoder steps
(`transcription.alignment`): the operations a round of alignments launches, and its
wall time, for one window alone and for several delivered together.

Every live hypothesis asks for word timestamps, and batch clients usually do not; a
decoder step of any number of rows is one graph replay on a GPU, while the windows a
step delivers are aligned in an eager decoder pass of their own, with reads back to the
host (`transcription.alignment_rounds`: one pass a round). This transcribes one clip
with word timestamps through the library (`Pipeline`, the packaged tiny.en by default),
alone and then `--together` copies at once, several times each, and records each
`Aligner.align_many` call: how many windows it aligned, its wall time, and for the first
call of each size, under PyTorch's profiler, how many top-level operations it ran (each
a kernel launch on a GPU). Writes `<out>/alignment-cost.json`.

    python -m bench.alignment_cost --out /tmp/alignment-cost                  # the CPU
    python -m bench.alignment_cost --device cuda --out /tmp/alignment-cost    # a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.clips import AUDIO_DIR
from loadtest.provenance import provenance
from python_backend_lib.core.options import DecodingOptions, TranscribeOptions
from python_backend_lib.transcription import alignment


@dataclass(frozen=True)
class AlignmentCall:
    windows: int
    ms: float
    operations: int | None  # top-level PyTorch operations; None: not profiled


def top_level_operations(profile: torch.profiler.profile) -> int:
    """The profiled aten operations not called from another one: what Python launched."""
    aten = [e for e in profile.events() if e.name.startswith("aten::")]
    return sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))


def measure(checkpoint: str, device: str, clip: Path, repeats: int, together: int) -> list[AlignmentCall]:
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load(checkpoint, device=device)
    calls: list[AlignmentCall] = []
    shipped = alignment.Aligner.align_many

    def synchronize() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def recorded(self, requests):
        profiled = all(c.windows != len(requests) for c in calls)  # the first of each size, profiled
        synchronize()
        start = time.perf_counter()
        if profiled:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                result = shipped(self, requests)
        else:
            result = shipped(self, requests)
        synchronize()
        calls.append(AlignmentCall(len(requests), round((time.perf_counter() - start) * 1e3, 3),
                                   top_level_operations(profile) if profiled else None))
        return result

    options = TranscribeOptions(decoding=DecodingOptions(language="en", timestamps=True), word_timestamps=True)
    audio = clip.read_bytes()
    alignment.Aligner.align_many = recorded
    try:
        for _ in range(repeats):
            pipeline.transcribe(audio, options)
        for _ in range(repeats):
            pipeline.transcribe_many([audio] * together, options)
    finally:
        alignment.Aligner.align_many = shipped
        pipeline.close()
    return calls


def summary(calls: list[AlignmentCall]) -> list[dict]:
    """Per number of windows a call aligned: its operations, and its median wall time
    unprofiled, in all and per window."""
    rows = []
    for windows in sorted({c.windows for c in calls}):
        mine = [c for c in calls if c.windows == windows]
        timed = [c.ms for c in mine if c.operations is None] or [c.ms for c in mine]
        ms = statistics.median(timed)
        rows.append({"windows": windows, "calls": len(mine), "operations": mine[0].operations,
                     "ms_median": round(ms, 3), "ms_per_window": round(ms / windows, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="default", help="the packaged tiny.en unless given")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clip", type=Path, default=AUDIO_DIR / "jfk.wav")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--together", type=int, default=8, help="copies of the clip sent at once")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    calls = measure(args.checkpoint, args.device, args.clip, args.repeats, args.together)
    data = {"provenance": provenance(), "checkpoint": args.checkpoint, "device": args.device,
            "clip": args.clip.name, "together": args.together, "summary": summary(calls),
            "calls": [asdict(c) for c in calls]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alignment-cost.json").write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
