"""The served benchmark's clips: cut at quiet points, deterministically, from the test recordings."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile

from bench.clips import (
    MAX_CLIP_S,
    MIN_CLIP_S,
    Clip,
    cut_clips,
    cut_points,
    frame_levels_db,
    load_clips,
    nearest,
    partition,
    pause_centres,
    quiet_frames,
    wav_bytes,
)
from loadtest.clips import read_manifest
from python_backend_lib.core.geometry import SAMPLE_RATE


def tone_bursts(pattern: list[tuple[float, bool]], seed: int = 0) -> np.ndarray:
    """Concatenated stretches of (seconds, loud?): a 300 Hz tone with noise, or faint noise."""
    rng = np.random.default_rng(seed)
    parts = []
    for seconds, loud in pattern:
        t = np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        noise = 0.001 * rng.standard_normal(len(t))
        parts.append(0.3 * np.sin(2 * np.pi * 300 * t) + noise if loud else noise)
    return np.concatenate(parts).astype(np.float32)


@pytest.fixture(scope="module")
def clip_set():
    return load_clips()


def test_pauses_are_found_at_the_centres_of_the_silences():
    waveform = tone_bursts([(1.0, True), (0.4, False), (2.0, True), (0.2, False), (1.0, True), (0.04, False),
                            (1.0, True)])
    pauses = pause_centres(quiet_frames(frame_levels_db(waveform)))
    # silences at 1.0-1.4 s and 3.4-3.6 s; the 40 ms gap at 4.6 s is too short to be a pause
    assert pauses == pytest.approx([1.2, 3.5], abs=0.02)


def test_cut_points_keep_clips_at_least_the_minimum_apart():
    assert cut_points([0.1, 0.5, 0.6, 2.0, 2.9], 3.0) == [0.0, 0.5, 2.0, 3.0]


def test_a_partition_covers_the_recording_with_spans_nearest_the_target():
    points = [0.0, 1.0, 2.5, 6.0, 7.0, 40.0, 41.0]
    assert partition(points, 2.0) == [(0.0, 2.5), (2.5, 6.0), (6.0, 7.0), (7.0, 40.0), (40.0, 41.0)]
    assert partition(points, 6.0) == [(0.0, 6.0), (6.0, 7.0), (7.0, 40.0), (40.0, 41.0)]
    spans = partition(points, 30.0)
    assert spans[0] == (0.0, 7.0) and spans[-1][1] == 41.0  # never beyond MAX_CLIP_S, unless no point is nearer


def test_clips_of_a_synthetic_recording_start_and_end_in_its_pauses():
    waveform = tone_bursts([(0.5, False), (3.0, True), (0.5, False), (3.0, True), (0.5, False), (3.0, True),
                            (0.5, False)])
    found = cut_clips("synthetic.wav", waveform)
    pauses = [0.25, 3.75, 7.25, 10.75]
    edges = {round(c.start_s, 2) for c in found} | {round(c.end_s, 2) for c in found}
    assert edges <= {0.0, 11.0, *pauses} | {round(p + d, 2) for p in pauses for d in (-0.01, 0.01)}
    assert {c.duration_s for c in found} >= {3.5}  # single sentences, from pause to pause


def test_the_clip_set_is_fixed_real_speech_of_the_documented_lengths(clip_set):
    durations = np.array([c.clip.duration_s for c in clip_set])
    assert len(clip_set) == 96
    assert MIN_CLIP_S <= durations.min() and durations.max() <= MAX_CLIP_S
    assert durations.mean() == pytest.approx(5.48, abs=0.01)
    assert len({c.clip for c in clip_set}) == len(clip_set)  # no clip twice
    assert {c.clip.recording for c in clip_set} == {recording.name for recording in read_manifest()}
    for c in clip_set:
        assert len(c.waveform) == pytest.approx(c.clip.duration_s * SAMPLE_RATE, abs=SAMPLE_RATE // 1000)
        assert np.sqrt(np.mean(c.waveform**2)) > 0.01  # speech, not silence


def test_the_clip_set_is_the_same_every_time(clip_set):
    again = load_clips()
    assert [c.clip for c in again] == [c.clip for c in clip_set]
    assert all(np.array_equal(a.waveform, b.waveform) for a, b in zip(again, clip_set))


def test_a_clip_travels_as_16_bit_wav_of_its_samples(clip_set):
    clip = nearest(clip_set, 5.0)
    samples, rate = soundfile.read(io.BytesIO(clip.wav), dtype="float32")
    assert rate == SAMPLE_RATE
    assert np.abs(samples - clip.waveform).max() <= 1 / 32767
    assert soundfile.info(io.BytesIO(wav_bytes(clip.waveform))).subtype == "PCM_16"


def test_nearest_picks_the_closest_length(clip_set):
    assert abs(nearest(clip_set, 5.0).clip.duration_s - 5.0) == min(abs(c.clip.duration_s - 5.0) for c in clip_set)
    assert Clip("a.wav", 1.0, 3.5).name == "a@1.00-3.50"
