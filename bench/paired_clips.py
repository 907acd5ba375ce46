"""Two systems' transcripts of the same clips, compared clip by clip: how far a set's
error rate moves between them, and how much of that one clip makes.

A set's WER is its word edits over its reference words, both summed over the clips,
so the difference between two systems on the same clips is the sum of each clip's
difference in edits over the set's words: every word one clip gains or loses moves it
by 100 / words points. On a set of a few hundred words that step is a large part of
issue 38's gate (0.3 points), and one clip falling into or out of a repetition can
decide it; `paired` says so beside the figure. Its interval resamples the clips (a
paired bootstrap: each draw takes the same clips for both systems), which is how far
the difference would move on another set of such clips.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.beam_wer import edits, words_of

DRAWS = 4000
INTERVAL = 0.90


@dataclass(frozen=True)
class ClipMove:
    clip: str
    edits: int  # word edits more than the reference system made on this clip (fewer: negative)


@dataclass(frozen=True)
class PairedClips:
    """One system against the reference on one set."""

    words: int  # the references' words, summed over the set
    point_per_word: float  # how far one word edit moves the set's WER, in points
    edit_difference: int  # word edits more than the reference's, summed over the clips
    wer_points: float
    changed: int  # clips whose word edits differ from the reference's
    largest: ClipMove  # the clip whose edits moved most, either way
    without_largest_points: float  # the WER difference over the other clips
    interval_points: tuple[float, float]  # INTERVAL of the difference, the clips resampled


def clip_word_edits(references: Sequence[str], transcripts: Sequence[str], languages: Sequence[str]) -> list[tuple[int, int]]:
    """Each clip's (word edits, reference words), split as `bench.beam_wer.score` splits them."""
    counted = []
    for reference, transcript, language in zip(references, transcripts, languages, strict=True):
        ref = words_of(reference, language)
        counted.append((edits(ref, words_of(transcript, language)), len(ref)))
    return counted


def paired(clips: Sequence[str], reference: Sequence[tuple[int, int]], system: Sequence[tuple[int, int]],
           draws: int = DRAWS, seed: int = 0) -> PairedClips:
    """`system` against `reference` over the same clips (each clip's edits and words, as
    `clip_word_edits` gives them); the interval's draws are seeded, so a record renders the same."""
    moves = np.array([s[0] - r[0] for r, s in zip(reference, system, strict=True)])
    counts = np.array([r[1] for r in reference])
    total = int(counts.sum())
    largest = int(np.argmax(np.abs(moves)))
    rest = np.arange(len(moves)) != largest
    picks = np.random.default_rng(seed).integers(0, len(moves), size=(draws, len(moves)))
    resampled = 100 * moves[picks].sum(axis=1) / np.maximum(counts[picks].sum(axis=1), 1)
    low, high = np.quantile(resampled, [(1 - INTERVAL) / 2, (1 + INTERVAL) / 2])
    return PairedClips(
        words=total,
        point_per_word=100 / total,
        edit_difference=int(moves.sum()),
        wer_points=100 * float(moves.sum()) / total,
        changed=int(np.count_nonzero(moves)),
        largest=ClipMove(clips[largest], int(moves[largest])),
        without_largest_points=100 * float(moves[rest].sum()) / max(int(counts[rest].sum()), 1),
        interval_points=(float(low), float(high)),
    )
