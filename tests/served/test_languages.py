"""The packaged multilingual `base` checkpoint on real non-English speech
(tests/data/multilingual), against transformers' WhisperForConditionalGeneration
on the same weights: the detected language and its probability, and greedy tokens
in the given language, in the detected one and translated to English; then the
served path (`whisper-triton serve --checkpoint base`) answers as the library."""

from __future__ import annotations

import csv
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import whisper_triton_command
from reference import hf_model

from clients.api import WhisperClient
from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.features import window_features
from python_backend_lib.checkpoints.weights import hf_directory
from python_backend_lib.core.options import DecodingOptions, Task, TranscribeOptions, WindowPadding
from python_backend_lib.text.formats import Document
from python_backend_lib.transcription.pipeline import Pipeline

pytestmark = pytest.mark.slow

CHECKPOINT = "base"
DATA = Path(__file__).resolve().parents[1] / "data" / "multilingual"
# Our float32 CPU logits against transformers' (its SDPA attention): the softmax over
# the language tokens agrees to about 1e-6.
PROBABILITY_TOLERANCE = 1e-4
# Served requests decode greedily, without the fallback to sampling: base translating
# 8 kHz telephone French fails the fallback's thresholds, and sampled text differs
# from one decoding to the next.
GREEDY = {"temperature_increment": 0.0}
# ... and pad each clip's window as transformers does (with silence), not by the
# default (openai-whisper's zeros): the detected languages and their probabilities
# are checked against transformers', which sees silence there.
PADDING = {"window_padding": WindowPadding.TRANSFORMERS.value}


@dataclass(frozen=True)
class Clip:
    file: str
    language: str  # ISO 639-1, as spoken
    reference_text: str

    @property
    def path(self) -> Path:
        return DATA / self.file


def clips() -> list[Clip]:
    with open(DATA / "manifest.tsv", newline="") as f:
        return [Clip(r["file"], r["language"], r["reference_text"]) for r in csv.DictReader(f, delimiter="\t")]


CLIPS = clips()


@pytest.fixture(scope="module")
def pipe():
    pipeline = Pipeline.load(CHECKPOINT, device="cpu")
    yield pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def hf():
    return hf_model(hf_directory(CHECKPOINT))


@pytest.fixture(scope="module")
def waveforms() -> list:
    return [decode_audio(clip.path.read_bytes()) for clip in CLIPS]  # each shorter than a window


@pytest.fixture(scope="module")
def features(pipe, waveforms) -> torch.Tensor:
    return torch.stack([window_features(waveform, pipe.n_mels) for waveform in waveforms])


@pytest.fixture(scope="module")
def hf_encoded(hf, features):
    """transformers' encoder's output of every clip's window, computed once for the
    detection and the decodes that read the same windows."""
    with torch.no_grad():
        return hf.model.encoder(features)


@dataclass(frozen=True)
class Detection:
    language: str
    probability: float


@pytest.fixture(scope="module")
def hf_detected(pipe, hf, hf_encoded) -> list[Detection]:
    """transformers' language of each clip (`detect_language`), and its probability: the
    softmax of its logits after <|startoftranscript|> over the language tokens."""
    special = pipe.config.special
    language_tokens = torch.tensor(special.language_tokens)
    with torch.no_grad():
        detected = hf.detect_language(encoder_outputs=hf_encoded).tolist()
        sot = torch.full((len(CLIPS), 1), special.sot)
        logits = hf(encoder_outputs=hf_encoded, decoder_input_ids=sot).logits[:, -1]
    probabilities = logits[:, language_tokens].softmax(dim=-1)
    detections = []
    for token, row in zip(detected, probabilities):
        index = special.language_tokens.index(token)
        detections.append(Detection(special.language_codes[index], float(row[index])))
    return detections


def hf_tokens(pipe, hf, features, encoded, task: Task, languages: list[str | None]) -> list[list[int]]:
    """transformers' greedy `generate` tokens of each clip, prompt and <|endoftext|> removed."""
    eot = pipe.config.special.eot  # also the padding of rows that ended early
    language = None if None in languages else languages  # a list: each row's own
    # transformers detects a language from the features themselves, so only a decode of
    # given languages can read the encoder's output computed once.
    reuse = {} if language is None else {"encoder_outputs": encoded}
    with torch.no_grad():
        generated = hf.generate(features, task=task.value, language=language, **reuse).tolist()
    return [[t for t in row if t != eot] for row in generated]


def test_the_detected_language_and_probability_equal_transformers(pipe, waveforms, hf_detected):
    ours = pipe.decode(waveforms, DecodingOptions(max_new_tokens=1))
    for clip, result, expected in zip(CLIPS, ours, hf_detected):
        assert result.language == expected.language, clip.file
        assert result.language_probability == pytest.approx(expected.probability, abs=PROBABILITY_TOLERANCE), clip.file
    # And base hears each clip's own language.
    assert [d.language for d in hf_detected] == [clip.language for clip in CLIPS]


@pytest.mark.parametrize(
    "task, given",
    [(Task.TRANSCRIBE, True), (Task.TRANSCRIBE, False), (Task.TRANSLATE, False)],
    ids=["transcribe-given", "transcribe-detected", "translate-detected"],
)
def test_tokens_equal_transformers(pipe, hf, waveforms, features, hf_encoded, task, given):
    languages = [clip.language if given else None for clip in CLIPS]
    options = [DecodingOptions(task=task, language=language) for language in languages]
    ours = pipe.decode(waveforms, options)
    expected = hf_tokens(pipe, hf, features, hf_encoded, task, languages)
    for clip, result, tokens in zip(CLIPS, ours, expected):
        assert list(result.tokens) == tokens, clip.file
        assert result.language == clip.language, clip.file
    if task is Task.TRANSLATE:  # English words, not the clips' own scripts
        assert all(pipe.tokenizer.decode(r.tokens).isascii() for r in ours)


# ----------------------------------------------------------------- served


@pytest.fixture(scope="module")
def library(pipe):
    """The library's greedy transcripts of every clip (timestamps on, as the server's
    default), in the clips' own languages when `given`, else detected."""
    cache = {}

    def transcripts(task: Task, given: bool) -> list:
        if (task, given) not in cache:
            options = [
                TranscribeOptions(
                    decoding=DecodingOptions(task=task, language=clip.language if given else None, timestamps=True),
                    temperature_increment=GREEDY["temperature_increment"],
                    window_padding=PADDING["window_padding"],
                )
                for clip in CLIPS
            ]
            cache[task, given] = pipe.transcribe_many([clip.path.read_bytes() for clip in CLIPS], options)
        return cache[task, given]

    return transcripts


def served_documents(server, protocol: str, task: Task, given: bool) -> list[Document]:
    """verbose_json of every clip, sent at once (the engine batches them)."""

    def send(clip: Clip) -> Document:
        options = {"task": task.value, **GREEDY, **PADDING, **({"language": clip.language} if given else {})}
        with WhisperClient(server.url(protocol), protocol) as client:
            return client.transcribe_document(clip.path, **options)

    with ThreadPoolExecutor(len(CLIPS)) as pool:
        return list(pool.map(send, CLIPS))


@pytest.mark.server
@pytest.mark.parametrize(
    "protocol, task, given",
    [("http", Task.TRANSCRIBE, False), ("grpc", Task.TRANSLATE, False), ("grpc", Task.TRANSCRIBE, True)],
    ids=["http-detected", "grpc-translate", "grpc-given"],
)
def test_served_verbose_json_equals_the_library_and_transformers(base_server, library, hf_detected, protocol, task, given):
    documents = served_documents(base_server, protocol, task, given)
    for clip, document, transcript, expected in zip(CLIPS, documents, library(task, given), hf_detected):
        assert document.text == transcript.text, clip.file
        assert (document.task, document.language) == (task, expected.language), clip.file
        if given:
            assert document.language_probability is None
        else:
            assert document.language_probability == pytest.approx(expected.probability, abs=PROBABILITY_TOLERANCE)


@pytest.mark.server
def test_the_cli_reports_the_detected_language(base_server, library, hf_detected):
    clip, expected = CLIPS[0], hf_detected[0]
    command = whisper_triton_command() + [
        "transcribe", str(clip.path), f"--url={base_server.grpc_url}", "--protocol=grpc", "--format=verbose_json",
        "--temperature-increment=0", f"--window-padding={PADDING['window_padding']}",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    record = json.loads(completed.stdout)
    assert record["language_code"] == expected.language
    assert record["language_probability"] == pytest.approx(expected.probability, abs=PROBABILITY_TOLERANCE)
    assert record["text"] == library(Task.TRANSCRIBE, False)[0].text
