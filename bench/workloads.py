"""Benchmark workloads: clip durations, forced output lengths, and their audio.

Random-weight checkpoints read noise as well as speech, so clips are seeded
noise; what matters for speed is each clip's duration (RTFx counts it) and the
number of tokens decoded, which `min_new_tokens = max_new_tokens` forces.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16_000
# LibriSpeech test-clean utterances: median about 6 s, from under 2 s to 35 s;
# we draw from a log-normal of that median, clipped to 2..20 s.
LIBRISPEECH_MEDIAN_S = 6.5
LIBRISPEECH_SIGMA = 0.55
LIBRISPEECH_RANGE_S = (2.0, 20.0)
LIBRISPEECH_TOKENS = 30  # about what such an utterance transcribes to
LONG_CLIP_S = 30.0  # one full Whisper window
LONG_TOKENS = 100


@dataclass(frozen=True)
class Workload:
    name: str
    durations: tuple[float, ...]  # seconds of audio per request
    tokens: int  # forced output tokens per request

    @property
    def audio_seconds(self) -> float:
        return float(sum(self.durations))

    def __len__(self) -> int:
        return len(self.durations)


def librispeech_like(n: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    lo, hi = LIBRISPEECH_RANGE_S
    durations = np.clip(rng.lognormal(np.log(LIBRISPEECH_MEDIAN_S), LIBRISPEECH_SIGMA, n), lo, hi)
    return Workload("librispeech-like", tuple(np.round(durations, 2).tolist()), LIBRISPEECH_TOKENS)


def long_clips(n: int) -> Workload:
    return Workload("30s", (LONG_CLIP_S,) * n, LONG_TOKENS)


def noise(duration_s: float, seed: int) -> np.ndarray:
    """[samples] float32 seeded noise at speech-like level."""
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(duration_s * SAMPLE_RATE))).astype(np.float32)
