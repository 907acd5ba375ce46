"""Real-speech clips for the served benchmark, cut from the test recordings at quiet points.

The recordings in tests/data/audio (speech from 1 s to 53 s) are cut where the
speaker pauses, at several target lengths, so the set holds single words,
phrases, sentences and whole 30 s windows, as a mix of real requests would.
Every step is deterministic: the same files give the same clips.

1. Each recording is measured in 20 ms frames (RMS level in dB). A frame is
   quiet when its level is nearer the recording's noise floor (10th percentile)
   than its speech level (95th percentile): below a quarter of the way up.
2. Every run of quiet frames of at least 0.1 s is a pause; its centre is a cut
   point, as are the recording's start and end. Cut points closer than
   MIN_CLIP_S to the previous one (or to the end) are dropped.
3. For each target length in SCALES_S, the recording is partitioned from its
   start: each clip ends at the cut point whose distance from the clip's start
   is nearest the target, never beyond MAX_CLIP_S.
4. The union of those partitions, without repeats, is the clip set; a clip
   with less than MIN_SPEECH_S of non-quiet frames is left out.

From the 15 recordings this gives 96 clips, 0.5 to 29.9 s, mean 5.48 s
(tests/unit/test_bench_clips.py pins these figures).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from loadtest.clips import DEFAULT_AUDIO_DIR, read_manifest
from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.encode import wav_bytes
from python_backend_lib.core.geometry import SAMPLE_RATE

AUDIO_DIR = DEFAULT_AUDIO_DIR

FRAME_S = 0.02  # level frames: one encoder position
FRAME_SAMPLES = round(FRAME_S * SAMPLE_RATE)
FLOOR_PERCENTILE = 10  # the recording's noise floor, in frame levels
SPEECH_PERCENTILE = 95  # its speech level
QUIET_FRACTION = 0.25  # quiet: less than this fraction of the way from floor to speech (in dB)
MIN_PAUSE_S = 0.1  # a shorter quiet run is a gap between syllables, not a pause
MIN_CLIP_S = 0.3
MAX_CLIP_S = 30.0  # one Whisper window
SCALES_S = (2, 4, 6, 8, 10, 15, 20, 30)  # target lengths; the set is the union of these partitions
MIN_SPEECH_S = 0.1
LEVEL_FLOOR_DB = -120.0  # level of digital silence, so log10 stays finite


@dataclass(frozen=True)
class Clip:
    """A stretch of one recording, in seconds from its start (multiples of FRAME_S / 2)."""

    recording: str
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return round(self.end_s - self.start_s, 3)

    @property
    def name(self) -> str:
        return f"{Path(self.recording).stem}@{self.start_s:.2f}-{self.end_s:.2f}"

    def samples(self) -> slice:
        return slice(round(self.start_s * SAMPLE_RATE), round(self.end_s * SAMPLE_RATE))


@dataclass(frozen=True, eq=False)
class ClipAudio:
    """A clip with its audio: the waveform (16 kHz mono float32) and the WAV file sent to the server."""

    clip: Clip
    waveform: np.ndarray

    @cached_property
    def wav(self) -> bytes:
        return wav_bytes(self.waveform)


def frame_levels_db(waveform: np.ndarray) -> np.ndarray:
    """[frames] RMS level of each whole FRAME_S frame, in dB full scale."""
    frames = len(waveform) // FRAME_SAMPLES
    blocks = waveform[: frames * FRAME_SAMPLES].astype(np.float64).reshape(frames, FRAME_SAMPLES)
    power = (blocks**2).mean(axis=1)
    return np.maximum(10 * np.log10(np.maximum(power, 1e-30)), LEVEL_FLOOR_DB)


def quiet_frames(levels_db: np.ndarray) -> np.ndarray:
    """[frames] bool: frames nearer the noise floor than the speech level (see the module docstring)."""
    floor, speech = np.percentile(levels_db, [FLOOR_PERCENTILE, SPEECH_PERCENTILE])
    return levels_db < floor + QUIET_FRACTION * (speech - floor)


def pause_centres(quiet: np.ndarray) -> list[float]:
    """Centres (seconds) of the quiet runs at least MIN_PAUSE_S long."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], quiet.astype(np.int8), [0]])))
    starts, ends = edges[0::2], edges[1::2]  # [start, end) frame index of each quiet run
    min_frames = round(MIN_PAUSE_S / FRAME_S)
    return [round((s + e) / 2 * FRAME_S, 3) for s, e in zip(starts, ends) if e - s >= min_frames]


def cut_points(pauses: list[float], duration_s: float) -> list[float]:
    """The start, the pauses at least MIN_CLIP_S from the last kept point and from the end, and the end."""
    points = [0.0]
    for pause in pauses:
        if pause - points[-1] >= MIN_CLIP_S and duration_s - pause >= MIN_CLIP_S:
            points.append(pause)
    return points + [duration_s]


def partition(points: list[float], target_s: float) -> list[tuple[float, float]]:
    """Consecutive (start, end) spans from the first point to the last, each ending at the
    point whose distance from the span's start is nearest `target_s` (ties: the shorter),
    at most MAX_CLIP_S (or the next point, when even that is further)."""
    spans, i = [], 0
    while i < len(points) - 1:
        reachable = [k for k in range(i + 1, len(points)) if points[k] - points[i] <= MAX_CLIP_S] or [i + 1]
        k = min(reachable, key=lambda k: abs(points[k] - points[i] - target_s))
        spans.append((points[i], points[k]))
        i = k
    return spans


def cut_clips(recording: str, waveform: np.ndarray) -> list[Clip]:
    """The clips of one recording, in order of start, then end."""
    levels = frame_levels_db(waveform)
    quiet = quiet_frames(levels)
    points = cut_points(pause_centres(quiet), len(waveform) / SAMPLE_RATE)
    spans = sorted({span for target in SCALES_S for span in partition(points, target)})
    min_speech_frames = round(MIN_SPEECH_S / FRAME_S)
    clips = []
    for start, end in spans:
        first, last = int(start / FRAME_S), int(np.ceil(end / FRAME_S))
        if MIN_CLIP_S <= end - start <= MAX_CLIP_S and (~quiet[first:last]).sum() >= min_speech_frames:
            clips.append(Clip(recording, start, end))
    return clips


def load_clips(audio_dir: Path = AUDIO_DIR) -> list[ClipAudio]:
    """Every clip of every recording the manifest lists (`loadtest.clips.read_manifest`),
    recordings in manifest order."""
    out = []
    for recording in read_manifest(audio_dir):
        waveform = decode_audio(recording.audio)
        out += [ClipAudio(clip, waveform[clip.samples()]) for clip in cut_clips(recording.name, waveform)]
    return out


def nearest(clips: list[ClipAudio], duration_s: float) -> ClipAudio:
    """The clip whose length is nearest `duration_s` (the first of equals)."""
    return min(clips, key=lambda c: abs(c.clip.duration_s - duration_s))
