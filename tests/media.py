"""Media files made here from the test clips, by PyAV's own encoders (FFmpeg is not installed).

Each kind is what a browser, a phone or a camera would send: AAC in M4A, AAC
beside a video track in MP4, Opus in WebM (what Chrome and Firefox record),
VP8 video with Opus in WebM, AMR in 3GP (old phones), raw AAC (Android
recorders), and a video with no sound at all.
Encoding is deterministic, so the files are the same on every run.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

VIDEO_SIZE = (64, 48)  # pixels; as small as the encoders allow, the video is not what is tested
VIDEO_RATE = 10  # frames per second


@dataclass(frozen=True)
class Kind:
    """One kind of media file: a container, an audio codec, maybe a video codec."""

    name: str
    container: str  # FFmpeg's muxer name
    audio_codec: str | None
    video_codec: str | None = None
    audio_rate: int | None = None  # resample to this rate first (Opus encodes 48 kHz only)
    audio_format: str = "fltp"  # the sample format the encoder takes
    bit_rate: int | None = None  # bits per second, for encoders that have no default
    index_first: bool = False  # MP4's index (moov) before the packets, as streaming writers put it


KINDS = {
    kind.name: kind
    for kind in (
        Kind("m4a", "ipod", "aac"),
        Kind("m4a-index-first", "ipod", "aac", index_first=True),
        Kind("mp4-with-video", "mp4", "aac", video_codec="mpeg4"),
        Kind("webm", "webm", "libopus", audio_rate=48_000, audio_format="s16"),
        Kind("webm-with-video", "webm", "libopus", video_codec="libvpx", audio_rate=48_000, audio_format="s16"),
        Kind("3gp-amr", "3gp", "libopencore_amrnb", audio_rate=8_000, audio_format="s16"),  # mono only
        Kind("adts-aac", "adts", "aac"),
        Kind("mov", "mov", "aac", video_codec="mpeg4"),
        Kind("mkv-flac", "matroska", "flac", audio_format="s16"),
        Kind("caf-alac", "caf", "alac", audio_format="s16p"),
        Kind("wma", "asf", "wmav2", bit_rate=64_000),
        Kind("avi-mp3", "avi", "libmp3lame", video_codec="mpeg4"),
        Kind("mpegts", "mpegts", "aac", video_codec="mpeg4"),
        Kind("flv", "flv", "aac", video_codec="flv"),
        Kind("mp4-video-only", "mp4", None, video_codec="mpeg4"),
    )
}
# The kinds a client's recording comes in, each with sound.
WITH_AUDIO = tuple(name for name, kind in KINDS.items() if kind.audio_codec)


def encode(samples: np.ndarray, rate: int, kind: str) -> bytes:
    """samples: float32 [frames] or [frames, channels] at `rate`; returns the file's bytes."""
    import av

    spec = KINDS[kind]
    samples = samples.reshape(len(samples), -1).astype(np.float32)
    # Moving the index to the front rewrites the file, which the muxer does on disk only.
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "media"
        options = {"movflags": "+faststart"} if spec.index_first else {}
        with av.open(str(path), mode="w", format=spec.container, options=options) as output:
            _encode_streams(av, output, spec, samples, rate)
        return path.read_bytes()


def _encode_streams(av, output, spec: Kind, samples: np.ndarray, rate: int) -> None:
    audio = video = None
    if spec.audio_codec:
        audio = output.add_stream(spec.audio_codec, rate=spec.audio_rate or rate, layout=_layout(samples.shape[1]))
        if spec.bit_rate:
            audio.bit_rate = spec.bit_rate
    if spec.video_codec:
        video = output.add_stream(spec.video_codec, rate=VIDEO_RATE)
        video.width, video.height = VIDEO_SIZE
        video.pix_fmt = "yuv420p"
        video.options = {"deadline": "realtime", "cpu-used": "8"} if spec.video_codec == "libvpx" else {}
    if audio is not None:
        _encode_audio(av, output, audio, samples, rate, spec)
    if video is not None:
        _encode_video(av, output, video, len(samples) / rate)


def _layout(channels: int) -> str:
    return {1: "mono", 2: "stereo"}[channels]


def _encode_audio(av, output, stream, samples: np.ndarray, rate: int, spec: Kind) -> None:
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples.T), format="fltp", layout=_layout(samples.shape[1]))
    frame.sample_rate, frame.pts, frame.time_base = rate, 0, Fraction(1, rate)
    resampler = av.AudioResampler(format=spec.audio_format, layout=frame.layout, rate=stream.rate, frame_size=1024)
    for piece in [*resampler.resample(frame), *resampler.resample(None)]:
        output.mux(stream.encode(piece))
    output.mux(stream.encode(None))


def _encode_video(av, output, stream, seconds: float) -> None:
    width, height = VIDEO_SIZE
    for index in range(max(1, round(seconds * VIDEO_RATE))):
        picture = np.full((height, width, 3), index % 256, dtype=np.uint8)  # a grey that brightens
        output.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
    output.mux(stream.encode(None))


# ----------------------------------------------------------------- the figures


def measure(repeats: int = 15) -> None:
    """Decoding speed of each format by each decoder that reads it (numpy reads only
    16-bit PCM WAV, `audio.wav`), on the 53 s
    sonnet: the median of `repeats` decodes to Whisper's 16 kHz mono waveform
    (Opus decodes at 48 kHz in FFmpeg, at the file's rate in libsndfile, so
    resampling is counted). For docs/media.md."""
    import statistics
    import sys
    import time
    from pathlib import Path

    import soundfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from python_backend_lib.audio.containers import decode_container
    from python_backend_lib.audio.decode import decode_with_libsndfile, resample, to_mono
    from python_backend_lib.audio.wav import pcm16_frames

    path = Path(__file__).parent / "data" / "audio" / "sonnet1_longform.wav"
    samples, rate = soundfile.read(path, dtype="float32")
    files = {}
    for name, fmt, subtype in [
        ("WAV (16-bit)", "WAV", "PCM_16"),
        ("FLAC", "FLAC", None),
        ("Ogg Vorbis", "OGG", "VORBIS"),
        ("Ogg Opus", "OGG", "OPUS"),
        ("MP3", "MP3", None),
    ]:
        buffer = io.BytesIO()
        soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
        files[name] = buffer.getvalue()
    files.update({kind: encode(samples, rate, kind) for kind in WITH_AUDIO})

    def seconds(decode, data: bytes) -> float:
        began = time.perf_counter()
        decoded = decode(data, None)
        resample(to_mono(decoded.samples), decoded.sample_rate)
        return time.perf_counter() - began

    decoders = {"numpy, 16-bit WAV (ms)": pcm16_frames, "libsndfile (ms)": decode_with_libsndfile,
                "FFmpeg through PyAV (ms)": decode_container}
    print(f"{len(samples) / rate:.0f} s of speech, median of {repeats} decodes (ms), the decoders taking turns")
    print(f"| format | size (kB) | {' | '.join(decoders)} |")
    print("| --- | --- |" + " --- |" * len(decoders))
    for name, data in files.items():
        readers = {label: decode for label, decode in decoders.items() if decode(data, None) is not None}
        times: dict[str, list[float]] = {label: [] for label in readers}
        for _ in range(repeats):
            for label, decode in readers.items():
                times[label].append(seconds(decode, data))
        cells = [f"{statistics.median(times[label]) * 1000:.1f}" if label in times else "-" for label in decoders]
        print(f"| {name} | {len(data) / 1000:.0f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    measure()
