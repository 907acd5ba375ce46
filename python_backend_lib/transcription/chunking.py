"""Where batched long-form cuts a recording: into chunks of at most 30 s, each
ending in a pause.

Whisper reads 30 s at a time. Back-to-back 30 s windows cut words in half, and
the model drops the unfinished segment at a window's end: the speech there is
lost. Cutting each chunk in a pause near its end instead leaves every word
whole inside one chunk, and the chunks can still be decoded side by side.
(faster-whisper's batched pipeline cuts at pauses that a voice activity model
finds; here the pauses come from the log-mel itself.)

Pure functions of the log-mel; no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from python_backend_lib.core import geometry

# A chunk ends in a pause within its last this-many seconds: long enough to
# hold a pause between sentences (or between lines of verse), short enough
# that chunks stay near 30 s and few windows are decoded.
CUT_SEARCH_SECONDS = 10
CUT_SEARCH_FRAMES = CUT_SEARCH_SECONDS * geometry.FRAMES_PER_SECOND
# Loudness is averaged over this much before looking for quiet frames, so that
# a cut falls in a pause, not in the gap between two syllables.
PAUSE_SMOOTHING_FRAMES = round(0.3 * geometry.FRAMES_PER_SECOND)
# Frames within this much of the quietest are quiet (log-mel units: 1 is
# 40 dB, so this is 4 dB), and a run of quiet frames this long is a pause.
QUIET_MARGIN = 0.1
MIN_PAUSE_FRAMES = round(0.2 * geometry.FRAMES_PER_SECOND)


@dataclass(frozen=True)
class Chunk:
    """Mel frames [start, end) of a recording, decoded without the audio after `end`."""

    start: int
    end: int


def frame_loudness(mel: torch.Tensor) -> np.ndarray:
    """mel: [n_mels, frames], normalised log-mel; returns [frames], the mean over the bins."""
    return mel.float().mean(dim=0).cpu().numpy()


def plan_chunks(
    loudness: np.ndarray,
    content: int,
    *,
    max_frames: int = geometry.N_FRAMES,
    search_frames: int = CUT_SEARCH_FRAMES,
) -> tuple[Chunk, ...]:
    """Cut frames [0, content) into chunks of at most `max_frames`.

    loudness: [frames >= content], from `frame_loudness`. Each chunk but the
    last ends at the `cut_point` of its last `search_frames`.
    """
    if not 0 < search_frames < max_frames:  # every chunk keeps at least one frame
        raise ValueError(f"search_frames must be in 1..{max_frames - 1}, got {search_frames}")
    smoothed = _moving_average(loudness[:content], PAUSE_SMOOTHING_FRAMES)
    chunks, start = [], 0
    while content - start > max_frames:
        cut = cut_point(smoothed, start + max_frames - search_frames, start + max_frames)
        chunks.append(Chunk(start, cut))
        start = cut
    chunks.append(Chunk(start, content))
    return tuple(chunks)


def cut_point(loudness: np.ndarray, low: int, high: int) -> int:
    """The frame in [low, high) in the middle of the latest pause there (the
    latest: long chunks, so few windows; the middle: as far from speech on
    either side as the pause allows). Without a pause, the middle of the
    longest run of quiet frames (the latest of equals)."""
    span = loudness[low:high]
    quiet = span <= span.min() + QUIET_MARGIN
    # Runs of quiet frames, [start, end): where `quiet` switches on and off.
    edges = np.diff(np.concatenate([[0], quiet.astype(np.int8), [0]]))
    runs = list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))
    pauses = [run for run in runs if run[1] - run[0] >= MIN_PAUSE_FRAMES]
    start, end = pauses[-1] if pauses else max(reversed(runs), key=lambda run: run[1] - run[0])
    return int(low + (start + end) // 2)


def _moving_average(values: np.ndarray, width: int) -> np.ndarray:
    if width <= 1 or len(values) < width:
        return values
    return np.convolve(values, np.ones(width) / width, mode="same")
