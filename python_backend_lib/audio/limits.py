"""What a request's audio may be, and the error when it is not (no torch).

Both decoders share these: libsndfile's (`decode`) and FFmpeg's (`containers`).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from python_backend_lib.core.errors import RequestError

MIN_SAMPLE_RATE = 1_000  # Hz; below this nothing is left of speech
MAX_SAMPLE_RATE = 384_000  # Hz; the fastest rate real converters produce
# Raw PCM's declared channels, and those of a file FFmpeg reads. 32 covers what
# a speech recogniser is sent (mono, stereo, surround, conference microphone
# arrays); a larger count is almost always a byte or sample count given as
# channels, and refusing it names that mistake instead of mixing garbage
# whenever the byte count happens to divide. (The request parameters check raw
# PCM against these same bounds: contract.parameters.)
MAX_CHANNELS = 32
# Files are decoded about this many frames at a time, so memory follows the
# audio actually present (not what a header claims) and `max_seconds` stops a
# decompression bomb early.
DECODE_BLOCK_FRAMES = 1 << 16


class AudioError(RequestError):
    """The audio a client sent cannot be used; the message names the problem."""


@dataclass(frozen=True)
class DecodedFrames:
    """A decoder's output before mixing and resampling."""

    samples: np.ndarray  # [frames, channels] float32
    sample_rate: int  # Hz


def check_sample_rate(sample_rate: int) -> None:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise AudioError(f"sample rate must be an integer number of Hz, got {sample_rate!r}")
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        raise AudioError(
            f"sample rate {sample_rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz"
        )


def frame_limit(max_seconds: float | None, sample_rate: int) -> float:
    """How many frames at `sample_rate` fit in `max_seconds` (no limit for None)."""
    return math.inf if max_seconds is None else max_seconds * sample_rate


def too_long(decoded: int, declared: int | None, sample_rate: int, max_seconds: float) -> AudioError:
    """The error for audio past the limit, decoding stopped after `decoded` frames.

    An honest header (`declared` frames, at least as many as were decoded) says
    how long the whole file is; otherwise the length is only a lower bound.
    """
    exact = declared is not None and declared >= decoded
    frames, length = (declared, "") if exact else (decoded, "at least ")
    return AudioError(f"audio is {length}{frames / sample_rate:.1f} s long; the limit is {max_seconds:g} s")


class InMemoryFile(io.BytesIO):
    """The bytes a decoder reads through Python callbacks.

    A damaged header can make a decoder seek before the start of the file.
    BytesIO raises there, inside a C callback, where Python only prints the
    error; such a seek stays where it is instead, and decoding fails on what
    it reads next.
    """

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            with self.getbuffer() as view:
                start = view.nbytes
        else:
            start = self.tell() if whence == io.SEEK_CUR else 0
        if start + offset < 0:
            return self.tell()
        return super().seek(offset, whence)
