"""The audio track of a media file, decoded by FFmpeg through PyAV (no torch).

libsndfile (`decode`) reads WAV, FLAC, Ogg and MP3, and reads them faster
(docs/media.md has the figures); the files it does not recognise come here:
what browsers record (WebM with Opus, MP4 with AAC), what phones save (M4A,
3GP, AMR, CAF) and video files. Only the audio stream's packets are decoded,
block by block, so a video track costs nothing and `max_seconds` stops a
decompression bomb soon after the limit.

PyAV's wheels ship their own FFmpeg libraries; PyAV is imported on the first
file that needs it, so a process that never sees one never loads FFmpeg.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from types import ModuleType

import numpy as np

from python_backend_lib.audio import limits
from python_backend_lib.audio.limits import AudioError

# The FFmpeg demuxers a request's bytes may reach, by FFmpeg's name, and what
# writes such files. Each reads one self-contained file: playlists and
# manifests (HLS, DASH, concat) are left out, since they would make FFmpeg
# open other files or URLs named inside the request.
DEMUXERS = {
    "mov": "MP4, M4A, MOV and 3GP: phones, Safari's MediaRecorder, cameras, most video files",
    "matroska": "WebM and MKV: Chrome's and Firefox's MediaRecorder, video files",
    "ogg": "Ogg that libsndfile cannot read: Ogg video, Speex, Ogg FLAC",
    "aac": "raw AAC (ADTS): Android recorders",
    "amr": "AMR: voice memos and old phones",
    "caf": "Core Audio Format with AAC or ALAC: Apple devices",
    "wav": "WAV with a codec libsndfile lacks",
    "aiff": "AIFF with a codec libsndfile lacks",
    "flac": "FLAC that libsndfile cannot read",
    "mp3": "MP3 that libsndfile does not recognise (unusual tags or headers)",
    "avi": "AVI video",
    "asf": "WMA and WMV",
    "flv": "Flash video",
    "mpegts": "MPEG transport streams (.ts): broadcast recordings, camcorders",
    "mpeg": "MPEG program streams (.mpg, .vob)",
}
# The demuxers whose header stores each track's exact length (MP4's sample
# tables). Elsewhere FFmpeg's stream duration may be a guess from the bit rate
# (raw AAC, MP3), which must not pass for a claim about the file.
DECLARED_LENGTH_DEMUXERS = ("mov",)
# A stream that declares this much more audio than decodes was cut short
# (codec delay and padding differ by a few milliseconds only).
TRUNCATION_TOLERANCE_S = 1.0
# av.open reads tags as UTF-8; a client's file may carry anything there.
METADATA_ERRORS = "replace"


@functools.cache
def _pyav() -> ModuleType:
    """PyAV, with FFmpeg's own logging off: a client's bad file must not write
    to the server's stderr (the AudioError carries the reason instead)."""
    try:
        import av
    except ImportError:
        raise AudioError(
            "not a decodable audio file: libsndfile does not recognise its format, and PyAV (the av "
            "package), which reads M4A, MP4, WebM and video files, is not installed on this server"
        ) from None
    av.logging.set_level(None)
    return av


def decode_container(data: bytes, max_seconds: float | None) -> limits.DecodedFrames:
    """Decode the best audio stream of a media file.

    Returns its samples [frames, channels] float32 at the stream's rate.
    Raises AudioError for bytes FFmpeg cannot read (or may not: DEMUXERS), a
    file with no audio stream, a damaged, truncated or too long stream, or one
    with too many channels or whose channels or rate change midway.
    """
    av = _pyav()
    try:
        container = av.open(
            limits.InMemoryFile(data),
            mode="r",
            options={"format_whitelist": ",".join(DEMUXERS)},
            metadata_errors=METADATA_ERRORS,
        )
    except av.error.FFmpegError as err:
        reason = _reason(err)
        raise AudioError(f"not a decodable audio file: no audio or video format FFmpeg reads ({reason})") from None
    with container:
        stream = _audio_stream(container)
        return _decode_stream(av, container, stream, max_seconds)


def _audio_stream(container):
    """FFmpeg's pick among the audio streams (the default one), else the first."""
    if container.streams.audio:
        # best() finds none when FFmpeg could not read the streams' parameters;
        # decoding the first then says what is wrong with it.
        return container.streams.best("audio") or container.streams.audio[0]
    kinds = sorted({stream.type for stream in container.streams})
    if "video" in kinds:
        raise AudioError("the file has no audio stream, only video: a video without sound")
    raise AudioError(f"the file has no audio stream ({f'only {kinds[0]}' if kinds else 'no streams at all'})")


def _decode_stream(av, container, stream, max_seconds: float | None) -> limits.DecodedFrames:
    """Decode packet by packet into [frames, channels] float32 blocks."""
    declared = _declared_seconds(container, stream)
    collected: _Collected | None = None  # made from the first frame, which shows what the stream really holds
    try:
        for packet in container.demux(stream):
            for frame in packet.decode():
                collected = collected or _Collected(frame, max_seconds, declared)
                collected.add(frame)
    except av.error.FFmpegError as err:
        raise AudioError(f"audio file is damaged or truncated: {_reason(err)}") from None
    if collected is None or collected.n_frames == 0:
        raise AudioError("audio decodes to zero samples")
    decoded = collected.n_frames / collected.sample_rate
    if declared is not None and decoded + TRUNCATION_TOLERANCE_S < declared:
        raise AudioError(
            "the file is truncated (or its header lies): its audio stream declares "
            f"{declared:.1f} s, only {decoded:.1f} s decode"
        )
    return limits.DecodedFrames(collected.samples(), collected.sample_rate)


class _Collected:
    """Decoded frames as [frames, channels] float32 blocks; refuses a frame
    unlike the first, and audio past `max_seconds` as soon as it passes it."""

    def __init__(self, first, max_seconds: float | None, declared_seconds: float | None) -> None:
        self.channels, self.sample_rate = first.layout.nb_channels, first.sample_rate
        _check_channels(self.channels)
        limits.check_sample_rate(self.sample_rate)
        self.max_seconds = max_seconds
        self.limit = limits.frame_limit(max_seconds, self.sample_rate)
        self.declared = None if declared_seconds is None else round(declared_seconds * self.sample_rate)
        self.frame_size = 0  # the longest frame: `add` sees the first one too
        self.blocks: list[np.ndarray] = []
        self.n_frames = 0

    def add(self, frame) -> None:
        if (frame.layout.nb_channels, frame.sample_rate) != (self.channels, self.sample_rate):
            raise AudioError(
                f"the audio stream changes midway from {self.channels} channel(s) at {self.sample_rate} Hz "
                f"to {frame.layout.nb_channels} at {frame.sample_rate} Hz"
            )
        self.blocks.append(_float32_frames(frame, self.channels))
        self.n_frames += frame.samples
        self.frame_size = max(self.frame_size, frame.samples)
        if self.n_frames > self.limit:
            raise limits.too_long(self.n_frames, self.declared, self.sample_rate, self.max_seconds)


    def samples(self) -> np.ndarray:
        """Every frame's samples, less the last frame's padding past the declared length.

        An AAC encoder fills its last frame of 1,024 samples with silence; MP4 and M4A
        record the true length, and FFmpeg trims the encoder's priming but decodes the
        padding. Kept, it made the file a few milliseconds longer than its WAV, and
        windows padded as openai-whisper pads them then read differently. More than a
        frame past the declared length is audio whose header lies: kept."""
        samples = np.concatenate(self.blocks)
        if self.declared is not None and 0 < self.n_frames - self.declared < self.frame_size:
            return samples[: self.declared]
        return samples


def _float32_frames(frame, channels: int) -> np.ndarray:
    """One decoded frame as [frames, channels] float32, integer samples scaled to [-1, 1)."""
    samples = frame.to_ndarray()
    # Planar formats come as [channels, frames]; packed ones as [1, frames * channels].
    samples = samples.T if frame.format.is_planar else samples.reshape(-1, channels)
    if samples.dtype == np.uint8:  # 8-bit audio is unsigned, centred on 128
        return (samples.astype(np.float32) - 128.0) / 128.0
    if np.issubdtype(samples.dtype, np.integer):
        return samples.astype(np.float32) / float(-np.iinfo(samples.dtype).min)
    return samples.astype(np.float32)


def _check_channels(channels: int) -> None:
    if not 1 <= channels <= limits.MAX_CHANNELS:
        raise AudioError(f"the audio stream has {channels} channels; at most {limits.MAX_CHANNELS} are accepted")


def _declared_seconds(container, stream) -> float | None:
    """How long the file's header says the stream is; None when it does not say."""
    if not set(container.format.name.split(",")) & set(DECLARED_LENGTH_DEMUXERS):
        return None
    if not stream.duration or stream.duration <= 0 or not stream.time_base:
        return None
    return float(stream.duration * Fraction(stream.time_base))


def _reason(err: Exception) -> str:
    # FFmpeg's words without PyAV's errno and the "'<none>'" file name it appends.
    return getattr(err, "strerror", None) or str(err)
