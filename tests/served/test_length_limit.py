"""The length invariant: no row ever reads or writes past the 448 text positions.

A row that reaches the limit ends unfinished, as openai-whisper's does at its
sample length, and the fallback and long-form rules carry on from there. The
rows here are forced to the limit (<|endoftext|> suppressed until 448 tokens,
more than any row may generate) on a random multilingual model, in every path
that shapes a row's room: a detected language (whose language and task tokens
lengthen the prompt once decoding has begun), timestamps on and off, sampled
best_of, beams, and previous text longer than a prompt keeps. Then the real base
checkpoint translates the Japanese clip through the server, with fallback and
with beams, where sampled candidates used to run past the room.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from test_faults import transcribe
from tritonclient.utils import InferenceServerException

from python_backend_lib.audio.features import window_features
from python_backend_lib.core import geometry
from python_backend_lib.core.options import MAX_TEXT_POSITIONS, DecodingOptions, DecodingResult, Task
from python_backend_lib.engine.loading import EngineSetup
from python_backend_lib.engine.prompt import task_tokens, transcript_prefix
from python_backend_lib.transcription.alignment import Aligner
from python_backend_lib.transcription.pipeline import Pipeline

SOURCE = "random:tiny:5"  # multilingual: language detection, <|translate|>
FORCED = dict(min_new_tokens=MAX_TEXT_POSITIONS)  # never ends by itself: it meets the limit
LONG_PREVIOUS = tuple(range(300, 700))  # previous text far over the 223 tokens a prompt keeps
JAPANESE = "tests/data/multilingual/ja_mfa_cv_ja_24511055.mp3"


@pytest.fixture(scope="module")
def pipe():
    pipeline = Pipeline.load(SOURCE, device="cpu", setup=EngineSetup(slots=12))
    yield pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def waveform():
    return np.random.default_rng(3).standard_normal(geometry.SAMPLE_RATE * 5).astype(np.float32) * 0.1


CASES = {
    "detected, timestamps": DecodingOptions(timestamps=True, **FORCED),
    "detected, translate, no timestamps": DecodingOptions(task=Task.TRANSLATE, **FORCED),
    "detected, sampled best_of 3": DecodingOptions(temperature=0.7, best_of=3, timestamps=True, **FORCED),
    "detected, beams 3": DecodingOptions(beam_size=3, timestamps=True, **FORCED),
    "given, long previous text": DecodingOptions(language="de", previous_tokens=LONG_PREVIOUS, **FORCED),
    "detected, previous text, beams 2": DecodingOptions(beam_size=2, previous_tokens=LONG_PREVIOUS, **FORCED),
}


@pytest.fixture(scope="module")
def forced(pipe, waveform) -> dict[str, DecodingResult]:
    """Every case's row, decoded side by side in one batch (12 slots hold them all, beams
    and candidates included): each row's room is its own, and 448 steps taken once."""
    return dict(zip(CASES, pipe.decode([waveform] * len(CASES), list(CASES.values()))))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_row_forced_to_the_limit_fills_the_context_exactly_and_ends_unfinished(pipe, forced, case):
    options, result = CASES[case], forced[case]
    assert not result.finished
    prompt = len(result.prompt_tokens)
    if options.language is None:  # the language and task tokens the detection added
        prompt += len(task_tokens(pipe.engine.config, result.language, options.task, options.timestamps))
    assert prompt + len(result.tokens) == MAX_TEXT_POSITIONS, (prompt, len(result.tokens))


@pytest.mark.slow
def test_word_timestamps_of_a_window_that_filled_the_context(pipe, waveform):
    """The alignment pass feeds a window's text tokens behind a prompt of its own,
    which may be longer than the one they were decoded after: the tokens that do
    not fit are not aligned, and nothing reads past the context."""
    config = pipe.engine.config
    aligner = Aligner(pipe.engine.batch.model, config, tokenizer=None)
    features = window_features(waveform, pipe.n_mels)
    prompt = len(transcript_prefix(config, "de", Task.TRANSCRIBE, timestamps=False))
    tokens = list(range(1000, 1000 + MAX_TEXT_POSITIONS - 2))  # 446 text tokens: more than fit behind the prompt
    audio = aligner.window_audio(features)
    starts, probabilities = aligner.token_starts(audio, tokens, geometry.N_FRAMES, "de", Task.TRANSCRIBE)
    fits = MAX_TEXT_POSITIONS - prompt - 1
    assert len(starts) == len(tokens) + 1 and len(probabilities) == len(tokens)
    assert all(0.0 <= p <= 1.0 for p in probabilities[:fits]) and probabilities[fits:] == [0.0] * (len(tokens) - fits)
    assert np.all(np.diff(starts) >= 0) and np.all(starts[fits:] == starts[fits])


@pytest.mark.server
@pytest.mark.slow
def test_the_japanese_clip_translates_with_fallback_and_beams_every_time(base_server):
    """Real base, as issue 36 found it: sampled fallback candidates ran past the room
    and failed the request with IndexError about half the time."""
    audio = open(JAPANESE, "rb").read()
    asks = [{"task": "translate"}] * 2 + [{"task": "translate", "beam_size": 5, "best_of": 5}] * 2
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda ask: transcribe(base_server.grpc_url, "grpc", audio, **ask), asks))
    for ask, answer in zip(asks, answers):
        assert not isinstance(answer, InferenceServerException), (ask, answer)
        assert answer.strip(), ask
    # The fallback's draws follow the request's seed (issue 37): the same request, side by
    # side or alone, gives the same text.
    assert answers[0] == answers[1] and answers[2] == answers[3], answers
    assert transcribe(base_server.grpc_url, "grpc", audio, **asks[0]) == answers[0]
