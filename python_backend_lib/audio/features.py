"""Whisper's log-mel spectrogram, in torch so that it runs wherever the model runs.

It equals `transformers.WhisperFeatureExtractor` (what the checkpoints were
trained on) to float32 rounding. Every function is pure: the only state is a
cache of constant mel filter banks, so one process may serve concurrent requests.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from python_backend_lib.core.geometry import (
    HOP_LENGTH,
    N_FFT,
    N_FREQ_BINS,
    N_SAMPLES,
    SAMPLE_RATE,
    reached_frames,
)
from python_backend_lib.devices.transfers import through_pinned

# --- Log-mel parameters (Whisper's training recipe) --------------------------
SUPPORTED_N_MELS = (80, 128)  # 80 up to large-v2, 128 from large-v3 on
MEL_MAX_HZ = SAMPLE_RATE / 2  # filters span 0 Hz up to Nyquist, 8 kHz
LOG_POWER_FLOOR = 1e-10  # keeps log10 finite on digital silence (-100 dB)
DYNAMIC_RANGE = 8.0  # log10 units (80 dB) kept below the loudest bin
# (x + 4) / 4 maps the usual log10-power range of speech to roughly [-1, 1].
LOG_MEL_OFFSET = 4.0
LOG_MEL_SCALE = 4.0

# A window whose loudest spectral bin stays below this log10 power (about 90 dB
# under a full-scale tone, whose peak is near 4) holds digital silence. Whisper's
# own no-speech rule does not catch it (tiny.en writes a confident "you" on
# zeros), so such windows are answered as silent without decoding.
SILENCE_LOG10_POWER = -5.0
# The same threshold on the normalised log-mel, (log10 + 4) / 4.
SILENCE_LOG_MEL = (SILENCE_LOG10_POWER + LOG_MEL_OFFSET) / LOG_MEL_SCALE

# Slaney's mel scale: linear below 1 kHz, logarithmic above, joined at 15 mel.
MEL_HZ_PER_MEL = 200.0 / 3.0
MEL_BREAK_HZ = 1000.0
MEL_BREAK_MEL = MEL_BREAK_HZ / MEL_HZ_PER_MEL  # 15 mel
MEL_LOG_STEP = math.log(6.4) / 27.0  # natural-log Hz per mel above the break


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
def _hann_window(device: torch.device) -> torch.Tensor:
    """The STFT's periodic Hann window, made once per device (read-only)."""
    return torch.hann_window(N_FFT, periodic=True, device=device)


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
        window=_hann_window(filters.device),
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
    return _to_device(np.ascontiguousarray(waveform, dtype=np.float32), device)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device`, without waiting for the device."""
    if device.type == "cuda":
        return through_pinned(array.shape, lambda staging: np.copyto(staging, array), device)
    if not array.flags.writeable:  # torch.from_numpy warns on read-only memory
        array = array.copy()
    return torch.from_numpy(array)


def without_padding(features: torch.Tensor, samples: int) -> torch.Tensor:
    """`features_for`'s features of a recording of `samples` samples, cut to
    `geometry.reached_frames`: the frames that travel between processes."""
    return features[..., : reached_frames(samples)]


def features_for(waveform, n_mels: int, device=None) -> torch.Tensor:
    """Log-mel for `LongFormJob`: one exact window up to 30 s, else the whole
    recording followed by 30 s of silence (so every window is full)."""
    if len(waveform) <= N_SAMPLES:
        return window_features(waveform, n_mels, device)
    return log_mel_spectrogram(waveform, n_mels, padding=N_SAMPLES, device=device)


def features_for_many(waveforms: Sequence, n_mels: int, device=None) -> list[torch.Tensor]:
    """`features_for` of several recordings, in one batched pass for those up to 30 s.

    The short ones travel as one concatenation (a single copy to the device),
    are zero-padded to 30 s there and go through one STFT; each item keeps its
    own dynamic-range floor, so every result equals `features_for` of it alone.
    Longer recordings are computed one by one. The padding is done by two native
    calls whatever the count, as `execute` pays for each Python-level operation.
    """
    device = _resolve_device(waveforms[0], device) if waveforms else torch.device("cpu")
    results: list[torch.Tensor | None] = [None] * len(waveforms)
    short = [i for i, w in enumerate(waveforms) if len(w) <= N_SAMPLES]
    for i in range(len(waveforms)):
        if i not in short:
            results[i] = features_for(waveforms[i], n_mels, device)
    if short:
        lengths = [len(waveforms[i]) for i in short]
        flat = _concatenated([waveforms[i] for i in short], device)  # [sum(lengths)]
        rows = pad_sequence(flat.split(lengths), batch_first=True)  # [n, longest], zero-padded
        padded = F.pad(rows, (0, N_SAMPLES - rows.shape[1]))  # [n, N_SAMPLES]
        for i, item in zip(short, log_mel_spectrogram(padded, n_mels)):
            results[i] = item
    return results


def _concatenated(waveforms: Sequence, device: torch.device) -> torch.Tensor:
    """The waveforms end to end, float32, on `device`. Numpy waveforms bound for
    a GPU are copied once, straight into the pinned buffer that travels: at
    hundreds of requests a second these copies are most of `execute`'s time."""
    if all(isinstance(w, torch.Tensor) for w in waveforms):
        return torch.cat([w.reshape(-1) for w in waveforms]).to(device, torch.float32)
    arrays = [np.asarray(w, dtype=np.float32).reshape(-1) for w in waveforms]
    if device.type != "cuda":
        return torch.from_numpy(np.concatenate(arrays))
    total = sum(len(a) for a in arrays)
    return through_pinned((total,), lambda staging: np.concatenate(arrays, out=staging), device)
