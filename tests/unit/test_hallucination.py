"""hallucination_silence_threshold against openai-whisper's own transcribe loop.

openai-whisper applies the rule inside `whisper.transcribe`, between decoding a
window and seeking to the next. Each case here is one decoded window made by
hand: its tokens (real tokenizer ids) and its words' times and probabilities. The
model's outputs are what the case sets; openai-whisper's loop, which is the
reference, runs as it is: the first window's decoding returns the case's tokens,
its word timing the case's words, every later window is silent; where that loop
seeks next and which segments it keeps are what `cut_window` must give.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from whisper.decoding import DecodingResult as WhisperResult
from whisper.model import ModelDimensions

from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.core import geometry
from python_backend_lib.core.decoded import DecodedWindow
from python_backend_lib.core.segments import Segment, Word
from python_backend_lib.text.tokenizer import load_tokenizer
from python_backend_lib.text.windows import window_segments
from python_backend_lib.transcription.hallucination import cut_window, first_segments, is_doubtful

# The module: `whisper.transcribe` is also the name of its function.
openai_transcribe = importlib.import_module("whisper.transcribe")
THRESHOLD = 2.0
SURE, UNSURE = 0.9, 0.05  # word probabilities: above and below openai-whisper's 0.15


@dataclass(frozen=True)
class CaseSegment:
    start: float
    end: float
    words: tuple[tuple[str, float, float, float], ...]  # word, start, end, probability

    @property
    def text(self) -> str:
        return "".join(w for w, *_ in self.words)


def spoken(words: str, start: float, step: float = 0.4, probability: float = SURE) -> tuple:
    return tuple((f" {w}", start + i * step, start + (i + 1) * step, probability) for i, w in enumerate(words.split()))


CASES = {
    # Speech, a doubtful segment alone 8 s later, then speech again: it and what follows go.
    "doubtful-between-silences": (
        [CaseSegment(0.0, 2.0, spoken("ask not what", 0.4)),
         CaseSegment(10.0, 11.0, spoken("thank you", 10.0, step=0.05, probability=UNSURE)),
         CaseSegment(20.0, 22.0, spoken("go forward", 20.2))],
        True, 45.0,
    ),
    # The window's first segment is doubtful and comes after 6 s of silence: decoded again from there.
    "doubtful-first-after-silence": (
        [CaseSegment(6.0, 7.0, spoken("you you", 6.0, step=0.05, probability=UNSURE)),
         CaseSegment(12.0, 14.0, spoken("ten meters", 12.2))],
        True, 45.0,
    ),
    # Nothing doubtful, the window ends inside speech far from its end: seek to the last word.
    "sure-words-open-end": (
        [CaseSegment(0.0, 3.0, spoken("feels like these days", 0.5)),
         CaseSegment(5.0, 8.0, spoken("go on forever", 5.5))],
        False, 45.0,
    ),
    # A doubtful segment with silence after it, close to the recording's end: decoding stops there.
    "doubtful-at-the-end": (
        [CaseSegment(0.0, 2.0, spoken("five five", 0.3)),
         CaseSegment(28.2, 28.3, spoken("bye", 28.2, step=0.06, probability=UNSURE))],
        True, 29.5,
    ),
    # A doubtful segment without silence after it stays.
    "doubtful-without-silence-after": (
        [CaseSegment(0.0, 2.0, spoken("five five", 0.3)),
         CaseSegment(24.0, 25.0, spoken("bye", 24.0, step=0.06, probability=UNSURE))],
        True, 26.0,
    ),
}
# What openai-whisper's loop does with each case (kept texts, next seek): each case
# takes a different branch of the rule.
OPENAI_WHISPER = {
    "doubtful-between-silences": (["ask not what"], 1000),
    "doubtful-first-after-silence": ([], 600),
    "sure-words-open-end": (["feels like these days", "go on forever"], 670),
    "doubtful-at-the-end": (["five five"], 2950),
    "doubtful-without-silence-after": (["five five", "bye"], 2600),
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(load_config("default"))


def window_tokens(tokenizer, segments: list[CaseSegment], single_ending: bool) -> list[int]:
    begin = tokenizer.special.timestamp_begin
    tokens = []
    for s in segments:
        tokens += [begin + round(s.start / 0.02), *tokenizer.encode(s.text), begin + round(s.end / 0.02)]
    if not single_ending:  # text after the last pair, left open by the window's end
        tokens += [begin + round((segments[-1].end + 1) / 0.02), *tokenizer.encode(" and so")]
    return tokens


def openai_whisper_run(monkeypatch, tokenizer, case) -> tuple[list[str], int]:
    """The case through whisper.transcribe: the texts it keeps from the first window, and the
    seek of the next window it decodes (the recording's end when none)."""
    segments, single_ending, duration = case
    tokens = window_tokens(tokenizer, segments, single_ending)
    content_frames = round(duration * geometry.FRAMES_PER_SECOND)
    # The log-mel's first bin holds each frame's index, so a window tells where it starts.
    mel = torch.arange(content_frames + geometry.N_FRAMES, dtype=torch.float32).expand(80, -1).clone()
    monkeypatch.setattr(openai_transcribe, "log_mel_spectrogram", lambda *args, **kwargs: mel)
    by_text = {s.text.strip(): s for s in segments}

    def word_times(*, segments, **kwargs):
        for segment in segments:
            case_segment = by_text[segment["text"].strip()]
            segment["words"] = [dict(word=w, start=s, end=e, probability=p) for w, s, e, p in case_segment.words]
            segment["start"], segment["end"] = segment["words"][0]["start"], segment["words"][-1]["end"]

    monkeypatch.setattr(openai_transcribe, "add_word_timestamps", word_times)
    seeks = []

    class CaseModel:
        device = torch.device("cpu")
        dims = ModelDimensions(80, 1500, 384, 6, 4, 51864, 448, 384, 6, 4)
        is_multilingual, num_languages = False, 0

        def decode(self, segment, options):
            seeks.append(int(segment[0, 0]))
            first = len(seeks) == 1
            return WhisperResult(
                audio_features=None, language="en", tokens=tokens if first else [], text="",
                avg_logprob=-0.1 if first else -5.0, no_speech_prob=0.0 if first else 1.0,
                temperature=0.0, compression_ratio=1.0,
            )

    result = openai_transcribe.transcribe(
        CaseModel(), np.zeros(1, np.float32), word_timestamps=True, hallucination_silence_threshold=THRESHOLD,
        fp16=False, condition_on_previous_text=False, language="en",
    )
    kept = [s["text"].strip() for s in result["segments"] if s["seek"] == 0 and s["text"].strip()]
    return kept, seeks[1] if len(seeks) > 1 else content_frames


@pytest.mark.parametrize("name", CASES)
def test_the_cut_is_openai_whispers(monkeypatch, tokenizer, name):
    case = CASES[name]
    segments, single_ending, duration = case
    kept, their_seek = openai_whisper_run(monkeypatch, tokenizer, case)
    assert (kept, their_seek) == OPENAI_WHISPER[name]

    tokens = window_tokens(tokenizer, segments, single_ending)
    content_frames = round(duration * geometry.FRAMES_PER_SECOND)
    frames = min(geometry.N_FRAMES, content_frames)
    window = DecodedWindow(tokens=tuple(tokens), seek=0, frames=frames, temperature=0.0, avg_logprob=-0.1,
                           compression_ratio=1.0, no_speech_prob=0.0)
    split = window_segments(window, tokenizer)
    ours = [
        dataclasses.replace(s, words=tuple(Word(w, a, b, p) for w, a, b, p in c.words))
        for s, c in zip(split.segments, segments)
    ]
    cut = cut_window(ours, seek=0, frames=frames, next_seek=split.advance, single_ending=single_ending,
                     content_frames=content_frames, last_speech=0.0, threshold=THRESHOLD)
    assert [s.text.strip() for s in ours[: cut.keep]] == ([] if cut.redo else kept)
    assert (cut.seek if cut.seek < content_frames else content_frames) == their_seek


def test_the_cases_hold_doubtful_segments():
    doubtful = [is_doubtful(Segment(s.start, s.end, s.text, (), words=tuple(Word(*w) for w in s.words)))
                for segments, _, _ in CASES.values() for s in segments]
    assert doubtful == [False, True, False, True, False, False, False, False, True, False, True]


def test_first_segments_keeps_their_tokens_and_times(tokenizer):
    segments, single_ending, _ = CASES["doubtful-between-silences"]
    tokens = window_tokens(tokenizer, segments, single_ending)
    texts = [len(tokenizer.encode(s.text)) for s in segments]
    times = tuple(float(i) for i in range(sum(texts) + 1))
    window = DecodedWindow(tokens=tuple(tokens), seek=0, frames=geometry.N_FRAMES, temperature=0.0,
                           avg_logprob=-0.1, compression_ratio=1.0, no_speech_prob=0.0,
                           token_times=times, token_probabilities=times[:-1])
    for keep in range(len(segments) + 1):
        cut = first_segments(window, keep, tokenizer)
        assert [s.text.strip() for s in window_segments(cut, tokenizer).segments] == [
            s.text.strip() for s in segments[:keep]
        ]
        kept_text = sum(texts[:keep])
        assert cut.token_times == (times[: kept_text + 1] if kept_text else ())
        assert cut.token_probabilities == times[:kept_text]
