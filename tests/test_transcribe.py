"""The packaged tiny.en weights, end to end through the library, against
transformers' `generate` (greedy) and the clips' known transcripts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from python_backend_lib import audio
from python_backend_lib.decoding import initial_tokens
from python_backend_lib.options import DecodingOptions
from python_backend_lib.pipeline import Pipeline

from reference import clips, hf_model, normalize

CLIPS = clips()
# Clips the reference model gets right, at least (checked below against transformers).
MIN_CORRECT_CLIPS = 8


@pytest.fixture(scope="module")
def pipe():
    pipeline = Pipeline.load("default", device="cpu")
    yield pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def hf(pipe):
    return hf_model(pipe.config.directory)


@pytest.fixture(scope="module")
def waveforms() -> list[np.ndarray]:
    # The first 30 s window of each clip; longer audio is the long-form decoder's job.
    return [audio.decode_audio(c.read())[: audio.N_SAMPLES] for c in CLIPS]


def _hf_window_tokens(hf, pipe, waveforms, timestamps: bool) -> list[list[int]]:
    """transformers' tokens for each clip's first window, prompt and <|endoftext|> removed."""
    features = torch.stack([pipe.features(w) for w in waveforms])
    eot = pipe.config.special.eot
    with torch.no_grad():
        if not timestamps:
            return [[t for t in row if t != eot] for row in hf.generate(features).tolist()]
        # With timestamps transformers seeks on inside a full window (long-form
        # behaviour), so take each row's first window from its segments.
        out = hf.generate(features, return_timestamps=True, return_segments=True, return_dict_in_generate=True)
    prompt_length = 1  # <|startoftranscript|> for an English-only model
    windows = []
    for segments in out["segments"]:
        sequence = segments[0]["result"]["sequences"].tolist() if segments else []
        windows.append([t for t in sequence[prompt_length:] if t != eot])
    return windows


@pytest.mark.parametrize("timestamps", [False, True], ids=["text", "timestamps"])
def test_tokens_identical_to_transformers(pipe, hf, waveforms, timestamps):
    options = DecodingOptions(timestamps=timestamps)
    ours = pipe.transcribe_many(waveforms, options)
    expected = _hf_window_tokens(hf, pipe, waveforms, timestamps)
    for clip, transcript, tokens in zip(CLIPS, ours, expected):
        assert list(transcript.result.tokens) == tokens, clip.file
    # And so the texts agree with the known transcripts wherever transformers' do.
    correct = 0
    for clip, transcript in zip(CLIPS, ours):
        reference_right = normalize(pipe.tokenizer.decode(expected[CLIPS.index(clip)])) == normalize(clip.transcript)
        if reference_right:
            assert normalize(transcript.text) == normalize(clip.transcript), clip.file
            correct += 1
    assert correct >= MIN_CORRECT_CLIPS


def test_jfk_transcript_and_segments(pipe):
    jfk = next(c for c in CLIPS if c.file == "jfk.wav")
    transcript = pipe.transcribe(jfk.read(), DecodingOptions(timestamps=True))
    assert normalize(transcript.text) == normalize(jfk.transcript)
    # Invariants of segments: ordered, inside the audio, text is their concatenation.
    assert len(transcript.segments) >= 2
    previous_end = 0.0
    for segment in transcript.segments:
        assert previous_end <= segment.start < segment.end <= jfk.duration + 0.02
        previous_end = segment.end
    assert normalize(" ".join(s.text for s in transcript.segments)) == normalize(transcript.text)
    assert transcript.duration == pytest.approx(jfk.duration, abs=0.01)


@pytest.mark.parametrize("timestamps", [False, True], ids=["text", "timestamps"])
def test_prompt_matches_transformers_prompt_ids(pipe, hf, timestamps):
    clip = next(c for c in CLIPS if c.file == "cards_002.wav")
    options = DecodingOptions(prompt="Playing cards: queen of clubs, four of hearts.", timestamps=timestamps)
    ours = pipe.transcribe(clip.read(), options)
    prompt = initial_tokens(pipe.config, options, pipe.tokenizer)
    features = pipe.features(audio.decode_audio(clip.read()))
    with torch.no_grad():
        expected = hf.generate(
            features[None], prompt_ids=torch.tensor(prompt.tokens[: prompt.sot_index]), return_timestamps=timestamps
        )
    eot = pipe.config.special.eot
    assert list(ours.result.tokens) == [t for t in expected[0].tolist() if t != eot]
    assert normalize(ours.text) == normalize(clip.transcript)  # the prompt fixes "queen of clothes"


def test_batch_invariance(pipe, waveforms):
    """A request decoded alone equals the same request inside a batch of
    mixed lengths and mixed options."""
    target = CLIPS.index(next(c for c in CLIPS if c.file == "jfk.wav"))
    options = DecodingOptions(timestamps=True)
    alone = pipe.transcribe(waveforms[target], options)
    others = [i for i in range(len(CLIPS)) if i != target][:7]
    mixed = [DecodingOptions(timestamps=i % 2 == 0, prompt="Hello." if i % 3 == 0 else None) for i in others]
    batch = pipe.transcribe_many(
        [waveforms[i] for i in others[:3]] + [waveforms[target]] + [waveforms[i] for i in others[3:]],
        mixed[:3] + [options] + mixed[3:],
    )
    assert batch[3].result.tokens == alone.result.tokens
    for i, transcript in zip(others, batch[:3] + batch[4:]):
        solo = pipe.transcribe(waveforms[i], mixed[others.index(i)])
        assert transcript.result.tokens == solo.result.tokens, CLIPS[i].file


def test_max_and_min_new_tokens(pipe, waveforms):
    short = pipe.transcribe(waveforms[0], DecodingOptions(max_new_tokens=5))
    full = pipe.transcribe(waveforms[0], DecodingOptions())
    assert short.result.tokens == full.result.tokens[:5]
    assert not short.result.finished and full.result.finished
    forced = pipe.transcribe(waveforms[0], DecodingOptions(min_new_tokens=40, max_new_tokens=40))
    assert len(forced.result.tokens) == 40
    assert forced.result.tokens[: len(full.result.tokens)] == full.result.tokens


def test_silence_reports_high_no_speech_probability(pipe):
    silent = pipe.transcribe(np.zeros(audio.SAMPLE_RATE * 5, dtype=np.float32))
    speech = pipe.transcribe(CLIPS[0].read())
    assert speech.result.no_speech_prob < 0.2
    assert silent.result.no_speech_prob > speech.result.no_speech_prob
