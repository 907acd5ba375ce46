"""Audio bytes to Whisper's input waveform: 16 kHz mono float32 (numpy, no torch).

A WAV file of 16-bit PCM is read by numpy (`wav`); other files are decoded by
libsndfile (through `soundfile`) where it recognises the
format (WAV, FLAC, Ogg, MP3, AIFF, ...), since it reads those fastest; anything
else goes to FFmpeg (`containers`: M4A, MP4, WebM, video files). Raw float32
PCM is read by numpy, and everything is resampled by libsoxr. Bad input raises
`AudioError`, whose message names the problem; nothing here keeps state, so
one process serves concurrent requests.
"""

from __future__ import annotations

import math

import numpy as np
import soundfile
import soxr

from python_backend_lib.audio.limits import (  # noqa: F401  (AudioError and the limits are importable from here too)
    DECODE_BLOCK_FRAMES,
    MAX_CHANNELS,
    MAX_SAMPLE_RATE,
    MIN_SAMPLE_RATE,
    AudioError,
    DecodedFrames,
    InMemoryFile,
    check_sample_rate,
    frame_limit,
    too_long,
)
from python_backend_lib.audio.wav import check_wav_length, pcm16_frames
from python_backend_lib.core.geometry import SAMPLE_RATE

FLOAT32_BYTES = 4
# libsndfile's error codes for files that go to FFmpeg instead: bytes it does
# not recognise as any of its formats (SF_ERR_UNRECOGNISED_FORMAT), and a
# format it knows holding a codec it lacks (SF_ERR_UNSUPPORTED_ENCODING: ALAC
# in CAF, say). Any other error is its verdict on a damaged file.
LIBSNDFILE_DECLINES = frozenset({1, 4})


# --- Decoding ----------------------------------------------------------------


def decode_audio(data: bytes, *, max_seconds: float | None = None) -> np.ndarray:
    """Decode a whole audio or video file's sound (WAV, FLAC, Ogg, MP3, M4A, MP4, WebM, ...).

    data: the file's bytes. Anything libsndfile reads is accepted, and what
    it does not recognise is read by FFmpeg (`containers.DEMUXERS`).
    max_seconds: reject longer audio (before resampling it); None for no limit.
    Returns float32 mono at SAMPLE_RATE, shape [samples], never empty.
    Raises AudioError for empty, undecodable, damaged, truncated, non-finite or
    too long audio, and for a file without an audio stream.
    """
    _check_max_seconds(max_seconds)
    data = _as_bytes(data)
    if len(data) == 0:
        raise AudioError("audio is empty")
    check_wav_length(data)
    decoded = pcm16_frames(data, max_seconds) or decode_with_libsndfile(data, max_seconds)
    if decoded is None:
        # Imported here: FFmpeg's libraries load only for a file that needs them.
        from python_backend_lib.audio.containers import decode_container

        decoded = decode_container(data, max_seconds)
    return _to_waveform(decoded.samples, decoded.sample_rate)


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
    check_sample_rate(sample_rate)
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
    if n_frames > frame_limit(max_seconds, sample_rate):
        raise too_long(n_frames, n_frames, sample_rate, max_seconds)
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
    check_sample_rate(from_rate)
    check_sample_rate(to_rate)
    waveform = np.ascontiguousarray(waveform, dtype=np.float32)
    if from_rate == to_rate:
        return waveform
    return soxr.resample(waveform, from_rate, to_rate, quality="HQ")


def _as_bytes(data) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"audio must be bytes, got {type(data).__name__}")
    return bytes(data)  # no copy when it is bytes already


def decode_with_libsndfile(data: bytes, max_seconds: float | None) -> DecodedFrames | None:
    """Decode a file libsndfile reads, block by block, at the file's own rate and channels.

    Returns None when libsndfile does not recognise the format (FFmpeg's turn);
    raises AudioError for a file it recognises but cannot use.
    """
    try:
        sound_file = soundfile.SoundFile(InMemoryFile(data))
    except Exception as err:  # libsndfile reports bad data through several exception types
        if getattr(err, "code", None) in LIBSNDFILE_DECLINES:
            return None
        raise AudioError(f"not a decodable audio file: {_reason(err)}") from None
    with sound_file:
        sample_rate = sound_file.samplerate
        check_sample_rate(sample_rate)
        limit = frame_limit(max_seconds, sample_rate)
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
                declared = sound_file.frames if 0 <= sound_file.frames < 1 << 62 else None
                raise too_long(n_frames, declared, sample_rate, max_seconds)
    if n_frames == 0:
        raise AudioError("audio decodes to zero samples")
    return DecodedFrames(np.concatenate(blocks), sample_rate)


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


def _check_max_seconds(max_seconds: float | None) -> None:
    # A bad limit is the server's mistake, not the client's: ValueError, not AudioError.
    if max_seconds is not None and not (
        isinstance(max_seconds, (int, float)) and not isinstance(max_seconds, bool)
        and math.isfinite(max_seconds) and max_seconds > 0
    ):
        raise ValueError(f"max_seconds must be a positive number or None, got {max_seconds!r}")
