"""LocalAgreement-2: which words of a growing transcript are safe to show.

A live turn is transcribed again and again as its audio grows; each hypothesis
may rewrite its last words, which the speaker has not finished. A word is
committed once two consecutive hypotheses agree on it, and on every word
before it: the policy of Macháček et al., "Turning Whisper into Real-Time
Transcription System" (whisper_streaming). What is committed is never taken
back, so it can be sent as a delta at once.

Each hypothesis transcribes the turn from its start, so its first words are
those already committed; the words after as many of them as are committed are
what the two hypotheses are compared on. Pure: words in, words out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def words_of(text: str) -> list[str]:
    """A hypothesis's words as Whisper spells them, punctuation attached."""
    return text.split()


def common_prefix(first: Sequence[str], second: Sequence[str]) -> list[str]:
    """The words both sequences begin with."""
    agreed = []
    for a, b in zip(first, second):
        if a != b:
            break
        agreed.append(a)
    return agreed


@dataclass
class LocalAgreement:
    """The committed words of one turn, and the hypothesis's tail they are checked against."""

    committed: list[str] = field(default_factory=list)
    pending: list[str] | None = None  # the last hypothesis past the committed words; None before the first

    def insert(self, hypothesis: Sequence[str]) -> list[str]:
        """Take the next hypothesis of the whole turn; returns the words it newly commits."""
        tail = list(hypothesis[len(self.committed):])
        agreed = [] if self.pending is None else common_prefix(self.pending, tail)
        self.committed.extend(agreed)
        self.pending = tail[len(agreed):]
        return agreed

    def finish(self, transcript: Sequence[str]) -> list[str]:
        """The words of the turn's final transcript past those committed, now committed too:
        the last delta, so that the deltas add up to the final transcript when it agrees
        with what was committed."""
        rest = list(transcript[len(self.committed):])
        self.committed.extend(rest)
        self.pending = []
        return rest


def delta_text(words: Sequence[str], first: bool) -> str:
    """The words as a delta: a space before each but the turn's first, so that
    the deltas joined make the transcript."""
    text = " ".join(words)
    return text if first or not text else " " + text
