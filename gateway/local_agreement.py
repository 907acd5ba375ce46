"""LocalAgreement-2: which words of a growing transcript are safe to show.

A live turn is transcribed again and again as its audio grows; each hypothesis
may rewrite its last words, which the speaker has not finished. A word is
committed once two consecutive hypotheses agree on it, and on every word
before it: the policy of Macháček et al., "Turning Whisper into Real-Time
Transcription System" (whisper_streaming). What is committed is never taken
back, so it can be sent as a delta at once.

Each hypothesis transcribes the turn from its start, with word timestamps. Its
words past the committed ones are found by time, not by counting: a hypothesis
may read a committed stretch with a different number of words ("am I" for
"my"), and counting would then skip or repeat the words after it.

Two hypotheses of a short prefix can agree on a misreading that more audio
corrects: tiny.en read the start of jfk.wav as "And so am I fellow Americans"
in hypotheses 0.5 s apart, where the whole turn reads "And so my fellow
Americans". Such words are the ones the model is unsure of, so a word is
committed by two hypotheses only if both give it at least MIN_PROBABILITY; a
doubtful word, and every word after it, waits until DOUBTFUL_AGREEMENT hypotheses
in a row read it the same way, or for the turn's final transcript. Pure: words
in, words out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from python_backend_lib.core.geometry import SECONDS_PER_POSITION
from python_backend_lib.core.segments import Word

# How sure two hypotheses in a row must both be of a word to commit it: below it, misreadings
# of a short prefix that more audio corrects got committed (docs/benchmarks/live-agreement:
# real tiny.en hypotheses of seven recordings, the trade at each threshold and cadence).
MIN_PROBABILITY = 0.5
# A word the model stays unsure of, read the same way by this many hypotheses in a row (with
# every word before it), is committed too: else one doubtful word early in a long turn ("1."
# opening a sonnet, which every hypothesis read so, each giving it under 0.5) held back every
# word after it until the turn ended. On the recorded hypotheses (docs/benchmarks/live-agreement)
# five commit about a third more words early and misread no more than pairs alone; four misread more.
DOUBTFUL_AGREEMENT = 5
# Word timings of two hypotheses differ by a few tens of milliseconds: a committed word read again
# can end just past where it was committed. Up to this many words at the joint are compared as text.
MAX_OVERLAP_WORDS = 5


def comparison_key(word: Word | str) -> str:
    """What two readings of a word must share to agree: letters and digits, case folded
    ("you." and "you," are the same word; "ask" and "asked" are not)."""
    text = word if isinstance(word, str) else word.word
    return re.sub(r"[^\w']", "", text.casefold())


def words_after(committed: Sequence[Word], words: Sequence[Word]) -> list[Word]:
    """The words of a hypothesis past the committed ones: those centred at or after the
    last committed word's end (word times fall on the 20 ms grid of timestamps: within
    half a step is at), less any committed words they begin with again.

    At, not only after: the word after a committed one read again shorter ("the" at
    1.74-2.04 s, then 1.74-1.94 with "writer" at 1.94-2.14) is centred on the committed
    end, and was lost from the deltas."""
    if not committed:
        return list(words)
    end = committed[-1].end - SECONDS_PER_POSITION / 2
    tail = [w for w in words if (w.start + w.end) / 2 > end]
    for overlap in range(min(MAX_OVERLAP_WORDS, len(committed), len(tail)), 0, -1):
        if [comparison_key(w) for w in committed[-overlap:]] == [comparison_key(w) for w in tail[:overlap]]:
            return tail[overlap:]
    return tail


@dataclass(frozen=True)
class Reading:
    """A word of the last hypothesis past the committed ones, and how many hypotheses in a
    row read it so, with every word before it."""

    word: Word
    times: int


@dataclass
class LocalAgreement:
    """The committed words of one turn, and the last hypothesis's words past them.

    min_probability: how sure two hypotheses in a row must both be of a word to commit it;
    doubtful_agreement: how many hypotheses in a row commit a word they read the same way
    however unsure of it (0: never; such a word then waits for the turn's end)."""

    min_probability: float = MIN_PROBABILITY
    doubtful_agreement: int = DOUBTFUL_AGREEMENT
    committed: list[Word] = field(default_factory=list)
    pending: list[Reading] | None = None  # None before the first hypothesis

    def insert(self, hypothesis: Sequence[Word]) -> list[Word]:
        """Take the next hypothesis of the whole turn; returns the words it newly commits
        (as this hypothesis times and spells them)."""
        readings, chain = [], True
        for i, word in enumerate(words_after(self.committed, hypothesis)):
            before = self.pending[i] if self.pending is not None and i < len(self.pending) else None
            chain = chain and before is not None and comparison_key(before.word) == comparison_key(word)
            readings.append(Reading(word, before.times + 1 if chain else 1))
        agreed = []
        for i, reading in enumerate(readings):
            sure = reading.times >= 2 and min(reading.word.probability,
                                              self.pending[i].word.probability) >= self.min_probability
            if not (sure or 0 < self.doubtful_agreement <= reading.times):
                break
            agreed.append(reading.word)
        self.committed.extend(agreed)
        self.pending = readings[len(agreed):]
        return agreed

    def finish(self, transcript: Sequence[Word]) -> list[Word]:
        """The words of the turn's final transcript past those committed, now committed too:
        the last delta."""
        rest = words_after(self.committed, transcript)
        self.committed.extend(rest)
        self.pending = []
        return rest


def delta_text(words: Sequence[Word], first: bool) -> str:
    """The words as a delta: a space before each but the turn's first, so that
    the deltas joined make the transcript."""
    text = " ".join(w.word.strip() for w in words)
    return text if first or not text else " " + text
