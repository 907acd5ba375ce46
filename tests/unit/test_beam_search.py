"""Beam search and best_of as rows of the engine's batch, against openai-whisper's
own BeamSearchDecoder and ranker on the same weights (the packaged tiny.en)."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future

import pytest
import torch
from reference import DATA, openai_model

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.features import window_features
from python_backend_lib.checkpoints import weights
from python_backend_lib.core import geometry
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import DecodingOptions, TranscribeOptions, WindowPadding
from python_backend_lib.engine.batch import DecodeBatch
from python_backend_lib.engine.beams import Candidate, rank
from python_backend_lib.engine.loading import EngineSetup
from python_backend_lib.transcription.pipeline import Pipeline

whisper = pytest.importorskip("whisper")
SLOTS = 8
CLIPS = ["jfk.wav", "cards_001.wav", "sense_and_sensibility_01_austen_64kb-0870.wav", "dhd.2934z.wav"]


@pytest.fixture(scope="module")
def pipe():
    pipeline = Pipeline.load("default", device="cpu", setup=EngineSetup(slots=SLOTS))
    yield pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def openai():
    checkpoint = weights.load_checkpoint("default")
    return openai_model(checkpoint.config, checkpoint.state_dict)


@pytest.fixture(scope="module")
def waveforms():
    return {clip: decode_audio((DATA / clip).read_bytes()) for clip in CLIPS}


def _submit(pipe, waveform, options, **kwargs) -> Future:
    future: Future = Future()
    pipe.engine.submit(
        window_features(waveform, pipe.n_mels),
        options,
        lambda outcome: (future.set_exception if isinstance(outcome, BaseException) else future.set_result)(outcome),
        **kwargs,
    )
    return future


@pytest.mark.parametrize(
    "clip, search, timestamps",
    [
        ("jfk.wav", dict(beam_size=5), True),
        ("cards_001.wav", dict(beam_size=5), False),
        ("sense_and_sensibility_01_austen_64kb-0870.wav", dict(beam_size=3, patience=0.5), True),
        ("dhd.2934z.wav", dict(beam_size=5, patience=2.0, length_penalty=0.6), True),
    ],
)
def test_beam_search_equals_openai_whisper(pipe, openai, waveforms, clip, search, timestamps):
    waveform = waveforms[clip]
    theirs = whisper.decode(
        openai,
        window_features(waveform, pipe.n_mels),
        whisper.DecodingOptions(language="en", without_timestamps=not timestamps, fp16=False, **search),
    )
    ours = pipe.decode([waveform], DecodingOptions(timestamps=timestamps, **search))[0]
    assert list(ours.tokens) == theirs.tokens
    assert ours.avg_logprob == pytest.approx(theirs.avg_logprob, abs=1e-4)
    assert ours.no_speech_prob == pytest.approx(theirs.no_speech_prob, abs=1e-4)


@pytest.mark.parametrize("clip", ["cards_002.wav", "jfk.wav"])
def test_openai_whisper_padding_transcribes_as_openai_whisper_does(pipe, openai, clip):
    """window_padding="openai-whisper" pads a short clip's window with zeros of the
    normalised log-mel, as openai-whisper's `transcribe` pads every window: with
    beam search and fallback as there (faster-whisper's defaults), the transcript
    and its segments are openai-whisper's. cards_002 is where the paddings part:
    padded with silence, as transformers pads it, it reads differently."""
    audio = (DATA / clip).read_bytes()
    theirs = whisper.transcribe(openai, decode_audio(audio), language="en", beam_size=5, best_of=5, fp16=False,
                                verbose=None)
    decoding = DecodingOptions(language="en", timestamps=True, beam_size=5, best_of=5)
    ours = pipe.transcribe(audio, TranscribeOptions(decoding=decoding, window_padding="openai-whisper"))
    assert ours.text.strip() == theirs["text"].strip()
    # openai-whisper lets a timestamp pass the end of the audio (cards_002's 1.96 s
    # end at 2.00); ours end with the audio (text.windows), else they are its times.
    duration = round(len(decode_audio(audio)) / geometry.SAMPLE_RATE, 3)
    expected = [(min(s["start"], duration), min(s["end"], duration)) for s in theirs["segments"]]
    assert [(s.start, s.end) for s in ours.segments] == expected
    if clip == "cards_002.wav":
        silence = TranscribeOptions(decoding=decoding, window_padding=WindowPadding.TRANSFORMERS)
        assert pipe.transcribe(audio, silence).text.strip() != ours.text.strip()


def test_beams_share_the_batch_with_greedy_rows(pipe, waveforms):
    """Beam searches and greedy requests decoded together, more rows than slots
    (some wait for slots to free up), give what each gives alone."""
    clips = list(waveforms.values())
    requests = [(w, DecodingOptions(beam_size=3)) for w in clips[:2]] + [(w, DecodingOptions()) for w in clips]
    alone = [pipe.decode([w], o)[0].tokens for w, o in requests]
    together = [_submit(pipe, w, o) for w, o in requests]
    assert [f.result(timeout=120).tokens for f in together] == alone
    assert pipe.engine.batch.free_slots == SLOTS


def test_a_step_that_fails_after_beams_moved_fails_the_search_alone(pipe, waveforms, monkeypatch):
    """A step raises after its beams took each other's K/V: that search cannot be
    rewound, so it gets the error; the greedy rows of the step are rewound and
    retried, and read what they read alone."""
    clips = list(waveforms.values())[:2]
    solo = [pipe.decode([w], DecodingOptions())[0].tokens for w in clips]
    original = DecodeBatch._advance
    calls = {"n": 0}

    def flaky(self, rows, tokens, logprobs, followed):
        if rows and self._beam_rows and calls["n"] < 1 and any(len(r.generated) > 3 for r in rows):
            calls["n"] += 1
            raise RuntimeError("a bug while handling a step")
        return original(self, rows, tokens, logprobs, followed)

    monkeypatch.setattr(DecodeBatch, "_advance", flaky)
    beam = _submit(pipe, clips[0], DecodingOptions(beam_size=3))
    greedy = [_submit(pipe, w, DecodingOptions()) for w in clips]
    with pytest.raises(RuntimeError, match="a bug while handling a step"):
        beam.result(timeout=120)
    assert [f.result(timeout=120).tokens for f in greedy] == solo
    assert calls["n"] == 1 and pipe.engine.batch.free_slots == SLOTS


def test_a_cancelled_beam_search_frees_every_beam(pipe, waveforms):
    steps = 0
    lock = threading.Lock()

    def cancel_after_a_few_checks() -> bool:
        nonlocal steps
        with lock:
            steps += 1
            return steps > 3

    options = DecodingOptions(beam_size=4, min_new_tokens=100, max_new_tokens=100)
    cancelled = _submit(pipe, waveforms["jfk.wav"], options, is_cancelled=cancel_after_a_few_checks)
    with pytest.raises(CancelledError):
        cancelled.result(timeout=120)
    assert pipe.engine.batch.free_slots == SLOTS


def test_best_of_samples_are_rows_and_the_answer_is_one_of_them(pipe, waveforms):
    torch.manual_seed(0)
    result = pipe.decode([waveforms["jfk.wav"]], DecodingOptions(temperature=0.6, best_of=4))[0]
    assert result.temperature == 0.6 and result.finished
    assert "ask not what your country" in pipe.tokenizer.decode([t for t in result.tokens if t < 50256]).lower()
    assert pipe.engine.batch.free_slots == SLOTS


def test_the_fallback_searches_with_beams_then_samples(pipe, waveforms):
    """Temperature fallback (here forced: no window is likely enough) decodes with
    beam_size rows at temperature 0 and best_of rows above it, as openai-whisper's
    transcribe does; the window kept is the last temperature's."""
    rows_at: dict[float, int] = {}

    def observe(rows, logits):
        for temperature in {r.options.temperature for r in rows}:
            count = sum(r.options.temperature == temperature for r in rows)
            rows_at[temperature] = max(rows_at.get(temperature, 0), count)

    options = TranscribeOptions(
        decoding=DecodingOptions(timestamps=True, beam_size=2, best_of=3, max_new_tokens=40),
        temperature_increment=0.5,
        logprob_threshold=0.0,
        compression_ratio_threshold=None,
    )
    pipe.engine.batch.logit_observer = observe
    try:
        transcript = pipe.transcribe(waveforms["jfk.wav"], options)
    finally:
        pipe.engine.batch.logit_observer = None
    assert rows_at == {0.0: 2, 0.5: 3, 1.0: 3}
    assert transcript.windows[0].temperature == 1.0
    assert pipe.engine.batch.free_slots == SLOTS


@pytest.mark.parametrize("length_penalty", [None, 0.0, 0.6, 1.0])
def test_the_ranking_is_openai_whispers(length_penalty):
    ranker = whisper.decoding.MaximumLikelihoodRanker(length_penalty)
    candidates = [
        Candidate((1, 2, 3), -2.0, True),
        Candidate((1,) * 9, -4.1, True),
        Candidate((4, 5), -1.5, False),
        Candidate((6,) * 20, -7.0, True),
    ]
    expected = ranker.rank([[torch.tensor(c.tokens) for c in candidates]], [[c.sum_logprob for c in candidates]])[0]
    assert rank(candidates, length_penalty) == candidates[expected]


def test_more_beams_than_slots_are_refused_at_submit(pipe, waveforms):
    features = window_features(waveforms["jfk.wav"], pipe.n_mels)
    with pytest.raises(RequestError, match="needs 9 decoding slots; this server has 8"):
        pipe.engine.submit(features, DecodingOptions(beam_size=9), lambda _: None)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(beam_size=0), "beam_size must be an integer from 1 to 16"),
        (dict(beam_size=2.5), "beam_size must be an integer"),
        (dict(best_of=17), "best_of must be an integer from 1 to 16"),
        (dict(beam_size=5, patience=0), "patience must be a number above 0"),
        (dict(beam_size=2, patience=0.2), "leaves no candidate"),
        (dict(length_penalty=1.5), "length_penalty must be a number from 0 to 1"),
        (dict(length_penalty="x"), "length_penalty must be a number"),
    ],
)
def test_bad_search_options_are_named(options, message):
    with pytest.raises(RequestError, match=message):
        DecodingOptions(**options)
