"""Fuzzing the audio decoder with hypothesis: random bytes and mutated real files.

Whatever the bytes, `decode_audio` and `pcm_to_waveform` must either return a
finite float32 mono waveform or raise `AudioError`; never another exception,
never a crash, never a hang. Both decoders are fuzzed: libsndfile (WAV, FLAC,
Ogg, MP3, AIFF) and FFmpeg (M4A, MP4 with video, WebM, AMR, raw AAC, and
random bytes behind the signatures of the containers FFmpeg reads). Each property runs a bounded number of examples
under a per-example deadline; the whole file takes well under a minute.
(`test_audio.py::test_random_and_corrupted_bytes_never_hang` adds a fixed-seed
sweep under a watchdog thread.)
"""

from __future__ import annotations

import io
from datetime import timedelta

import numpy as np
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from media import WITH_AUDIO, encode

from python_backend_lib.audio.decode import AudioError, decode_audio, pcm_to_waveform

# An exception inside soundfile's C callbacks is only printed (to the server's log):
# count it as a failure.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")

MAX_SECONDS = 60.0  # as a server would limit it: a header claiming hours must not cost hours
FUZZ = settings(
    max_examples=300,
    deadline=timedelta(seconds=5),  # one decode of a few kB; a hang shows up as a deadline failure
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,  # the same examples on every run: a failure is reproducible in CI
)


def _tone_file(fmt: str, subtype: str | None, rate: int = 16_000, channels: int = 1) -> bytes:
    t = np.arange(rate // 2) / rate  # half a second
    samples = 0.3 * np.sin(2 * np.pi * 440 * t)[:, None].repeat(channels, axis=1).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


LIBSNDFILE_SEED_FILES = {
    name: _tone_file(*spec)
    for name, spec in {
        "wav16": ("WAV", "PCM_16"),
        "wav-float-stereo": ("WAV", "FLOAT", 44_100, 2),
        "wav24-8k": ("WAV", "PCM_24", 8_000),
        "flac": ("FLAC", None),
        "ogg": ("OGG", "VORBIS"),
        "mp3": ("MP3", None),
        "aiff": ("AIFF", "PCM_16"),
    }.items()
    if spec[0] in soundfile.available_formats()
}


# What media files made by tests/media.py start from: a quarter of a second of a tone.
MEDIA_SEED_FILES = {
    name: encode(0.3 * np.sin(2 * np.pi * 440 * np.arange(4_000, dtype=np.float32) / 16_000), 16_000, name)
    for name in WITH_AUDIO
}
SEED_FILES = {**LIBSNDFILE_SEED_FILES, **MEDIA_SEED_FILES}
# The first bytes by which FFmpeg's demuxers recognise their containers.
MEDIA_SIGNATURES = [
    b"\x00\x00\x00\x18ftypM4A \x00\x00\x02\x00",  # MP4 / M4A
    b"\x00\x00\x00\x1cftypisom\x00\x00\x02\x00isomiso2mp41\x00\x00\x00\x08free",
    b"\x1aE\xdf\xa3\x9fB\x86\x81\x01B\xf7\x81\x01B\xf2\x81\x04B\xf3\x81\x08B\x82\x84webm",  # WebM (EBML)
    b"RIFF\x00\x10\x00\x00AVI LIST",  # AVI
    b"0&\xb2u\x8ef\xcf\x11\xa6\xd9\x00\xaa\x00b\xcel",  # ASF (WMA, WMV)
    b"FLV\x01\x05\x00\x00\x00\x09",
    b"caff\x00\x01\x00\x00desc",
    b"#!AMR\n",
    b"\xff\xf1\x50\x80",  # ADTS AAC
    b"\x47\x40\x00\x10",  # MPEG-TS
    b"\x00\x00\x01\xba",  # MPEG-PS
    b"#EXTM3U\n",  # a playlist: must be refused, never followed
]


def _check(decode, data: bytes, **kwargs) -> None:
    try:
        waveform = decode(data, **kwargs)
    except AudioError:
        return
    assert waveform.dtype == np.float32 and waveform.ndim == 1 and waveform.size > 0
    assert np.isfinite(waveform).all()


@st.composite
def mutated(draw, names: list[str] | None = None) -> bytes:
    """A real file (one of `names`, else any) with a few bytes overwritten,
    inserted or removed, or cut short."""
    data = bytearray(SEED_FILES[draw(st.sampled_from(names or sorted(SEED_FILES)))])
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["overwrite", "insert", "delete", "truncate", "header"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "overwrite" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 64))]
        elif kind == "truncate":
            del data[at:]
        else:  # the header's sizes, rates and counts are where lies hurt most
            at = draw(st.integers(0, min(64, max(len(data) - 4, 0))))
            data[at : at + 4] = draw(st.binary(min_size=4, max_size=4))
    return bytes(data)


@FUZZ
@given(data=st.binary(max_size=4096))
def test_random_bytes(data):
    _check(decode_audio, data, max_seconds=MAX_SECONDS)


@FUZZ
@given(magic=st.sampled_from([b"RIFF", b"RIFF\x24\x00\x00\x00WAVEfmt ", b"fLaC", b"OggS", b"ID3", b"\xff\xfb", b"FORM"]),
       tail=st.binary(max_size=2048))
def test_random_bytes_behind_a_format_signature(magic, tail):
    _check(decode_audio, magic + tail, max_seconds=MAX_SECONDS)


@FUZZ
@given(magic=st.sampled_from(MEDIA_SIGNATURES), tail=st.binary(max_size=2048))
def test_random_bytes_behind_a_media_container_signature(magic, tail):
    _check(decode_audio, magic + tail, max_seconds=MAX_SECONDS)


@settings(FUZZ, max_examples=1500)  # the codecs themselves: most of the fuzzing budget
@given(data=mutated())
def test_mutated_files(data):
    _check(decode_audio, data, max_seconds=MAX_SECONDS)


@settings(FUZZ, max_examples=1000)
@given(data=mutated(sorted(MEDIA_SEED_FILES)))
def test_mutated_media_files(data):
    _check(decode_audio, data, max_seconds=MAX_SECONDS)


@FUZZ
@given(data=st.binary(max_size=4096), rate=st.integers(-10, 500_000), channels=st.integers(-1, 40))
def test_raw_pcm_with_any_rate_and_channel_count(data, rate, channels):
    _check(pcm_to_waveform, data, sample_rate=rate, channels=channels, max_seconds=MAX_SECONDS)


@pytest.mark.parametrize("name", sorted(SEED_FILES))
def test_the_seed_files_decode(name):
    """The mutations start from files that decode."""
    assert decode_audio(SEED_FILES[name]).size > 0
