"""Audio bytes to Whisper's input waveform: 16 kHz mono float32 (numpy, no torch).

Files are decoded by libsndfile (through `soundfile`), raw float32 PCM by numpy,
and resampled by libsoxr. Bad input raises `AudioError`, whose message names
the problem; nothing here keeps state, so one process serves concurrent requests.
"""

from __future__ import annotations

import io
import math

import numpy as np
import soundfile
import soxr

from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.geometry import SAMPLE_RATE

# --- Limits on what a request may send ---------------------------------------
# The request parameters check raw PCM against these same bounds (serving.parameters).
MIN_SAMPLE_RATE = 1_000  # Hz; below this nothing is left of speech
MAX_SAMPLE_RATE = 384_000  # Hz; the fastest rate real converters produce
# Raw PCM's declared channels. 32 covers what a speech recogniser is sent (mono,
# stereo, surround, conference microphone arrays); a larger count is almost always
# a byte or sample count given as channels, and refusing it names that mistake
# instead of mixing garbage whenever the byte count happens to divide.
MAX_CHANNELS = 32
FLOAT32_BYTES = 4
# RIFF/WAVE: a 12-byte file header, then chunks of (4-byte id, 4-byte little-endian size, data).
RIFF_HEADER_BYTES = 12
RIFF_CHUNK_HEADER_BYTES = 8
# The data-chunk size that streaming writers put in a header before the length is known.
RIFF_UNKNOWN_SIZE = 0xFFFFFFFF
# Files are decoded this many frames at a time, so memory follows the audio
# actually present (not what a header claims) and `max_seconds` stops a
# decompression bomb early.
DECODE_BLOCK_FRAMES = 1 << 16


class AudioError(RequestError):
    """The audio a client sent cannot be used; the message names the problem."""


# --- Decoding ----------------------------------------------------------------


def decode_audio(data: bytes, *, max_seconds: float | None = None) -> np.ndarray:
    """Decode a whole audio file (WAV, FLAC, OGG/Vorbis or Opus, MP3, ...).

    data: the file's bytes. Anything libsndfile reads is accepted.
    max_seconds: reject longer audio (before resampling it); None for no limit.
    Returns float32 mono at SAMPLE_RATE, shape [samples], never empty.
    Raises AudioError for empty, undecodable, damaged, truncated, non-finite or too long audio.
    """
    _check_max_seconds(max_seconds)
    data = _as_bytes(data)
    if len(data) == 0:
        raise AudioError("audio is empty")
    _check_wav_length(data)
    frames, sample_rate = _decode_frames(data, max_seconds)  # [frames, channels]
    return _to_waveform(frames, sample_rate)


def pcm_to_waveform(
    data: bytes,
    sample_rate: int,
    *,
    channels: int = 1,
    max_seconds: float | None = None,
) -> np.ndarray:
    """Convert raw little-endian float32 PCM, channels interleaved, to Whisper's input.

    data: len(data) == frames * channels * 4 bytes.
    Returns float32 mono at SAMPLE_RATE, shape [samples], never empty.
    Raises AudioError for empty or ragged data, a bad rate or channel count,
    non-finite samples, or audio longer than max_seconds.
    """
    _check_max_seconds(max_seconds)
    _check_sample_rate(sample_rate)
    if isinstance(channels, bool) or not isinstance(channels, (int, np.integer)):
        raise AudioError(f"channels must be an integer, got {channels!r}")
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioError(f"channels must be from 1 to {MAX_CHANNELS}, got {channels}")
    data = _as_bytes(data)
    if len(data) == 0:
        raise AudioError("audio is empty")
    frame_bytes = FLOAT32_BYTES * channels
    if len(data) % frame_bytes != 0:
        raise AudioError(
            f"raw PCM is {len(data)} bytes, not a multiple of {frame_bytes} "
            f"({FLOAT32_BYTES}-byte float32 samples x {channels} channel(s))"
        )
    n_frames = len(data) // frame_bytes
    if n_frames > _frame_limit(max_seconds, sample_rate):
        raise _too_long(n_frames, sample_rate, max_seconds, exact=True)
    # astype copies: the result owns writable native-endian memory, not the request's bytes.
    frames = np.frombuffer(data, dtype="<f4").reshape(n_frames, channels).astype(np.float32)
    return _to_waveform(frames, sample_rate)


def to_mono(samples: np.ndarray) -> np.ndarray:
    """Average the channels: [frames, channels] -> [frames] float32.

    A 1-D array is taken to be mono already and returned as float32.
    """
    samples = np.asarray(samples)
    if samples.ndim == 1:
        return samples.astype(np.float32, copy=False)
    if samples.ndim != 2:
        raise ValueError(f"expected [frames, channels] samples, got shape {samples.shape}")
    if samples.shape[1] == 1:
        return samples[:, 0].astype(np.float32)
    return samples.mean(axis=1, dtype=np.float32)


def resample(waveform: np.ndarray, from_rate: int, to_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Resample [samples] (or [frames, channels]) with libsoxr's high-quality filter.

    Returns float32 with about len * to_rate / from_rate frames; the input
    itself (as float32) when the rates already agree.
    """
    _check_sample_rate(from_rate)
    _check_sample_rate(to_rate)
    waveform = np.ascontiguousarray(waveform, dtype=np.float32)
    if from_rate == to_rate:
        return waveform
    return soxr.resample(waveform, from_rate, to_rate, quality="HQ")


def _as_bytes(data) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"audio must be bytes, got {type(data).__name__}")
    return bytes(data)  # no copy when it is bytes already


def _decode_frames(data: bytes, max_seconds: float | None) -> tuple[np.ndarray, int]:
    """Decode with libsndfile, block by block: ([frames, channels] float32, sample rate)."""
    try:
        sound_file = soundfile.SoundFile(_InMemoryFile(data))
    except Exception as err:  # libsndfile reports bad data through several exception types
        raise AudioError(f"not a decodable audio file: {_reason(err)}") from None
    with sound_file:
        sample_rate = sound_file.samplerate
        _check_sample_rate(sample_rate)
        limit = _frame_limit(max_seconds, sample_rate)
        blocks, n_frames = [], 0
        while True:
            try:
                block = sound_file.read(DECODE_BLOCK_FRAMES, dtype="float32", always_2d=True)
            except Exception as err:
                raise AudioError(f"audio file is damaged or truncated: {_reason(err)}") from None
            if len(block) == 0:
                break
            blocks.append(block)
            n_frames += len(block)
            if n_frames > limit:
                # Stop decoding here; an honest header says how long the whole file is.
                claimed = sound_file.frames if 0 <= sound_file.frames < 1 << 62 else 0
                exact = claimed >= n_frames
                raise _too_long(max(claimed, n_frames), sample_rate, max_seconds, exact=exact)
    if n_frames == 0:
        raise AudioError("audio decodes to zero samples")
    return np.concatenate(blocks), sample_rate


class _InMemoryFile(io.BytesIO):
    """The bytes libsndfile reads through soundfile's callbacks.

    A damaged header can make libsndfile seek before the start of the file.
    BytesIO raises there, inside a C callback, where Python only prints the error;
    such a seek stays where it is instead, and decoding fails on what it reads next.
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


def _check_wav_length(data: bytes) -> None:
    """A WAV file whose data chunk claims more bytes than follow it is truncated
    (or its header lies); libsndfile would quietly decode what is there.

    Other formats pass: FLAC and MP3 fail in the codec, and Ogg has no total length.
    """
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    position = RIFF_HEADER_BYTES
    while position + RIFF_CHUNK_HEADER_BYTES <= len(data):
        chunk_id = data[position : position + 4]
        size = int.from_bytes(data[position + 4 : position + 8], "little")
        body = position + RIFF_CHUNK_HEADER_BYTES
        if chunk_id == b"data":
            present = len(data) - body
            if size != RIFF_UNKNOWN_SIZE and size > present:
                raise AudioError(
                    f"WAV file is truncated (or its header lies): the data chunk declares {size} bytes "
                    f"of samples, only {present} follow"
                )
            return
        position = body + size + (size & 1)  # chunks are padded to an even length


def _reason(err: Exception) -> str:
    # libsndfile's own words, without soundfile's "Error opening <_io.BytesIO object at 0x...>" prefix.
    return str(getattr(err, "error_string", None) or err).strip().rstrip(".")


def _to_waveform(frames: np.ndarray, sample_rate: int) -> np.ndarray:
    """[frames, channels] at sample_rate -> [samples] float32 at SAMPLE_RATE."""
    # Checked before resampling, which would smear one bad sample over many.
    if not np.isfinite(frames).all():
        raise AudioError("audio contains NaN or infinite samples")
    waveform = resample(to_mono(frames), sample_rate)
    if waveform.size == 0:
        raise AudioError(
            f"audio is too short: {len(frames)} sample(s) at {sample_rate} Hz "
            f"leave none at {SAMPLE_RATE} Hz"
        )
    return waveform


def _check_sample_rate(sample_rate: int) -> None:
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise AudioError(f"sample rate must be an integer number of Hz, got {sample_rate!r}")
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        raise AudioError(
            f"sample rate {sample_rate} Hz is outside {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz"
        )


def _check_max_seconds(max_seconds: float | None) -> None:
    # A bad limit is the server's mistake, not the client's: ValueError, not AudioError.
    if max_seconds is not None and not (
        isinstance(max_seconds, (int, float)) and not isinstance(max_seconds, bool)
        and math.isfinite(max_seconds) and max_seconds > 0
    ):
        raise ValueError(f"max_seconds must be a positive number or None, got {max_seconds!r}")


def _frame_limit(max_seconds: float | None, sample_rate: int) -> float:
    return math.inf if max_seconds is None else max_seconds * sample_rate


def _too_long(n_frames: int, sample_rate: int, max_seconds: float, *, exact: bool) -> AudioError:
    length = "" if exact else "at least "
    return AudioError(f"audio is {length}{n_frames / sample_rate:.1f} s long; the limit is {max_seconds:g} s")
