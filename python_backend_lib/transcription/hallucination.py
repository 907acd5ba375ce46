"""`hallucination_silence_threshold`: openai-whisper's rule for text invented in silence.

Whisper tends to invent text where there is no speech, and such text has tell-tale
word timestamps: words the model doubts, words too short to be spoken (under
133 ms) or too long (over 2 s). With word timestamps on, a window's segment made
mostly of such words (`is_doubtful`) that has silence of at least the threshold
on both sides (or the window's edge within 2 s) is dropped with everything after
it in the window, and decoding seeks past the silence; a window whose very first
segment is doubtful and starts after such a silence is decoded again from where
the silence ends. And a window that ends inside a segment seeks to its last word
when the silence after that word is longer than the threshold, else past the
window. The numbers are openai-whisper's. No torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from python_backend_lib.core import geometry
from python_backend_lib.core.decoded import DecodedWindow
from python_backend_lib.core.segments import Segment, Word
from python_backend_lib.text.tokenizer import Tokenizer
from python_backend_lib.text.windows import text_tokens, window_segments
from python_backend_lib.text.words import LEADING_PUNCTUATION, TRAILING_PUNCTUATION

DOUBTFUL_PROBABILITY = 0.15  # a word less likely than this is doubtful
SHORTEST_WORD_S = 0.133  # a word shorter than this is doubtful, the more so the shorter
LONGEST_WORD_S = 2.0  # and one longer than this, the more so the longer
SHORT_WORD_WEIGHT = 15  # doubt per second under SHORTEST_WORD_S
WORDS_JUDGED = 8  # a segment is judged by its first words
DOUBTFUL_SEGMENT_SCORE = 3.0  # doubt that makes a segment doubtful, whatever its length
WINDOW_EDGE_S = 2.0  # a segment this close to its window's edge counts as next to silence
PUNCTUATION = LEADING_PUNCTUATION + TRAILING_PUNCTUATION


def word_doubt(word: Word) -> float:
    """How unlike a spoken word `word` is: 1 for an unlikely word, plus its shortness or length."""
    duration = word.end - word.start
    doubt = 1.0 if word.probability < DOUBTFUL_PROBABILITY else 0.0
    if duration < SHORTEST_WORD_S:
        doubt += (SHORTEST_WORD_S - duration) * SHORT_WORD_WEIGHT
    if duration > LONGEST_WORD_S:
        doubt += duration - LONGEST_WORD_S
    return doubt


def is_doubtful(segment: Segment | None) -> bool:
    """A segment whose first words (punctuation aside) are mostly doubtful."""
    if segment is None or not segment.words:
        return False
    words = [w for w in segment.words if w.word not in PUNCTUATION][:WORDS_JUDGED]
    doubt = sum(word_doubt(w) for w in words)
    return doubt >= DOUBTFUL_SEGMENT_SCORE or doubt + 0.01 >= len(words)


@dataclass(frozen=True)
class WindowCut:
    """What the rule does to one decoded window.

    keep: how many of its segments stay (from the first).
    seek: the mel frame of the next window.
    redo: drop the whole window and decode again from `seek`, past the silence
        before its doubtful first segment.
    """

    keep: int
    seek: int
    redo: bool = False


def _start(segment: Segment) -> float:
    return segment.words[0].start if segment.words else segment.start


def _end(segment: Segment) -> float:
    return segment.words[-1].end if segment.words else segment.end


def _last_word_end(segments: Sequence[Segment]) -> float | None:
    for segment in reversed(segments):
        if segment.words:
            return segment.words[-1].end
    return segment.end if segments else None


def cut_window(
    segments: Sequence[Segment],
    *,
    seek: int,
    frames: int,
    next_seek: int,
    single_ending: bool,
    content_frames: int,
    last_speech: float,
    threshold: float,
) -> WindowCut:
    """The rule applied to the window decoded at `seek` (`frames` of audio), whose
    `segments` carry their words; `next_seek`: where the window would lead without
    the rule; `single_ending`: its last segment is closed (the window does not end
    inside speech); `last_speech`: the end of the last word kept before this window."""
    time_offset = seek / geometry.FRAMES_PER_SECOND
    window_end = (seek + geometry.N_FRAMES) / geometry.FRAMES_PER_SECOND
    segment_duration = frames / geometry.FRAMES_PER_SECOND
    content_duration = content_frames / geometry.FRAMES_PER_SECOND
    if not single_ending:
        last_word_end = _last_word_end(segments)
        if last_word_end is not None and last_word_end > time_offset:
            if window_end - last_word_end > threshold:
                next_seek = round(last_word_end * geometry.FRAMES_PER_SECOND)
            else:
                next_seek = seek + frames

    with_words = [s for s in segments if s.words]
    if with_words and is_doubtful(with_words[0]):
        gap = _start(with_words[0]) - time_offset
        if gap > threshold:
            return WindowCut(keep=0, seek=seek + round(gap * geometry.FRAMES_PER_SECOND), redo=True)

    previous_end = last_speech
    for index, segment in enumerate(segments):
        if not segment.words:
            continue
        if is_doubtful(segment):
            following = next((s for s in segments[index + 1 :] if s.words), None)
            next_start = _start(following) if following is not None else time_offset + segment_duration
            start, end = _start(segment), _end(segment)
            silence_before = (
                start - previous_end > threshold or start < threshold or start - time_offset < WINDOW_EDGE_S
            )
            silence_after = (
                next_start - end > threshold or is_doubtful(following) or window_end - end < WINDOW_EDGE_S
            )
            if silence_before and silence_after:
                next_seek = round(max(time_offset + 1, start) * geometry.FRAMES_PER_SECOND)
                if content_duration - end < threshold:
                    next_seek = content_frames
                return WindowCut(keep=index, seek=next_seek)
        previous_end = _end(segment)
    return WindowCut(keep=len(segments), seek=next_seek)


def first_segments(window: DecodedWindow, keep: int, tokenizer: Tokenizer) -> DecodedWindow:
    """`window` cut after its first `keep` segments (`text.windows.window_segments`): its
    tokens up to the timestamp pair that follows them, and their text tokens' times."""
    begin, tokens = tokenizer.special.timestamp_begin, window.tokens
    cut = 0
    if keep:
        pairs = [i + 1 for i in range(len(tokens) - 1) if tokens[i] >= begin and tokens[i + 1] >= begin]
        cut = next(
            b for b in [*pairs, len(tokens)]
            if len(window_segments(dataclasses.replace(window, tokens=tokens[:b]), tokenizer).segments) == keep
        )
    kept = dataclasses.replace(window, tokens=tokens[:cut])
    text = sum(len(mine) for mine in text_tokens(window_segments(kept, tokenizer).segments, tokenizer.special.eot))
    return dataclasses.replace(
        kept,
        token_times=window.token_times[: text + 1] if text else (),
        token_probabilities=window.token_probabilities[:text],
    )
