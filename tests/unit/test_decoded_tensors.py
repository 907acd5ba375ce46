"""What crosses from `whisper` to `postprocessing`: a decoded recording as numeric tensors,
read back exactly, assembled into the library's own transcript, and refused with the
client's error when the tensors do not hold together; the postprocessing side runs
without torch."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from reference import DATA

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.contract import tensor_names
from python_backend_lib.contract.decoded_tensors import COLUMN, DecodedTensors, from_tensors, to_tensors
from python_backend_lib.core.decoded import DecodedRecording, DecodedWindow
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import DecodingOptions, LongFormMode, TranscribeOptions
from python_backend_lib.serving.postprocessing_service import transcript_document
from python_backend_lib.serving.responses import transcript_outputs
from python_backend_lib.text.formats import Document, ResponseFormat
from python_backend_lib.text.transcript import assemble
from python_backend_lib.transcription.pipeline import Pipeline


@pytest.fixture(scope="module")
def pipe():
    pipeline = Pipeline.load("default", device="cpu")
    yield pipeline
    pipeline.close()


def decoded(pipe: Pipeline, clip: str, options: TranscribeOptions) -> DecodedRecording:
    waveform = decode_audio((DATA / clip).read_bytes())
    (features,) = pipe.features([waveform])
    return pipe.submit_decoded(features, len(waveform), options).result(timeout=300)


# What a window's decoding measured, summed in float32 (verbose_json's segments).
FLOAT_STATISTICS = ("avg_logprob", "compression_ratio", "no_speech_prob")
CASES = {
    "words": ("jfk.wav", TranscribeOptions(word_timestamps=True)),
    "no-timestamps": ("cards_002.wav", TranscribeOptions(decoding=DecodingOptions(timestamps=False))),
    "long-batched": ("sonnet1_longform.wav", TranscribeOptions(mode=LongFormMode.BATCHED)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_decoded_recording_crosses_exactly_and_assembles_as_the_library(pipe, case):
    clip, options = CASES[case]
    recording = decoded(pipe, clip, options)
    tensors = to_tensors(recording)
    assert tensors.tokens.dtype == np.int32 and tensors.windows.dtype == np.float64
    crossed = DecodedTensors.of({name: np.array(a) for name, a in tensors.by_name().items()}.__getitem__)  # by name
    back = from_tensors(crossed, recording.samples)
    assert back == recording  # every token, statistic and time, to the last bit
    # What the postprocessing model writes (its library part, `transcript_document`).
    document = transcript_document(crossed, recording.samples, None, options, pipe.tokenizer)
    ours = transcript_outputs(document, ResponseFormat.VERBOSE_JSON)[tensor_names.FORMATTED]
    assert ours == Document.from_transcript(pipe.assemble(recording), options).render(ResponseFormat.VERBOSE_JSON)
    # And the library's own path, decoding again, gives the same transcript: every word,
    # token and time. Its windows may be batched otherwise on a busy machine (three test
    # workers on two cores did it), and the encoder's float sums then differ in the last
    # bits: the statistics agree to float32 rounding, not to the bit.
    library = json.loads(Document.from_transcript(pipe.transcribe((DATA / clip).read_bytes(), options), options)
                         .render(ResponseFormat.VERBOSE_JSON))
    mine = json.loads(ours)
    for segment in mine["segments"]:
        for statistic in FLOAT_STATISTICS:
            segment[statistic] = pytest.approx(segment[statistic], rel=1e-6)
    assert mine == library
    if case == "words":
        assert tensors.windows[0, COLUMN["aligned"]] == len(tensors.alignment) > 2
        assert math.isnan(tensors.alignment[-1, 1])  # the end of the last word has no probability
    if case == "long-batched":
        assert len(recording.windows) > 1 and any(w.closes_chunk for w in recording.windows)


def recording_of(*windows: DecodedWindow, language="en", probability=None) -> DecodedRecording:
    return DecodedRecording(windows, samples=16000, language=language, language_probability=probability)


WINDOW = DecodedWindow((50363, 314, 50413), seek=0, frames=100, temperature=0.0, avg_logprob=-0.25,
                       compression_ratio=0.5, no_speech_prob=0.01)


def broken(**changes) -> DecodedTensors:
    good = to_tensors(recording_of(WINDOW, language="de", probability=0.75))
    return dataclasses.replace(good, **changes)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (broken(windows=np.zeros((1, 9))), r"WINDOWS must have the shape \[windows, 10\], got \[1, 9\]"),
        (broken(tokens=np.zeros((1, 3), np.int32)), r"TOKENS must have the shape \[tokens\], got \[1, 3\]"),
        (broken(tokens=np.zeros(2, np.int32)), "WINDOWS counts 3 tokens and 0 alignment rows, but TOKENS has 2"),
        (broken(alignment=np.zeros((4, 2))), "but TOKENS has 3 and ALIGNMENT 4"),
        (broken(language=np.array([100], np.int32)), r"LANGUAGE must be a language's index, 0 to 99, or -1"),
        (broken(language_probability=np.array([1.5])), "LANGUAGE_PROBABILITY must be from 0 to 1"),
        (broken(windows=to_tensors(recording_of(WINDOW)).windows * [0.5, *[1] * 9]), "whole numbers"),
        (broken(windows=to_tensors(recording_of(WINDOW)).windows * [np.nan, *[1] * 9]), "not a number"),
    ],
    ids=["windows-shape", "tokens-shape", "token-count", "alignment-count", "language", "probability", "fraction", "nan"],
)
def test_tensors_that_do_not_hold_together_are_refused_naming_the_problem(tensors, message):
    with pytest.raises(RequestError, match=message):
        from_tensors(tensors, samples=16000)


def test_word_times_that_do_not_fit_the_windows_tokens_are_refused(pipe):
    timed = dataclasses.replace(WINDOW, token_times=(0.0, 0.5), token_probabilities=(0.9,))  # one text token: fits
    assert assemble(recording_of(timed), pipe.tokenizer).segments[0].words[0].end == 0.5
    short = dataclasses.replace(WINDOW, token_times=(0.0,), token_probabilities=())
    with pytest.raises(RequestError, match="a window of 1 text tokens came with 1 token times and 0 probabilities"):
        assemble(from_tensors(to_tensors(recording_of(short)), 16000), pipe.tokenizer)


def test_the_postprocessing_side_runs_without_torch():
    code = (
        "import sys\n"
        "from python_backend_lib.serving import postprocessing_service\n"
        "from python_backend_lib.checkpoints.configs import load_config\n"
        "from python_backend_lib.text.tokenizer import load_tokenizer\n"
        "load_tokenizer(load_config('default'))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
