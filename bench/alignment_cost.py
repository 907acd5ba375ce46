"""What one window's word alignment costs the engine thread, which runs it between decoder
steps (`transcription.alignment`): the operations it launches, and its wall time.

Every live hypothesis asks for word timestamps, and batch clients usually do not; a
decoder step of any number of rows is one graph replay on a GPU, while each window's
alignment is an eager decoder pass of its own, with reads back to the host. This
transcribes one clip with word timestamps several times through the library
(`Pipeline`, the packaged tiny.en by default) and records each `Aligner.align` call:
its wall time, and once, under PyTorch's profiler, how many top-level operations it ran
(each a kernel launch on a GPU). Writes `<out>/alignment-cost.json`.

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
    ms: float
    operations: int | None  # top-level PyTorch operations; None: not profiled


def top_level_operations(profile: torch.profiler.profile) -> int:
    """The profiled aten operations not called from another one: what Python launched."""
    aten = [e for e in profile.events() if e.name.startswith("aten::")]
    return sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))


def measure(checkpoint: str, device: str, clip: Path, repeats: int) -> list[AlignmentCall]:
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load(checkpoint, device=device)
    calls: list[AlignmentCall] = []
    shipped = alignment.Aligner.align

    def recorded(self, *args, **kwargs):
        profiled = not calls  # the first call under the profiler, the rest timed alone
        synchronize()
        start = time.perf_counter()
        if profiled:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                result = shipped(self, *args, **kwargs)
        else:
            result = shipped(self, *args, **kwargs)
        synchronize()
        calls.append(AlignmentCall(round((time.perf_counter() - start) * 1e3, 3),
                                   top_level_operations(profile) if profiled else None))
        return result

    def synchronize() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    options = TranscribeOptions(decoding=DecodingOptions(language="en", timestamps=True), word_timestamps=True)
    alignment.Aligner.align = recorded
    try:
        for _ in range(repeats):
            pipeline.transcribe(clip.read_bytes(), options)
    finally:
        alignment.Aligner.align = shipped
        pipeline.close()
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="default", help="the packaged tiny.en unless given")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clip", type=Path, default=AUDIO_DIR / "jfk.wav")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    calls = measure(args.checkpoint, args.device, args.clip, args.repeats)
    timed = [c.ms for c in calls[1:]] or [calls[0].ms]
    summary = {"alignments": len(calls), "operations": calls[0].operations,
               "ms_median_unprofiled": round(statistics.median(timed), 3)}
    data = {"provenance": provenance(), "checkpoint": args.checkpoint, "device": args.device,
            "clip": args.clip.name, **summary, "calls": [asdict(c) for c in calls]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alignment-cost.json").write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
