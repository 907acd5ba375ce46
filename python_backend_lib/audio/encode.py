"""16 kHz samples as a WAV file: what the benchmarks and load tools send as a recording.
The inverse of `decode` for 16-bit PCM (tests/unit/test_audio.py). No torch."""

from __future__ import annotations

import io
import wave

import numpy as np

from python_backend_lib.core.geometry import SAMPLE_RATE


def wav_bytes(audio: np.ndarray) -> bytes:
    """16 kHz float samples as a 16-bit mono WAV file."""
    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()
