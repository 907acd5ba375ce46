"""TOKENS carries enough for postprocessing to rebuild the library's transcript exactly."""

from __future__ import annotations

import numpy as np
import pytest

from python_backend_lib import token_stream
from python_backend_lib.longform import TranscribeOptions
from python_backend_lib.options import DecodingOptions
from python_backend_lib.serving import exact_seconds
from conftest import AUDIO_DIR

EOT = 50256
CLIPS = ["jfk.wav", "cards_001.wav", "sonnet1_longform.wav"]  # 11 s, 1.1 s, 53 s (two windows or more)


@pytest.fixture(scope="module")
def pipeline():
    from python_backend_lib.pipeline import Pipeline

    pipe = Pipeline.load("default")
    yield pipe
    pipe.close()


@pytest.mark.slow
@pytest.mark.parametrize("timestamps", [False, True], ids=["text", "timestamps"])
@pytest.mark.parametrize("clip", CLIPS)
def test_stream_rebuilds_the_transcript(pipeline, clip, timestamps):
    options = TranscribeOptions(decoding=DecodingOptions(timestamps=timestamps))
    transcript = pipeline.transcribe((AUDIO_DIR / clip).read_bytes(), options)
    stream = token_stream.pack(transcript, options, pipeline.tokenizer.special.eot)
    assert stream.dtype == np.int32 and len(token_stream.unpack(stream, pipeline.tokenizer.special.eot)) == len(
        transcript.windows
    )
    duration = exact_seconds(float(np.float32(transcript.duration)))  # as AUDIO_SECONDS carries it
    windows = token_stream.unpack(stream.tolist(), pipeline.tokenizer.special.eot)
    text, segments = token_stream.transcript_text_and_segments(pipeline.tokenizer, windows, duration)
    assert text == transcript.text
    assert [(s.start, s.end, s.text) for s in segments] == [(s.start, s.end, s.text) for s in transcript.segments]


def test_unpack_splits_at_end_of_text():
    assert token_stream.unpack([1, 2, EOT, EOT, 3, EOT], EOT) == [(1, 2), (), (3,)]
    assert token_stream.unpack([], EOT) == []


def test_unpack_rejects_an_unfinished_window():
    with pytest.raises(ValueError, match="must end with <|endoftext|>"):
        token_stream.unpack([1, 2, EOT, 3], EOT)


@pytest.mark.parametrize(
    ("seconds", "frames"),
    [(0.005, 0), (1.095, 109), (30.0, 3000), (53.2671875, 5326)],
)
def test_audio_frames_counts_whole_mel_frames(seconds, frames):
    assert token_stream.audio_frames(seconds) == frames
