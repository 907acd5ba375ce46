"""Audio in, Whisper features out: bytes -> 16 kHz mono waveform -> log-mel spectrogram.

Decoding uses libsndfile (through `soundfile`) for files and numpy for raw
float32 PCM; resampling uses libsoxr. The log-mel is computed in torch so that
it runs wherever the model runs, and equals `transformers.WhisperFeatureExtractor`
(which is what the Whisper checkpoints were trained on) to float32 rounding.

Every function here is pure: the only state is a cache of constant mel filter
banks, so one process may serve concurrent requests.
"""

from __future__ import annotations

import functools
import io
import math

import numpy as np
import soundfile
import soxr
import torch
import torch.nn.functional as F

# --- Whisper's fixed audio geometry -----------------------------------------
SAMPLE_RATE = 16000  # Hz; every checkpoint was trained at this rate
N_FFT = 400  # samples per STFT window: 25 ms
HOP_LENGTH = 160  # samples between STFT frames: 10 ms
CHUNK_SECONDS = 30  # the encoder sees exactly this much audio at a time
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480,000 samples in one window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3,000 mel frames in one window
N_FREQ_BINS = N_FFT // 2 + 1  # 201 rows of a one-sided spectrum
ENCODER_STRIDE = 2  # the encoder's second conv halves the frame rate
N_AUDIO_CTX = N_FRAMES // ENCODER_STRIDE  # 1,500 encoder positions per window

FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100 mel frames per second
SECONDS_PER_FRAME = HOP_LENGTH / SAMPLE_RATE  # 0.01 s
SAMPLES_PER_POSITION = HOP_LENGTH * ENCODER_STRIDE  # 320 samples per encoder position
# 0.02 s: one encoder position, which is also the step between timestamp tokens.
SECONDS_PER_POSITION = SAMPLES_PER_POSITION / SAMPLE_RATE

# --- Log-mel parameters (Whisper's training recipe) --------------------------
SUPPORTED_N_MELS = (80, 128)  # 80 up to large-v2, 128 from large-v3 on
MEL_MAX_HZ = SAMPLE_RATE / 2  # filters span 0 Hz up to Nyquist, 8 kHz
LOG_POWER_FLOOR = 1e-10  # keeps log10 finite on digital silence (-100 dB)
DYNAMIC_RANGE = 8.0  # log10 units (80 dB) kept below the loudest bin
# (x + 4) / 4 maps the usual log10-power range of speech to roughly [-1, 1].
LOG_MEL_OFFSET = 4.0
LOG_MEL_SCALE = 4.0

# Slaney's mel scale: linear below 1 kHz, logarithmic above, joined at 15 mel.
MEL_HZ_PER_MEL = 200.0 / 3.0
MEL_BREAK_HZ = 1000.0
MEL_BREAK_MEL = MEL_BREAK_HZ / MEL_HZ_PER_MEL  # 15 mel
MEL_LOG_STEP = math.log(6.4) / 27.0  # natural-log Hz per mel above the break

# --- Limits on what a request may send ---------------------------------------
MIN_SAMPLE_RATE = 1_000  # Hz; below this nothing is left of speech
MAX_SAMPLE_RATE = 384_000  # Hz; the fastest rate real converters produce
MAX_CHANNELS = 256  # more than any real capture; stops a wrong count early
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


class AudioError(ValueError):
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


def pad_or_trim(waveform, length: int = N_SAMPLES):
    """Zero-pad or cut the last axis to exactly `length` samples.

    waveform: numpy array or torch tensor [..., samples]; returns the same kind [..., length].
    """
    n = waveform.shape[-1]
    if n == length:
        return waveform
    if n > length:
        return waveform[..., :length]
    if isinstance(waveform, torch.Tensor):
        return F.pad(waveform, (0, length - n))
    widths = [(0, 0)] * (waveform.ndim - 1) + [(0, length - n)]
    return np.pad(waveform, widths)


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


# --- Log-mel spectrogram ------------------------------------------------------


def mel_filters(n_mels: int, device=None) -> torch.Tensor:
    """Slaney-normalised triangular mel filters on Slaney's mel scale, 0 Hz to 8 kHz.

    Returns float32 [n_mels, N_FREQ_BINS], cached per (n_mels, device) and
    shared between callers: treat it as read-only.
    """
    if n_mels not in SUPPORTED_N_MELS:
        raise ValueError(f"n_mels must be one of {SUPPORTED_N_MELS}, got {n_mels!r}")
    return _cached_mel_filters(n_mels, torch.device("cpu" if device is None else device))


@functools.lru_cache(maxsize=None)
def _cached_mel_filters(n_mels: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_mel_filter_bank(n_mels)).to(device, torch.float32)


def _mel_filter_bank(n_mels: int) -> np.ndarray:
    """float64 [n_mels, N_FREQ_BINS]; row m rises from edge m to m+1 and falls to m+2."""
    edges_mel = np.linspace(_hz_to_mel(0.0), _hz_to_mel(MEL_MAX_HZ), n_mels + 2)
    edges_hz = _mel_to_hz(edges_mel)  # [n_mels + 2]
    lower, centre, upper = (e[:, None] for e in (edges_hz[:-2], edges_hz[1:-1], edges_hz[2:]))
    bin_hz = np.linspace(0.0, SAMPLE_RATE / 2, N_FREQ_BINS)[None, :]  # [1, N_FREQ_BINS]
    rising = (bin_hz - lower) / (centre - lower)  # [n_mels, N_FREQ_BINS]
    falling = (upper - bin_hz) / (upper - centre)
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    # Slaney normalisation: every filter has the same area, so wide high
    # filters do not collect more energy than narrow low ones.
    return triangles * (2.0 / (upper - lower))


def _hz_to_mel(hz) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    log_part = MEL_BREAK_MEL + np.log(np.maximum(hz, MEL_BREAK_HZ) / MEL_BREAK_HZ) / MEL_LOG_STEP
    return np.where(hz < MEL_BREAK_HZ, hz / MEL_HZ_PER_MEL, log_part)


def _mel_to_hz(mel) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    log_part = MEL_BREAK_HZ * np.exp(MEL_LOG_STEP * (np.maximum(mel, MEL_BREAK_MEL) - MEL_BREAK_MEL))
    return np.where(mel < MEL_BREAK_MEL, mel * MEL_HZ_PER_MEL, log_part)


def log_mel_spectrogram(
    waveform,
    n_mels: int,
    *,
    padding: int = 0,
    device=None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Whisper's log-mel spectrogram of 16 kHz audio.

    waveform: numpy array or tensor [samples] or [batch, samples].
    padding: zero samples appended before the STFT (as the 30 s window pads).
    device: where to compute; None means the tensor's device, or CPU for numpy.
    dtype: of the result; the STFT itself is always float32.
    Returns [n_mels, frames] (or [batch, n_mels, frames]) with
    frames = (samples + padding) // HOP_LENGTH: the STFT's centred last frame is dropped.
    The 8.0 dynamic-range floor is taken per item, over all its frames.
    """
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"padding must be a non-negative integer, got {padding!r}")
    filters = mel_filters(n_mels, _resolve_device(waveform, device))
    audio = _as_float32_tensor(waveform, filters.device)
    if padding:
        audio = F.pad(audio, (0, padding))
    # Centred reflect padding needs more than N_FFT // 2 samples to reflect.
    if audio.shape[-1] <= N_FFT // 2:
        raise ValueError(f"need more than {N_FFT // 2} samples (with padding), got {audio.shape[-1]}")
    leading = audio.shape[:-1]
    stft = torch.stft(
        audio.reshape(-1, audio.shape[-1]),  # [items, samples]
        N_FFT,
        HOP_LENGTH,
        window=torch.hann_window(N_FFT, periodic=True, device=filters.device),
        center=True,
        pad_mode="reflect",
        return_complex=True,
    )  # [items, N_FREQ_BINS, frames + 1]
    power = stft[..., :-1].abs().pow(2)  # [items, N_FREQ_BINS, frames]
    log_mel = torch.clamp(filters @ power, min=LOG_POWER_FLOOR).log10()  # [items, n_mels, frames]
    loudest = log_mel.amax(dim=(-2, -1), keepdim=True)  # [items, 1, 1]
    log_mel = torch.maximum(log_mel, loudest - DYNAMIC_RANGE)
    log_mel = (log_mel + LOG_MEL_OFFSET) / LOG_MEL_SCALE
    return log_mel.reshape(*leading, n_mels, log_mel.shape[-1]).to(dtype)


def window_features(
    waveform,
    n_mels: int,
    device=None,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Features of one 30 s window: exactly WhisperFeatureExtractor's input_features.

    waveform: [samples] at 16 kHz, numpy or tensor; cut or zero-padded to
    N_SAMPLES before the STFT. Returns [n_mels, N_FRAMES] (or [batch, n_mels, N_FRAMES]).
    """
    audio = _as_float32_tensor(waveform, _resolve_device(waveform, device))
    return log_mel_spectrogram(pad_or_trim(audio, N_SAMPLES), n_mels, dtype=dtype)


def _resolve_device(waveform, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if isinstance(waveform, torch.Tensor):
        return waveform.device
    return torch.device("cpu")


def _as_float32_tensor(waveform, device: torch.device) -> torch.Tensor:
    if isinstance(waveform, torch.Tensor):
        return waveform.to(device, torch.float32)
    # Through float32 numpy first, as the feature extractor rounds float64 input.
    array = np.ascontiguousarray(waveform, dtype=np.float32)
    if not array.flags.writeable:  # torch.from_numpy warns on read-only memory
        array = array.copy()
    return torch.from_numpy(array).to(device)
