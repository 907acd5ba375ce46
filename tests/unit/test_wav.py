"""16-bit PCM WAV files read by numpy (`audio.wav`) against libsndfile, the reference:
the same frames bit for bit, and every other file left to libsndfile."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile
from hypothesis import given, settings
from hypothesis import strategies as st

from python_backend_lib.audio.decode import decode_audio, decode_with_libsndfile
from python_backend_lib.audio.limits import AudioError
from python_backend_lib.audio.wav import pcm16_frames

AUDIO_DIR = Path(__file__).resolve().parents[1] / "data" / "audio"


def riff(*chunks: tuple[bytes, bytes]) -> bytes:
    """A RIFF/WAVE file of these (id, body) chunks, each padded to an even length."""
    body = b"".join(cid + len(data).to_bytes(4, "little") + data + b"\0" * (len(data) & 1) for cid, data in chunks)
    return b"RIFF" + (4 + len(body)).to_bytes(4, "little") + b"WAVE" + body


def fmt_chunk(channels: int, rate: int, bits: int = 16, tag: int = 1, extra: bytes = b"",
              block: int | None = None) -> tuple[bytes, bytes]:
    block = channels * bits // 8 if block is None else block
    fields = [(tag, 2), (channels, 2), (rate, 4), (rate * block, 4), (block, 2), (bits, 2)]
    return b"fmt ", b"".join(v.to_bytes(n, "little") for v, n in fields) + extra


def written(samples: np.ndarray, rate: int, subtype: str, format: str = "WAV") -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, subtype=subtype, format=format)
    return out.getvalue()


def assert_as_libsndfile(data: bytes) -> None:
    ours, theirs = pcm16_frames(data, None), decode_with_libsndfile(data, None)
    assert ours is not None and theirs is not None
    assert ours.sample_rate == theirs.sample_rate
    assert ours.samples.dtype == theirs.samples.dtype and ours.samples.shape == theirs.samples.shape
    assert np.array_equal(ours.samples, theirs.samples)


@settings(max_examples=60, deadline=None)
@given(
    frames=st.integers(1, 3000),
    channels=st.integers(1, 3),
    rate=st.sampled_from([8000, 16000, 22050, 44100, 48000]),
    before=st.binary(max_size=9),  # a chunk of odd or even length before the samples
    after=st.binary(max_size=5),
    fmt_extra=st.sampled_from([b"", b"\0\0"]),  # a fmt chunk of 16 or 18 bytes
    seed=st.integers(0, 2**31),
)
def test_any_layout_of_16_bit_pcm_reads_as_libsndfile_reads_it(frames, channels, rate, before, after, fmt_extra, seed):
    samples = np.random.default_rng(seed).integers(-32768, 32768, (frames, channels), dtype=np.int16)
    samples[0, 0] = -32768  # both ends of the scale
    samples[-1, -1] = 32767
    data = riff(fmt_chunk(channels, rate, extra=fmt_extra), (b"LIST", before), (b"data", samples.tobytes()),
                (b"junk", after))
    assert_as_libsndfile(data)


def test_the_test_recordings_decode_as_before():
    """Every WAV file the suite sends (16-bit PCM) takes the direct path, to the same waveform."""
    paths = sorted(AUDIO_DIR.glob("*.wav"))
    assert len(paths) >= 10
    for path in paths:
        data = path.read_bytes()
        assert_as_libsndfile(data)
        assert np.array_equal(decode_audio(data), decode_audio(written(soundfile.read(path)[0], 16000, "FLOAT")))


@pytest.mark.parametrize("subtype", ["PCM_24", "PCM_32", "FLOAT", "PCM_U8", "ULAW"])
def test_other_sample_formats_are_left_to_libsndfile(subtype):
    data = written(np.linspace(-0.5, 0.5, 800), 16000, subtype)
    assert pcm16_frames(data, None) is None
    assert decode_audio(data).shape == (800,)


def test_wave_format_extensible_and_other_containers_are_left_to_libsndfile():
    tone = np.linspace(-0.5, 0.5, 800)
    assert pcm16_frames(written(tone, 16000, "PCM_16", "WAVEX"), None) is None
    assert pcm16_frames(written(tone, 16000, "PCM_16", "FLAC"), None) is None
    assert pcm16_frames(written(tone, 16000, "PCM_16", "AIFF"), None) is None


def test_files_libsndfile_must_judge_are_left_to_it():
    """Damaged, empty, odd or too long: None, so that libsndfile's reading and errors decide."""
    pcm = np.arange(-400, 400, dtype=np.int16).tobytes()
    assert pcm16_frames(riff((b"data", pcm), fmt_chunk(1, 16000)), None) is None  # samples before their format
    assert pcm16_frames(riff(fmt_chunk(1, 16000), (b"data", b"")), None) is None  # no samples
    assert pcm16_frames(riff(fmt_chunk(1, 16000), (b"data", pcm + b"\1")), None) is None  # half a sample
    assert pcm16_frames(riff(fmt_chunk(2, 16000), (b"data", pcm[:-2])), None) is None  # half a frame
    assert pcm16_frames(riff(fmt_chunk(1, 16000), (b"data", pcm))[:-10], None) is None  # truncated
    assert pcm16_frames(riff(fmt_chunk(1, 500), (b"data", pcm)), None) is None  # a rate outside the bounds
    assert pcm16_frames(riff((b"fmt ", b"\1\0\1\0"), (b"data", pcm)), None) is None  # a short fmt chunk
    assert pcm16_frames(riff(fmt_chunk(1, 16000, block=4), (b"data", pcm)), None) is None  # a frame's size wrong
    assert pcm16_frames(riff(fmt_chunk(1, 16000), (b"data", pcm)), max_seconds=0.01) is None  # 0.05 s
    assert pcm16_frames(riff(fmt_chunk(1, 16000), (b"data", pcm)), max_seconds=0.05) is not None
    with pytest.raises(AudioError, match="audio is 0.1 s long; the limit is 0.01 s"):
        decode_audio(riff(fmt_chunk(1, 16000), (b"data", pcm * 2)), max_seconds=0.01)
