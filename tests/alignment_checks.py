"""What the word-alignment tests on the CPU and on a GPU share: a recording's window to
align, made as the engine makes it, and a count of the `align_many` calls a pipeline's
alignment rounds make."""

from __future__ import annotations

from pathlib import Path

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.features import window_features
from python_backend_lib.core import geometry
from python_backend_lib.core.options import DecodingOptions, Task, TranscribeOptions
from python_backend_lib.transcription.alignment import AlignmentRequest


def window_to_align(pipeline, path: Path) -> AlignmentRequest:
    """A recording of one window (at most 30 s), transcribed with timestamps by
    `pipeline`, as a request to align from its features (no kept KV slot)."""
    waveform = decode_audio(path.read_bytes())
    segments = pipeline.transcribe(waveform, TranscribeOptions(decoding=DecodingOptions(timestamps=True))).segments
    assert segments
    return AlignmentRequest(tuple(segments), window_features(waveform, pipeline.n_mels),
                            len(waveform) // geometry.HOP_LENGTH, "en", Task.TRANSCRIBE)


def count_align_many(monkeypatch, pipeline) -> list[int]:
    """From now on, the number of windows of each `align_many` call the pipeline's
    alignment rounds make (its aligner still aligns them)."""
    calls: list[int] = []
    aligner = pipeline.alignments.aligner

    class Counting:
        def align_many(self, requests):
            calls.append(len(requests))
            return aligner.align_many(requests)

    monkeypatch.setattr(pipeline.alignments, "aligner", Counting())
    return calls
