"""The packaged tiny.en weights, end to end through the library, against
transformers' `generate` (greedy) and the clips' known transcripts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import clips, hf_model, normalize

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.features import window_features
from python_backend_lib.core import geometry
from python_backend_lib.core.options import DecodingOptions
from python_backend_lib.engine.prompt import initial_tokens
from python_backend_lib.transcription.pipeline import Pipeline

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
    return [decode_audio(c.read())[: geometry.N_SAMPLES] for c in CLIPS]


@pytest.fixture(scope="module")
def hf_windows(hf, pipe, waveforms):
    """Each clip's first window as transformers reads it: its features, and transformers'
    encoder's output of them, computed once for the decodes that read the same windows."""
    features = torch.stack([window_features(w, pipe.n_mels) for w in waveforms])
    with torch.no_grad():
        return features, hf.model.encoder(features)


def _hf_window_tokens(hf, pipe, hf_windows, timestamps: bool) -> list[list[int]]:
    """transformers' tokens for each clip's first window, prompt and <|endoftext|> removed."""
    features, encoded = hf_windows
    eot = pipe.config.special.eot
    with torch.no_grad():
        if not timestamps:
            return [[t for t in row if t != eot] for row in hf.generate(features, encoder_outputs=encoded).tolist()]
        # With timestamps transformers seeks on inside a full window (long-form
        # behaviour), so take each row's first window from its segments.
        out = hf.generate(features, encoder_outputs=encoded, return_timestamps=True, return_segments=True,
                          return_dict_in_generate=True)
    prompt_length = 1  # <|startoftranscript|> for an English-only model
    windows = []
    for segments in out["segments"]:
        sequence = segments[0]["result"]["sequences"].tolist() if segments else []
        windows.append([t for t in sequence[prompt_length:] if t != eot])
    return windows


@pytest.mark.parametrize("timestamps", [False, True], ids=["text", "timestamps"])
def test_tokens_identical_to_transformers(pipe, hf, waveforms, hf_windows, timestamps):
    options = DecodingOptions(timestamps=timestamps)
    ours = pipe.decode(waveforms, options)
    expected = _hf_window_tokens(hf, pipe, hf_windows, timestamps)
    for clip, result, tokens in zip(CLIPS, ours, expected):
        assert list(result.tokens) == tokens, clip.file
    # And so the texts agree with the known transcripts wherever transformers' do.
    correct = 0
    for clip, result, tokens in zip(CLIPS, ours, expected):
        if normalize(pipe.tokenizer.decode(tokens)) == normalize(clip.transcript):
            assert normalize(pipe.tokenizer.decode(result.tokens)) == normalize(clip.transcript), clip.file
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
    ours = pipe.decode([decode_audio(clip.read())], options)[0]
    prompt = initial_tokens(pipe.config, options, pipe.tokenizer)
    features = window_features(decode_audio(clip.read()), pipe.n_mels)
    with torch.no_grad():
        expected = hf.generate(
            features[None], prompt_ids=torch.tensor(prompt.tokens[: prompt.sot_index]), return_timestamps=timestamps
        )
    eot = pipe.config.special.eot
    assert list(ours.tokens) == [t for t in expected[0].tolist() if t != eot]
    assert normalize(pipe.tokenizer.decode(ours.tokens)) == normalize(clip.transcript)  # the prompt fixes "queen of clothes"


def test_batch_invariance(pipe, waveforms):
    """A request decoded alone equals the same request inside a batch of
    mixed lengths and mixed options."""
    target = CLIPS.index(next(c for c in CLIPS if c.file == "jfk.wav"))
    options = DecodingOptions(timestamps=True)
    alone = pipe.decode([waveforms[target]], options)[0]
    others = [i for i in range(len(CLIPS)) if i != target][:7]
    mixed = [DecodingOptions(timestamps=i % 2 == 0, prompt="Hello." if i % 3 == 0 else None) for i in others]
    batch = pipe.decode(
        [waveforms[i] for i in others[:3]] + [waveforms[target]] + [waveforms[i] for i in others[3:]],
        mixed[:3] + [options] + mixed[3:],
    )
    assert batch[3].tokens == alone.tokens
    for i, result in zip(others, batch[:3] + batch[4:]):
        solo = pipe.decode([waveforms[i]], mixed[others.index(i)])[0]
        assert result.tokens == solo.tokens, CLIPS[i].file


def test_max_and_min_new_tokens(pipe, waveforms):
    short, full, forced = pipe.decode(
        [waveforms[0]] * 3,
        [DecodingOptions(max_new_tokens=5), DecodingOptions(), DecodingOptions(min_new_tokens=40, max_new_tokens=40)],
    )
    assert short.tokens == full.tokens[:5]
    assert not short.finished and full.finished
    assert len(forced.tokens) == 40
    assert forced.tokens[: len(full.tokens)] == full.tokens


def test_silence_reports_high_no_speech_probability(pipe):
    silent, speech = pipe.decode(
        [np.zeros(geometry.SAMPLE_RATE * 5, dtype=np.float32), decode_audio(CLIPS[0].read())], DecodingOptions()
    )
    assert speech.no_speech_prob < 0.2
    assert silent.no_speech_prob > 0.6
