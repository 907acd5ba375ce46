"""RIFF/WAVE files read directly: their chunks, a truncation check, and 16-bit PCM.

Most clients send WAV files of 16-bit PCM. Their samples need no codec: numpy
reads them straight from the request's bytes, with the same float32 values as
libsndfile (a 16-bit sample over 32768, exact in float32), far cheaper than a
libsndfile file object read through Python callbacks. Anything else about a
WAV file (other sample formats, WAVE_FORMAT_EXTENSIBLE, a damaged or odd
layout, audio past the limit) is left to libsndfile, whose errors name it;
`pcm16_frames` then returns None.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from python_backend_lib.audio.limits import (
    MAX_CHANNELS,
    MAX_SAMPLE_RATE,
    MIN_SAMPLE_RATE,
    AudioError,
    DecodedFrames,
    frame_limit,
)

# A 12-byte file header, then chunks of (4-byte id, 4-byte little-endian size, data).
RIFF_HEADER_BYTES = 12
RIFF_CHUNK_HEADER_BYTES = 8
# The data-chunk size that streaming writers put in a header before the length is known.
RIFF_UNKNOWN_SIZE = 0xFFFFFFFF
WAVE_FORMAT_PCM = 1
FMT_BYTES = 16  # format tag, channels, sample rate, byte rate, block align, bits per sample
PCM16_FULL_SCALE = np.float32(1 / 32768)  # libsndfile's normalisation of 16-bit samples


@dataclass(frozen=True)
class Chunk:
    """One chunk of a RIFF file: its id, its declared size and where its data starts."""

    id: bytes
    size: int
    body: int


def is_wav(data: bytes) -> bool:
    return data[:4] == b"RIFF" and data[8:12] == b"WAVE"


def chunks(data: bytes) -> Iterator[Chunk]:
    """The chunks of a RIFF/WAVE file's bytes, in order, up to the first whose header is cut
    short; a chunk's data may run past the end (a truncated file)."""
    position = RIFF_HEADER_BYTES
    while position + RIFF_CHUNK_HEADER_BYTES <= len(data):
        size = int.from_bytes(data[position + 4 : position + 8], "little")
        body = position + RIFF_CHUNK_HEADER_BYTES
        yield Chunk(data[position : position + 4], size, body)
        position = body + size + (size & 1)  # chunks are padded to an even length


def check_wav_length(data: bytes) -> None:
    """A WAV file whose data chunk claims more bytes than follow it is truncated
    (or its header lies); libsndfile would quietly decode what is there.

    Other formats pass: FLAC and MP3 fail in the codec, and Ogg has no total length.
    """
    if not is_wav(data):
        return
    for chunk in chunks(data):
        if chunk.id == b"data":
            present = len(data) - chunk.body
            if chunk.size != RIFF_UNKNOWN_SIZE and chunk.size > present:
                raise AudioError(
                    f"WAV file is truncated (or its header lies): the data chunk declares {chunk.size} bytes "
                    f"of samples, only {present} follow"
                )
            return


@dataclass(frozen=True)
class WavFormat:
    """The fields of a `fmt ` chunk that say how its samples are laid out."""

    tag: int
    channels: int
    sample_rate: int
    block_align: int
    bits: int

    @classmethod
    def read(cls, data: bytes, chunk: Chunk) -> WavFormat | None:
        if chunk.size < FMT_BYTES or chunk.body + FMT_BYTES > len(data):
            return None
        field = [int.from_bytes(data[chunk.body + a : chunk.body + b], "little")
                 for a, b in ((0, 2), (2, 4), (4, 8), (12, 14), (14, 16))]  # fmt: skip
        return cls(*field)

    def is_plain_pcm16(self) -> bool:
        return (self.tag == WAVE_FORMAT_PCM and self.bits == 16 and 1 <= self.channels <= MAX_CHANNELS
                and self.block_align == 2 * self.channels
                and MIN_SAMPLE_RATE <= self.sample_rate <= MAX_SAMPLE_RATE)  # fmt: skip


def pcm16_frames(data: bytes, max_seconds: float | None) -> DecodedFrames | None:
    """A plain 16-bit PCM WAV file's frames ([frames, channels] float32), as libsndfile reads
    them; None for any other file, or one whose reading libsndfile should judge."""
    if not is_wav(data):
        return None
    fmt = None
    for chunk in chunks(data):
        if chunk.id == b"fmt " and fmt is None:
            fmt = WavFormat.read(data, chunk)
        elif chunk.id == b"data":
            return _pcm16(data, chunk, fmt, max_seconds) if fmt is not None and fmt.is_plain_pcm16() else None
    return None


def _pcm16(data: bytes, chunk: Chunk, fmt: WavFormat, max_seconds: float | None) -> DecodedFrames | None:
    whole = chunk.size not in (0, RIFF_UNKNOWN_SIZE) and chunk.size % fmt.block_align == 0
    if not whole or chunk.body + chunk.size > len(data):
        return None
    n_frames = chunk.size // fmt.block_align
    if n_frames > frame_limit(max_seconds, fmt.sample_rate):
        return None  # libsndfile's reading says how long it is
    samples = np.frombuffer(data, "<i2", count=n_frames * fmt.channels, offset=chunk.body)
    frames = samples.reshape(n_frames, fmt.channels).astype(np.float32) * PCM16_FULL_SCALE
    return DecodedFrames(frames, fmt.sample_rate)
