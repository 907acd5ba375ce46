"""vad_filter through the real server: a recording of clips with long, faintly noisy
silences between them comes back with the clips' words, nothing in the silences, and
every time on the recording's own timeline; through tritonclient, the gateway (the
openai client) and the CLI.

The clips' places in the recording are known exactly (it is built here), which is
the reference for the times; the clips' transcripts are the reference for the words.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import soundfile
import tritonclient.grpc
import tritonclient.utils
from long_recording import SAMPLE_RATE, Placed, Recording, TimedWord, find_clips, problems, word_error_rate
from reference import clips, normalize

from python_backend_lib.contract import tensor_names
from python_backend_lib.text.formats import Document

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# Clips and silences (seconds) in order: about 100 s, four fifths of it not speech.
PIECES = (8.0, "jfk.wav", 30.0, "sense_and_sensibility_01_austen_64kb-0870.wav", 25.0, "goforward.wav", 12.0)
# Faint noise, so that the silences are not digital zero (which whisper skips undecoded
# with or without the filter): about -50 dBFS.
NOISE_RMS = 0.003
# tiny.en on these three clips (measured through the server with vad_filter: 0.03).
MAX_WORD_ERROR_RATE = 0.1
MIN_SHARE = 0.8
# VAD pads each span by 400 ms; Whisper's segment and word times stray a little beyond the speech.
TOLERANCE_S = 1.0


def build_recording() -> Recording:
    by_name = {c.file: c for c in clips()}
    rng = np.random.default_rng(29)
    parts, placed, samples = [], [], 0
    for piece in PIECES:
        if isinstance(piece, str):
            waveform, rate = soundfile.read(by_name[piece].path, dtype="float32")
            assert rate == SAMPLE_RATE
            placed.append(Placed(by_name[piece], samples / SAMPLE_RATE, (samples + len(waveform)) / SAMPLE_RATE))
        else:
            waveform = (rng.standard_normal(round(piece * SAMPLE_RATE)) * NOISE_RMS).astype(np.float32)
        parts.append(waveform)
        samples += len(waveform)
    return Recording(np.concatenate(parts), tuple(placed))


@pytest.fixture(scope="module")
def recording() -> Recording:
    return build_recording()


def infer(server, audio: bytes, **parameters) -> str:
    client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    tensor = tritonclient.grpc.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[audio]], dtype=np.object_))
    outputs = [tritonclient.grpc.InferRequestedOutput(tensor_names.FORMATTED)]
    response = client.infer(tensor_names.ENSEMBLE_NAME, [tensor], outputs=outputs, parameters=parameters)
    return response.as_numpy(tensor_names.FORMATTED)[0, 0].decode()


def inside_a_clip(recording: Recording, start: float, end: float) -> bool:
    return any(p.start - TOLERANCE_S <= start and end <= p.end + TOLERANCE_S for p in recording.placed)


def check_transcript(recording: Recording, document: Document) -> None:
    assert document.duration == pytest.approx(recording.duration, abs=0.01)
    assert word_error_rate(normalize(document.text), recording.reference_words) <= MAX_WORD_ERROR_RATE, document.text
    # Nothing was invented in the silences: every segment (and word) lies within a clip.
    strays = [s for s in document.segments if not inside_a_clip(recording, s.start, s.end)]
    assert strays == [], strays
    strays = [w for w in document.words if not inside_a_clip(recording, w.start, w.end)]
    assert strays == [], strays
    timed = [TimedWord(word, w.start, w.end) for w in document.words for word in normalize(w.word)]
    if not timed:  # no word timestamps: each word with its segment's times
        timed = [TimedWord(word, s.start, s.end) for s in document.segments for word in normalize(s.text)]
    assert problems(find_clips(recording, timed), MIN_SHARE, TOLERANCE_S) == []


def test_tritonclient_with_words(server, recording):
    body = infer(server, recording.wav_bytes(), response_format="verbose_json", timestamps=True,
                 word_timestamps=True, vad_filter=True)
    document = Document.from_verbose_json(body)
    assert document.words
    check_transcript(recording, document)


def test_hallucination_silence_threshold_keeps_the_speech(server, recording):
    # The whole recording, silences and all, window after window with the rule on.
    body = infer(server, recording.wav_bytes(), response_format="verbose_json", word_timestamps=True,
                 hallucination_silence_threshold=2.0)
    document = Document.from_verbose_json(body)
    assert word_error_rate(normalize(document.text), recording.reference_words) <= MAX_WORD_ERROR_RATE, document.text
    # Without the filter segments start where Whisper's timestamp tokens put them, often
    # in the silence before speech; the words must still all be the clips'.
    strays = [w for w in document.words if not inside_a_clip(recording, w.start, w.end)]
    assert strays == [], strays


def test_vad_parameters_change_the_cut(server, recording):
    # A threshold no frame reaches: no speech at all, so an empty transcript of the whole duration.
    body = infer(server, recording.wav_bytes(), response_format="verbose_json", vad_filter=True,
                 vad_parameters=json.dumps({"threshold": 1.0, "min_silence_duration_ms": 500}))
    document = Document.from_verbose_json(body)
    assert document.text == "" and document.segments == ()
    assert document.duration == pytest.approx(recording.duration, abs=0.01)


@pytest.mark.parametrize(
    "parameters, named",
    [
        ({"vad_parameters": "{}"}, "vad_filter"),
        ({"vad_filter": True, "vad_parameters": '{"min_silence_ms": 100}'}, "min_silence_ms"),
        ({"vad_filter": True, "vad_parameters": '{"threshold": 2}'}, "threshold"),
        ({"hallucination_silence_threshold": 2.0}, "word_timestamps"),
    ],
)
def test_bad_vad_parameters_are_invalid_arguments(server, parameters, named):
    with pytest.raises(tritonclient.utils.InferenceServerException, match=named) as raised:
        infer(server, b"RIFF", **parameters)
    assert "INVALID_ARG" in str(raised.value.status())


def test_gateway_fields(gateway, recording):
    with openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0, timeout=600) as client:
        result = client.audio.transcriptions.create(
            model="whisper-1", file=("recording.wav", recording.wav_bytes()), response_format="verbose_json",
            extra_body={"vad_filter": "true", "vad_parameters": json.dumps({"speech_pad_ms": 300})},
        )
    check_transcript(recording, Document.from_verbose_json(result.model_dump_json(exclude_unset=True)))


def test_cli_flags(server, recording, tmp_path):
    audio = tmp_path / "recording.wav"
    audio.write_bytes(recording.wav_bytes())
    done = subprocess.run(
        ["whisper-triton", "transcribe", str(audio), "--url", server.http_url, "-f", "verbose_json",
         "--vad_filter", "--vad_parameters", '{"min_silence_duration_ms": 1000}'],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    check_transcript(recording, Document.from_verbose_json(done.stdout))
