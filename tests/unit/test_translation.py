"""Translation and language detection on a multilingual checkpoint, against
transformers on the same weights; and how the served document reports them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from reference import DATA, hf_model

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.features import features_for, window_features
from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.checkpoints.hf_folder import write_hf_folder
from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core import geometry
from python_backend_lib.core.options import DecodingOptions, DecodingResult, LongFormMode, Task, TranscribeOptions
from python_backend_lib.engine.loading import EngineSetup
from python_backend_lib.text.formats import Document, ResponseFormat
from python_backend_lib.text.tokenizer import Tokenizer
from python_backend_lib.text.transcript import assemble
from python_backend_lib.transcription.longform import LongFormJob
from python_backend_lib.transcription.pipeline import Pipeline

pytestmark = pytest.mark.slow

SOURCE = "random:tiny:5"  # multilingual: 99 languages, <|translate|>
STEPS = 6  # tokens forced after the prompt (min_new_tokens = max_new_tokens)


@pytest.fixture(scope="module")
def pipe():
    pipeline = Pipeline.load(SOURCE, device="cpu", setup=EngineSetup(slots=4))
    yield pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("random-tiny")
    checkpoint = load_checkpoint(SOURCE)
    write_hf_folder(checkpoint.config, checkpoint.state_dict, folder)
    return hf_model(folder)


@pytest.fixture(scope="module")
def waveforms():
    rng = np.random.default_rng(7)
    noise = [rng.standard_normal(geometry.SAMPLE_RATE * s).astype(np.float32) * 0.1 for s in (4, 17)]
    return [*noise, decode_audio((DATA / "jfk.wav").read_bytes())]


@pytest.mark.parametrize("language", ["de", "fr", None], ids=["de", "fr", "detected"])
def test_translation_tokens_equal_transformers(pipe, hf, waveforms, language):
    """Same prompt (language given or detected, <|translate|>), then the same forced tokens.

    A random model with tied embeddings mostly repeats the last prompt token, so
    the tokens say little beyond the prompt; tests/served/test_random_models.py shows the
    logits themselves equal transformers' for any prompt.
    """
    options = DecodingOptions(task=Task.TRANSLATE, language=language, max_new_tokens=STEPS, min_new_tokens=STEPS)
    ours = pipe.decode(waveforms, options)
    features = torch.stack([window_features(w, pipe.n_mels) for w in waveforms])
    with torch.no_grad():
        generated = hf.generate(
            features, task="translate", language=language, max_new_tokens=STEPS, min_new_tokens=STEPS
        ).tolist()
        detected = hf.detect_language(features).tolist()
    special = pipe.config.special
    for result, row, language_token in zip(ours, generated, detected):
        prompt = [special.sot, special.language_token(result.language), special.translate, special.no_timestamps]
        if row[:1] == [special.sot]:  # transformers 4 returns the prompt too; 5 only the new tokens
            assert row[: len(prompt)] == prompt
            row = row[len(prompt) :]
        assert list(result.tokens) == row and len(row) == STEPS
        if language is None:
            assert special.language_token(result.language) == language_token
            assert 0.0 < result.language_probability <= 1.0
        else:
            assert result.language == language and result.language_probability is None
            assert tuple(result.prompt_tokens) == tuple(prompt)


@pytest.mark.parametrize("mode", list(LongFormMode))
def test_the_first_windows_language_is_kept_and_reported(pipe, mode):
    """Long audio on a multilingual checkpoint: the language detected on the first
    window is given to every later window (in batched mode the other chunks wait
    for it) and reported, with its probability, by the document the whisper
    model writes its outputs from."""
    config = pipe.config
    tokenizer = Tokenizer(load_config("default").tokenizer_path, config.special)  # no windows hold text here
    asked: list[DecodingOptions] = []

    def submit(features, options, on_done, is_cancelled, content_frames=None, keep_audio=False, live=False):  # a stand-in for the engine
        asked.append(options)
        detected = ("de", 0.87) if options.language is None else (None, None)
        on_done(DecodingResult((), detected[0], -0.2, 0.1, options.temperature, language_probability=detected[1]))

    waveform = np.random.default_rng(1).standard_normal(45 * geometry.SAMPLE_RATE).astype(np.float32) * 0.1
    options = TranscribeOptions(decoding=DecodingOptions(task=Task.TRANSLATE), mode=mode)
    outcome: list = []
    LongFormJob(submit, config, tokenizer, features_for(waveform, pipe.n_mels), len(waveform), options, outcome.append).start()
    transcript = assemble(*outcome, tokenizer)
    assert [o.language for o in asked] == [None, "de"]  # two windows (or chunks); the second told the language
    assert all(o.task is Task.TRANSLATE for o in asked)
    record = json.loads(Document.from_transcript(transcript, options).render(ResponseFormat.VERBOSE_JSON))
    assert (record["task"], record["language"], record["language_code"], record["language_probability"]) == (
        "translate", "german", "de", 0.87
    )


def test_batched_chunks_start_together_when_the_language_is_given(pipe):
    config = pipe.config
    tokenizer = Tokenizer(load_config("default").tokenizer_path, config.special)
    asked: list[DecodingOptions] = []
    waiting: list = []

    def submit(features, options, on_done, is_cancelled, content_frames=None, keep_audio=False, live=False):  # answers once every chunk has asked
        asked.append(options)
        waiting.append(lambda: on_done(DecodingResult((), None, -0.2, 0.1, options.temperature)))

    waveform = np.random.default_rng(1).standard_normal(75 * geometry.SAMPLE_RATE).astype(np.float32) * 0.1
    options = TranscribeOptions(decoding=DecodingOptions(language="de"), mode=LongFormMode.BATCHED)
    outcome: list = []
    LongFormJob(submit, config, tokenizer, features_for(waveform, pipe.n_mels), len(waveform), options, outcome.append).start()
    assert len(asked) == 3 and outcome == []  # 75 s: three chunks, all submitted at once
    for answer in waiting:
        answer()
    transcript = assemble(*outcome, tokenizer)
    assert transcript.language == "de" and len(transcript.windows) == 3
