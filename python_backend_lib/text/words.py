"""Words from timed text tokens: which tokens make a word, its time and probability,
punctuation joined to its neighbour, and the first word after a pause cut short.

The alignment heads (`transcription.alignment`) say when each text token of a
window starts; everything after that is these pure functions, which the
`postprocessing` model runs as the library does. No torch.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from python_backend_lib.core import geometry
from python_backend_lib.core.decoded import DecodedWindow
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.segments import Segment, Word
from python_backend_lib.text.tokenizer import Tokenizer
from python_backend_lib.text.windows import text_tokens

# DTW lets the first word after a pause begin anywhere in the silence before it.
# Such a word is cut to WORD_AFTER_PAUSE_MEDIANS times the window's median word
# duration (that median taken as at most MAX_MEDIAN_WORD_S), the length
# openai-whisper cuts it to; a segment's first word follows a pause when it ends
# more than PAUSE_MEDIANS median words after the previous segment's last word
# (or the window's start).
MAX_MEDIAN_WORD_S = 0.7
WORD_AFTER_PAUSE_MEDIANS = 2
PAUSE_MEDIANS = 4
# Punctuation joins the neighbouring word instead of getting a time of its own.
LEADING_PUNCTUATION = "\"'“¿([{-"
TRAILING_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"


def with_words(segments: tuple[Segment, ...], window: DecodedWindow, tokenizer: Tokenizer) -> tuple[Segment, ...]:
    """One window's segments (`text.windows.window_segments`) with their words, from the
    window's `token_times` and `token_probabilities`; as they are when it has none.

    RequestError when the times do not fit the window's text tokens: a record that
    came from elsewhere (the `postprocessing` model's inputs) and does not hold together.
    """
    per_segment = text_tokens(segments, tokenizer.special.eot)
    tokens = [t for mine in per_segment for t in mine]
    if not tokens or not window.token_times:
        return segments
    if len(window.token_times) != len(tokens) + 1 or len(window.token_probabilities) != len(tokens):
        raise RequestError(
            f"a window of {len(tokens)} text tokens came with {len(window.token_times)} token times "
            f"and {len(window.token_probabilities)} probabilities; expected {len(tokens) + 1} and {len(tokens)}"
        )
    offset = window.seek / geometry.FRAMES_PER_SECOND
    starts = np.asarray(window.token_times)
    words = iter(timed_words(tokenizer, tokens, starts, list(window.token_probabilities), offset))
    grouped, pending = [], next(words, None)
    for mine in per_segment:
        own, remaining = [], len(mine)
        while pending is not None and remaining > 0:
            word, n_tokens = pending
            own.append(word)
            remaining -= n_tokens
            pending = next(words, None)
        grouped.append(own)
    grouped = shorten_words_after_pauses(grouped, offset)
    return tuple(dataclasses.replace(segment, words=tuple(own)) for segment, own in zip(segments, grouped))


def shorten_words_after_pauses(segments: list[list[Word]], window_start: float) -> list[list[Word]]:
    """The words of one window's segments, the first word of a segment that
    follows a pause cut to WORD_AFTER_PAUSE_MEDIANS median words (its end
    stays). Only segment openings: inside a segment a long word is as likely
    to hold the silence after it as the one before."""
    durations = [w.end - w.start for words in segments for w in words if w.end > w.start]
    if not durations:
        return segments
    median = min(MAX_MEDIAN_WORD_S, float(np.median(durations)))
    longest = WORD_AFTER_PAUSE_MEDIANS * median
    result, last_speech = [], window_start
    for words in segments:
        if words:
            first = words[0]
            if first.end - last_speech > PAUSE_MEDIANS * median and first.end - first.start > longest:
                words = [dataclasses.replace(first, start=round(first.end - longest, 3)), *words[1:]]
            last_speech = words[-1].end
        result.append(words)
    return result


def split_words(tokenizer: Tokenizer, tokens: list[int]) -> list[tuple[str, list[int]]]:
    """Group text tokens into words: a word starts at a token that begins with a
    space or is punctuation; tokens that only complete a multi-byte character
    stay with the one they complete."""
    pieces: list[tuple[str, list[int]]] = []
    current: list[int] = []
    for token in tokens:
        current.append(token)
        text = tokenizer.decode(current)
        if "\ufffd" not in text:
            pieces.append((text, current))
            current = []
    words: list[tuple[str, list[int]]] = []
    for text, piece in pieces:
        if text.startswith(" ") or text.strip() in string.punctuation or not words:
            words.append((text, list(piece)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + piece)
    return words


def timed_words(
    tokenizer: Tokenizer, text_tokens: list[int], starts: np.ndarray, probabilities: list[float], offset: float
) -> list[tuple[Word, int]]:
    """Words with times and mean token probability, and how many tokens each
    covers (punctuation merged into a neighbour brings its tokens along)."""
    grouped = split_words(tokenizer, text_tokens)
    bounds = np.cumsum([0] + [len(tokens) for _, tokens in grouped])
    rows = [
        [
            text,
            float(starts[bounds[k]]),
            float(starts[bounds[k + 1]]),
            float(np.mean(probabilities[bounds[k] : bounds[k + 1]])),
            len(tokens),
        ]
        for k, (text, tokens) in enumerate(grouped)
    ]
    return [
        (Word(text, round(offset + start, 3), round(offset + end, 3), round(p, 4)), n)
        for text, start, end, p, n in merge_punctuation(rows)
    ]


def merge_punctuation(rows: list[list]) -> list[list]:
    """Attach opening punctuation to the next word and closing punctuation to
    the previous one; the word keeps its own times. Rows: [text, start, end,
    probability, n_tokens]."""
    merged: list[list] = []
    opening: list | None = None
    for row in rows:
        stripped = row[0].strip()
        if stripped and merged and all(c in TRAILING_PUNCTUATION for c in stripped):
            merged[-1][0] += stripped
            merged[-1][4] += row[4]
        elif stripped and all(c in LEADING_PUNCTUATION for c in stripped):
            opening = row if opening is None else [opening[0] + row[0], *opening[1:4], opening[4] + row[4]]
        else:
            if opening is not None:
                row = [opening[0] + row[0].lstrip(), row[1], row[2], row[3], opening[4] + row[4]]
                opening = None
            merged.append(row)
    if opening is not None:
        merged.append(opening)
    return merged
