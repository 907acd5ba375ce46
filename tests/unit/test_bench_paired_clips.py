"""bench.paired_clips: two systems' transcripts of the same clips, compared clip by clip."""

from __future__ import annotations

import pytest

from bench.fp8_accuracy import by_clip, by_clip_rows
from bench.paired_clips import clip_word_edits, paired


def test_each_clip_is_counted_as_the_set_scores_it():
    counted = clip_word_edits(["the cat sat", "un chat"], ["The cat sat.", "un chien noir"], ["en", "fr"])
    assert counted == [(0, 3), (2, 2)]


def test_one_clip_that_moves_much_is_named_and_the_rest_measured_without_it():
    """Nine clips of ten words and one of twenty: the system makes 8 edits more on the long
    one and one fewer on each of two others. The set moves by 6 edits of 110 words; without
    the long clip, by -2 of 90."""
    clips = [f"clip{i}" for i in range(10)]
    reference = [(1, 10)] * 9 + [(0, 20)]
    system = [(0, 10), (0, 10)] + [(1, 10)] * 7 + [(8, 20)]
    p = paired(clips, reference, system)
    assert (p.words, p.edit_difference, p.changed) == (110, 6, 3)
    assert p.point_per_word == pytest.approx(100 / 110) and p.wer_points == pytest.approx(600 / 110)
    assert (p.largest.clip, p.largest.edits) == ("clip9", 8)
    assert p.without_largest_points == pytest.approx(-200 / 90)
    low, high = p.interval_points
    assert low < p.wer_points < high and high - low > 5  # one clip decides it: a wide interval
    assert paired(clips, reference, system).interval_points == p.interval_points  # seeded: a record renders the same


def test_identical_transcripts_move_nothing():
    p = paired(["a", "b"], [(2, 10), (0, 5)], [(2, 10), (0, 5)])
    assert (p.edit_difference, p.changed, p.wer_points, p.interval_points) == (0, 0, 0.0, (0.0, 0.0))


def test_a_recorded_set_is_compared_clip_by_clip_against_its_reference():
    result_set = {
        "set": "english", "clips": ["english/a.wav", "english/b.wav"], "references": ["one two", "three"],
        "clip_languages": ["en", "en"], "reference_system": "float16",
        "systems": {"float16": {"transcripts": ["one two", "three"]}, "fp8": {"transcripts": ["one", "three"]}},
    }
    compared = by_clip(result_set)
    assert list(compared) == ["fp8"] and compared["fp8"].wer_points == pytest.approx(100 / 3)
    assert by_clip_rows(result_set)[0][:3] == ["english", "fp8", 3]
    assert by_clip({**result_set, "clip_languages": None}) == {}  # recorded before the languages were kept
