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
committed only if both hypotheses give it at least MIN_PROBABILITY; a doubtful
word, and every word after it, waits for a later pair or for the turn's final
transcript. Pure: words in, words out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from python_backend_lib.core.segments import Word

# On real hypotheses of growing prefixes of seven recordings (tiny.en, docs/benchmarks/live-agreement),
# committing at any probability let 5% of committed words be misreadings at a 0.25-0.5 s cadence;
# at 0.5, 0 to 1.6% there (2.4% at most at slower cadences); at 0.6 none, with twice the delay.
MIN_PROBABILITY = 0.5
# Word timings of two hypotheses differ by a few tens of milliseconds: a committed word read again
# can end just past where it was committed. Up to this many words at the joint are compared as text.
MAX_OVERLAP_WORDS = 5


def comparison_key(word: Word | str) -> str:
    """What two readings of a word must share to agree: letters and digits, case folded
    ("you." and "you," are the same word; "ask" and "asked" are not)."""
    text = word if isinstance(word, str) else word.word
    return re.sub(r"[^\w']", "", text.casefold())


def words_after(committed: Sequence[Word], words: Sequence[Word]) -> list[Word]:
    """The words of a hypothesis past the committed ones: those centred after the last
    committed word's end, less any committed words they begin with again."""
    if not committed:
        return list(words)
    end = committed[-1].end
    tail = [w for w in words if (w.start + w.end) / 2 > end]
    for overlap in range(min(MAX_OVERLAP_WORDS, len(committed), len(tail)), 0, -1):
        if [comparison_key(w) for w in committed[-overlap:]] == [comparison_key(w) for w in tail[:overlap]]:
            return tail[overlap:]
    return tail


def confident_prefix(words: Sequence[Word], min_probability: float = MIN_PROBABILITY) -> list[Word]:
    """The words up to the first the model gives less than `min_probability`."""
    prefix = []
    for word in words:
        if word.probability < min_probability:
            break
        prefix.append(word)
    return prefix


@dataclass
class LocalAgreement:
    """The committed words of one turn, and the last hypothesis's tail they are checked against;
    min_probability: how sure both hypotheses must be of a word to commit it."""

    min_probability: float = MIN_PROBABILITY
    committed: list[Word] = field(default_factory=list)
    pending: list[Word] | None = None  # the last hypothesis's confident words past the committed; None before the first

    def insert(self, hypothesis: Sequence[Word]) -> list[Word]:
        """Take the next hypothesis of the whole turn; returns the words it newly commits
        (as this hypothesis times and spells them)."""
        tail = confident_prefix(words_after(self.committed, hypothesis), self.min_probability)
        agreed = []
        if self.pending is not None:
            for old, new in zip(self.pending, tail):
                if comparison_key(old) != comparison_key(new):
                    break
                agreed.append(new)
        self.committed.extend(agreed)
        self.pending = tail[len(agreed):]
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
