"""Media files through the real server: M4A, MP4 with video, WebM (with and
without video), AMR and raw AAC over HTTP and gRPC, and through the gateway with
the official openai client. (tests/unit/test_media.py decodes more kinds, unserved.)

Each file is made from jfk.wav (tests/media.py) and must be transcribed exactly
as the WAV is. Some differ from the WAV by their coding: AMR, telephone-band
speech at 8 kHz, changes a few words; raw AAC starts 64 ms late (its encoder's
priming, which no header records), which moves the timestamps; and AAC's coding
noise in M4A and MP4 ends the text with a full stop that the WAV's lacks,
once windows are padded as openai-whisper pads them (with transformers' padding
both read alike). Their transcripts must equal the library's on the same file
instead, and stay close to the WAV's. A video without sound, or a cut file, is refused naming the
problem, and FFmpeg writes nothing to the server's log.
"""

from __future__ import annotations

import numpy as np
import pytest
import soundfile
from conftest import AUDIO_DIR
from media import encode
from reference import normalize, word_error_rate

from clients.api import TranscriptionError, WhisperClient

openai = pytest.importorskip("openai")
pytest.importorskip("av")

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

PROTOCOLS = ("http", "grpc")
SERVED_KINDS = ("m4a", "mp4-with-video", "webm", "webm-with-video", "3gp-amr", "adts-aac")
JFK = AUDIO_DIR / "jfk.wav"
# The kinds whose coding changes what tiny.en hears: "America asked" for
# "Americans ask" (AMR), segment times (raw AAC's priming), a final full stop (AAC in M4A, MP4).
DIFFER_FROM_THE_WAV = {"3gp-amr", "adts-aac", "m4a", "mp4-with-video"}
MAX_WORD_ERROR_RATE_LOSSY = 0.2  # measured: 0.09 (2 of 22 words) for AMR, 0 for raw AAC
# FFmpeg's log lines start with its component's name and address: "[mov,mp4,... @ 0x55d9...]".
FFMPEG_LOG_MARK = " @ 0x"
# The gateway's browsers and phones: a file name and the bytes.
GATEWAY_KINDS = ("m4a", "webm", "mp4-with-video")


@pytest.fixture(scope="module")
def media() -> dict[str, bytes]:
    samples, rate = soundfile.read(JFK, dtype="float32")
    return {kind: encode(samples, rate, kind) for kind in (*SERVED_KINDS, "mp4-video-only")}


@pytest.fixture(scope="module")
def wav_result(server):
    with WhisperClient(server.grpc_url, "grpc") as client:
        return client.transcribe(JFK, timestamps=True)


@pytest.fixture(scope="module")
def library():
    """The library's transcript of the same bytes (for codecs that change words), once per file."""
    from python_backend_lib.core.options import DecodingOptions
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load("default")
    transcripts = {}

    def transcript(data: bytes):
        if data not in transcripts:
            transcripts[data] = pipeline.transcribe(data, DecodingOptions(timestamps=True))
        return transcripts[data]

    yield transcript
    pipeline.close()


# Each kind through one protocol, the two alternating: the protocol carries the file's
# bytes, which only preprocessing opens (the bad media below go through both).
SERVED_CASES = [pytest.param(kind, PROTOCOLS[index % 2], id=f"{kind}-{PROTOCOLS[index % 2]}")
                for index, kind in enumerate(SERVED_KINDS)]  # fmt: skip


@pytest.mark.parametrize("kind, protocol", SERVED_CASES)
def test_a_media_file_is_transcribed_as_its_wav(server, media, wav_result, library, kind, protocol):
    with WhisperClient(server.url(protocol), protocol) as client:
        result = client.transcribe(media[kind], timestamps=True)
    if kind not in DIFFER_FROM_THE_WAV:
        assert result == wav_result
        return
    expected = library(media[kind])
    assert result.text == expected.text
    assert [(s.start, s.end, s.text) for s in result.segments] == [(s.start, s.end, s.text) for s in expected.segments]
    assert result != wav_result  # else it belongs with the others
    assert word_error_rate(normalize(result.text), normalize(wav_result.text)) <= MAX_WORD_ERROR_RATE_LOSSY


def test_stereo_m4a_at_44_1_khz_is_transcribed_as_the_wav(server, wav_result):
    import soxr

    samples, rate = soundfile.read(JFK, dtype="float32")
    stereo = soxr.resample(np.stack([samples, samples], axis=1), rate, 44_100).astype(np.float32)
    with WhisperClient(server.http_url) as client:
        assert client.transcribe(encode(stereo, 44_100, "m4a"), timestamps=True).text == wav_result.text


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_media_is_refused_naming_the_problem_and_ffmpeg_stays_quiet(server, media, protocol):
    log_before = server.log.read_text(errors="replace")
    cases = {
        "mp4-video-only": "the file has no audio stream, only video: a video without sound",
        "m4a": "not a decodable audio file",  # cut before its index
    }
    for kind, message in cases.items():
        data = media[kind] if kind == "mp4-video-only" else media[kind][:4000]
        with WhisperClient(server.url(protocol), protocol) as client, pytest.raises(TranscriptionError) as caught:
            client.transcribe(data)
        assert message in str(caught.value)
        assert "Traceback" not in str(caught.value)
    new_log = server.log.read_text(errors="replace")[len(log_before) :]
    assert FFMPEG_LOG_MARK not in new_log, new_log


@pytest.fixture(scope="module")
def client(gateway: str):
    with openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0) as openai_client:
        yield openai_client


def through_gateway(client, name: str, data: bytes):
    return client.audio.transcriptions.create(model="whisper-1", file=(name, data), response_format="verbose_json")


@pytest.mark.parametrize("kind", GATEWAY_KINDS)
def test_the_gateway_takes_what_browsers_and_phones_record(client, media, library, kind):
    name = "recording." + ("mp4" if kind.startswith("mp4") else kind)
    result = through_gateway(client, name, media[kind])
    wav = through_gateway(client, JFK.name, JFK.read_bytes())
    expected = library(media[kind]) if kind in DIFFER_FROM_THE_WAV else wav
    assert result.text == expected.text and wav.text
    assert [(s.start, s.end, s.text) for s in result.segments] == [
        (s.start, s.end, s.text) for s in expected.segments
    ]
    assert word_error_rate(normalize(result.text), normalize(wav.text)) <= MAX_WORD_ERROR_RATE_LOSSY


def test_the_gateway_refuses_a_video_without_sound(client, media):
    with pytest.raises(openai.BadRequestError, match="no audio stream, only video"):
        client.audio.transcriptions.create(model="whisper-1", file=("clip.mp4", media["mp4-video-only"]))
