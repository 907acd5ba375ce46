"""Media files through FFmpeg (PyAV): what browsers, phones and cameras send.

The files are made here from the test clips by PyAV's own encoders
(tests/media.py); each must decode to the clip it was made from, to within
what its lossy codec changes. Files libsndfile reads stay with libsndfile,
which is faster (docs/media.md); bad media gets an AudioError naming the
problem, and FFmpeg writes nothing to stderr.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
import soxr
from media import KINDS, WITH_AUDIO, encode

from python_backend_lib.audio import containers
from python_backend_lib.audio.decode import AudioError, decode_audio, decode_with_libsndfile
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.geometry import SAMPLE_RATE

av = pytest.importorskip("av")

AUDIO_DIR = Path(__file__).resolve().parents[1] / "data" / "audio"
JFK, JFK_RATE = soundfile.read(AUDIO_DIR / "jfk.wav", dtype="float32")
# AAC and Opus at their encoders' default bit rates keep speech this far above
# the coding error (measured: 46 dB for AAC, 27 dB for Opus).
LOSSY_MIN_SNR_DB = 15.0
# Containers with no field for the encoder's delay (raw AAC, MPEG-TS, FLV, AVI,
# ASF) let the decoder output the encoder's priming: the audio starts up to
# this late (or early, for WMA). MP4, WebM and CAF record it, and start on time.
MAX_CODEC_DELAY_SAMPLES = 1152
# Codec framing pads the end too: AAC to 1,024 samples, AMR to 20 ms frames.
MAX_LENGTH_CHANGE_SAMPLES = 1024 + MAX_CODEC_DELAY_SAMPLES
# Telephone-band AMR keeps words, not waveforms; its fidelity is tested by transcript (test_media_served.py).
WAVEFORM_KINDS = tuple(kind for kind in WITH_AUDIO if kind != "3gp-amr")


def snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    n = min(len(reference), len(other))
    reference, other = reference[:n], other[:n]
    with np.errstate(divide="ignore"):  # lossless codecs: no error, infinite SNR
        return float(10 * np.log10(np.sum(reference**2) / np.sum((reference - other) ** 2)))


def delay(reference: np.ndarray, decoded: np.ndarray) -> int:
    """Samples by which `decoded` starts later than `reference` (cross-correlation peak)."""
    span = slice(SAMPLE_RATE, 3 * SAMPLE_RATE)
    correlation = np.correlate(decoded[span], reference[span], mode="full")
    return int(correlation.argmax()) - (span.stop - span.start - 1)


def aligned(reference: np.ndarray, decoded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lag = delay(reference, decoded)
    return (reference, decoded[lag:]) if lag >= 0 else (reference[-lag:], decoded)


def libsndfile_file(samples: np.ndarray, fmt: str, subtype: str | None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, JFK_RATE, format=fmt, subtype=subtype)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    """Each kind of media file, made from jfk.wav."""
    return {kind: encode(JFK, JFK_RATE, kind) for kind in KINDS}


# --- Decoding what libsndfile cannot --------------------------------------------


@pytest.mark.parametrize("kind", WITH_AUDIO)
def test_each_kind_decodes_to_the_clip_it_was_made_from(files, kind):
    waveform = decode_audio(files[kind])
    assert waveform.dtype == np.float32 and waveform.ndim == 1
    assert abs(len(waveform) - len(JFK)) <= MAX_LENGTH_CHANGE_SAMPLES
    assert abs(delay(JFK, waveform)) <= MAX_CODEC_DELAY_SAMPLES
    if kind in WAVEFORM_KINDS:
        assert snr_db(*aligned(JFK, waveform)) >= LOSSY_MIN_SNR_DB


@pytest.mark.parametrize("kind", ["m4a", "mp4-with-video", "3gp-amr"])
def test_a_file_that_declares_its_length_decodes_to_exactly_that_length(files, kind):
    """MP4, M4A and 3GP record the stream's length; the codec's last frame is padded
    past it (AAC to 1,024 samples, AMR to 160), and that padding is not audio: kept,
    it made the M4A 128 samples longer than its WAV."""
    assert len(decode_audio(files[kind])) == len(JFK)


@pytest.mark.parametrize("kind", ["m4a", "webm"])
def test_stereo_at_44_1_khz_is_mixed_and_resampled(kind):
    """Left and right differ in level; the mix is their mean, at 16 kHz."""
    stereo = soxr.resample(np.stack([JFK, 0.5 * JFK], axis=1), JFK_RATE, 44_100).astype(np.float32)
    waveform = decode_audio(encode(stereo, 44_100, kind))
    assert abs(len(waveform) - len(JFK)) <= MAX_LENGTH_CHANGE_SAMPLES
    assert snr_db(0.75 * JFK, waveform) >= LOSSY_MIN_SNR_DB


def test_an_8_khz_recording_is_resampled_to_16_khz(files):
    """AMR is 8 kHz telephone audio: 11 s of it become 11 s at 16 kHz."""
    assert abs(len(decode_audio(files["3gp-amr"])) / SAMPLE_RATE - len(JFK) / JFK_RATE) < 0.05


@pytest.mark.parametrize(
    ("fmt", "subtype"), [("WAV", "PCM_16"), ("FLAC", None), ("OGG", "VORBIS"), ("OGG", "OPUS"), ("MP3", None)]
)
def test_libsndfile_keeps_the_formats_it_reads(fmt, subtype):
    """It reads these faster than FFmpeg (docs/media.md): the waveform is
    libsndfile's own reading of the file, resampled by libsoxr, as before."""
    data = libsndfile_file(JFK, fmt, subtype)
    assert decode_with_libsndfile(data, None) is not None
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    expected = soxr.resample(samples, rate, SAMPLE_RATE, quality="HQ")
    # mpg123 rounds a sample differently (by 1e-7) when read in blocks rather than whole.
    np.testing.assert_allclose(decode_audio(data), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", WITH_AUDIO)
def test_media_files_go_to_ffmpeg(files, kind):
    assert decode_with_libsndfile(files[kind], None) is None


# --- Bad media --------------------------------------------------------------------


def test_a_video_without_sound_is_refused_by_name(files):
    with pytest.raises(AudioError, match="the file has no audio stream, only video: a video without sound"):
        decode_audio(files["mp4-video-only"])


@pytest.mark.parametrize("kind", ["m4a", "mp4-with-video", "m4a-index-first"])
def test_a_cut_short_mp4_is_refused(files, kind):
    data = files[kind]
    with pytest.raises(AudioError, match="not a decodable audio file|damaged or truncated"):
        decode_audio(data[: len(data) // 2])


def test_a_cut_short_webm_gives_what_arrived(files):
    """A live recording's WebM holds no length to check against (browsers write
    it as they record), so a cut file decodes as far as it goes."""
    data = files["webm"]
    waveform = decode_audio(data[: len(data) // 2])
    assert 0.3 * len(JFK) < len(waveform) < 0.7 * len(JFK)
    assert snr_db(JFK, waveform) >= LOSSY_MIN_SNR_DB


def test_an_mp4_whose_header_declares_more_than_follows_is_refused(files):
    """MP4 with its index first, as streaming writers put it, cut between two
    packets: what is left decodes cleanly, but the index says how long it was."""
    data = files["m4a-index-first"]
    with av.open(io.BytesIO(data)) as container:
        positions = [packet.pos for packet in container.demux(audio=0) if packet.pos is not None and packet.pos > 0]
    cut = data[: positions[len(positions) // 2]]
    with pytest.raises(AudioError, match=r"the file is truncated \(or its header lies\): its audio stream declares 11\.\d s, only 5\.\d s decode"):
        decode_audio(cut)


def test_max_seconds_stops_a_long_file_early():
    """Ten minutes of silence in AAC is a small file; decoding stops soon after the limit."""
    silence = np.zeros(600 * 8_000, np.float32)
    data = encode(silence, 8_000, "adts-aac")
    assert len(data) < 600_000
    began = time.perf_counter()
    with pytest.raises(AudioError, match=r"audio is at least 6\d\.\d s long; the limit is 60 s"):
        decode_audio(data, max_seconds=60)
    stopped_after = time.perf_counter() - began
    began = time.perf_counter()
    assert len(decode_audio(data)) == pytest.approx(600 * SAMPLE_RATE, abs=2 * MAX_LENGTH_CHANGE_SAMPLES)
    assert stopped_after < (time.perf_counter() - began) / 3


def test_an_mp4_that_declares_its_length_names_it_when_too_long(files):
    with pytest.raises(AudioError, match=r"audio is 11\.0 s long; the limit is 5 s"):
        decode_audio(files["m4a"], max_seconds=5)


@pytest.mark.parametrize(
    "data",
    [
        b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n",
        b"ffconcat version 1.0\nfile '/etc/passwd'\n",
        b"GIF89a" + bytes(range(256)) * 8,
    ],
    ids=["hls-playlist", "concat-script", "gif"],
)
def test_playlists_and_other_files_are_not_media(data):
    """Demuxers that would open other files named in the request are not allowed."""
    with pytest.raises(AudioError, match="not a decodable audio file"):
        decode_audio(data)


def test_audio_error_is_the_clients_mistake():
    assert issubclass(AudioError, RequestError)


def test_bad_media_writes_nothing_to_stderr(files, capfd):
    """FFmpeg prints its complaints to stderr unless PyAV's log callback is set:
    with FFmpeg's own callback the same files are noisy, after ours silent."""
    bad = [files["m4a"][:5000], files["webm"][: len(files["webm"]) // 3], files["mp4-video-only"][:-100]]
    bad += [b"\x1aE\xdf\xa3" + bytes(range(256)) * 4, b"\x00\x00\x00\x18ftypM4A " + bytes(1000)]
    av.logging.restore_default_callback()
    for data in bad:
        with contextlib.suppress(av.error.FFmpegError), av.open(io.BytesIO(data)) as container:
            for packet in container.demux():
                packet.decode()
    assert capfd.readouterr().err, "FFmpeg's default callback writes nothing for these files: a weak test"
    containers._pyav.cache_clear()  # the decoder sets its log callback again on first use
    for data in bad:
        with contextlib.suppress(AudioError):  # the cut WebM decodes as far as it goes
            decode_audio(data)
    assert capfd.readouterr().err == ""


def test_without_pyav_the_error_names_it(files, monkeypatch):
    """A host without the `av` package (the offline GPU bundle) still reads what
    libsndfile reads, and says what the other formats need."""
    monkeypatch.setitem(sys.modules, "av", None)
    containers._pyav.cache_clear()
    try:
        with pytest.raises(AudioError, match="PyAV \\(the av package\\).* is not installed"):
            decode_audio(files["m4a"])
        assert decode_audio(libsndfile_file(JFK, "FLAC", None)).size == len(JFK)
    finally:
        containers._pyav.cache_clear()
