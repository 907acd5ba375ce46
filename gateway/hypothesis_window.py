"""Which audio of a live turn a hypothesis transcribes: from near the committed words
on, not from the turn's start.

A turn is transcribed again and again as its audio grows (`local_agreement`). Were
each hypothesis the whole turn so far, each would cost more than the one before, for
words already sent. Once the committed words reach TRIM_AFTER_S past the start of the
window, the window moves up to the start of the last committed word, as
whisper_streaming trims its buffer behind the text it has confirmed; the words
committed before that go along as previous text (a prompt), so that the model reads on
from them rather than starting a sentence afresh.

The window starts at the last committed word rather than after it: word times are a
few tens of milliseconds off, and a cut after a word's end as timed can fall inside the
next word, whose fragment would then be read as a word of its own. The committed word
read again is centred before the committed words end, and `words_after` drops it.

The turn's completed transcript is still its whole audio, transcribed once as a file
would be: only the hypotheses move. Pure: words in, a window out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from python_backend_lib.core.geometry import SAMPLE_RATE
from python_backend_lib.core.segments import Word

# How far the committed words reach into the window before it moves up to them. Shorter
# windows cost less to decode, but give the model less of the speech around a word.
TRIM_AFTER_S = 5.0
# The committed words sent as previous text: few enough that with the start of the
# transcript they fit the engine's graph steps (engine.batch.GRAPH_PROMPT_TOKENS), where
# a longer prompt would take an eager decoder pass for every hypothesis.
PROMPT_WORDS = 3


@dataclass(frozen=True)
class Window:
    """Where a turn's hypotheses start (seconds into the turn), and their previous text."""

    start_s: float = 0.0
    prompt: str | None = None

    @property
    def start_sample(self) -> int:
        return round(self.start_s * SAMPLE_RATE)


def next_window(window: Window, committed: Sequence[Word], session_prompt: str | None) -> Window:
    """The window of the next hypothesis, once `committed` are the turn's committed words
    (timed in the turn). A session with a prompt of its own keeps it as the previous text:
    the server refuses a prompt over its token limit, and the gateway cannot count tokens,
    so the committed words are not added to one that may be near it."""
    if not committed or committed[-1].start - window.start_s < TRIM_AFTER_S:
        return window
    if session_prompt and session_prompt.strip():
        return Window(committed[-1].start, session_prompt)
    context = " ".join(w.word.strip() for w in committed[:-1][-PROMPT_WORDS:])
    return Window(committed[-1].start, context or None)


def in_turn(words: Sequence[Word], window: Window) -> list[Word]:
    """A hypothesis's words, timed from the window's start, timed in the turn."""
    offset = window.start_sample / SAMPLE_RATE
    return [dataclasses.replace(w, start=w.start + offset, end=w.end + offset) for w in words]
