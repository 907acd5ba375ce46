"""Locust users that send the test clips to Triton's `transcribe` model, and live sessions.

Two users, one per protocol, each with its own tritonclient connection:
`GrpcTranscribeUser` (request type "grpc") and `HttpTranscribeUser` ("http");
`LiveUser` ("live") streams clips to the gateway's live sessions instead
(`loadtest.live_user`).
Each picks a clip at random from `tests/data/audio/manifest.tsv`, sends it as
one [1, 1] BYTES request, and reports the request to locust under the name
"transcribe <length class>" (<5s, 5-30s, >30s). A request fails when Triton
returns an error or when a speech clip comes back without text.

    locust -f loadtest/locustfile.py --triton-http localhost:8000 --triton-grpc localhost:8001
    python -m loadtest.run --help        # a bounded headless run with reports

Options (also as environment variables): --triton-http (LOCUST_TRITON_HTTP),
--triton-grpc (LOCUST_TRITON_GRPC), --audio-dir (LOCUST_AUDIO_DIR),
--max-clip-seconds (LOCUST_MAX_CLIP_SECONDS), --request-timeout
(LOCUST_REQUEST_TIMEOUT), --summary-json (LOCUST_SUMMARY_JSON), --gateway-url
(LOCUST_GATEWAY_URL, for the live users).
"""

from __future__ import annotations

import json
import random
import sys
import time
from functools import lru_cache
from pathlib import Path

import grpc.experimental.gevent as grpc_gevent
import numpy as np
import tritonclient.grpc
import tritonclient.http

# locust first: it patches the standard library for gevent on import.
from locust import User, between, events, task
from tritonclient.utils import InferenceServerException

# grpcio blocks gevent's loop unless told to cooperate; this must run before
# the first channel is made.
grpc_gevent.init_gevent()

# Run as `locust -f loadtest/locustfile.py`, the repository root is not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.api_key import API_KEY_ENV  # noqa: E402
from loadtest.clips import DEFAULT_AUDIO_DIR, Clip, RequestStats, Summary, load_clips, request_name  # noqa: E402
from loadtest.live_user import LiveTranscriptionUser  # noqa: E402
from loadtest.outcomes import Verdict, judge  # noqa: E402
from python_backend_lib.contract import tensor_names  # noqa: E402

DEFAULT_HTTP_URL = "localhost:8000"
DEFAULT_GRPC_URL = "localhost:8001"
DEFAULT_GATEWAY_URL = "http://localhost:9000/v1"
DEFAULT_MAX_CLIP_S = 60.0
DEFAULT_REQUEST_TIMEOUT_S = 120.0


class BadTranscript(Exception):
    """Triton answered, but not with what a transcript must be."""


class Refused(Exception):
    """The server refused the request as overloaded (`loadtest.outcomes`): retry later."""


class TritonError(Exception):
    """Triton (or the connection to it) failed the request otherwise; the message
    gives its status and says how. tritonclient's own exception shows no message in
    locust's error report.
    """


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    group = parser.add_argument_group("whisper-triton")
    group.add_argument("--triton-http", env_var="LOCUST_TRITON_HTTP", default=DEFAULT_HTTP_URL,
                       help="Triton's HTTP address, host:port")
    group.add_argument("--triton-grpc", env_var="LOCUST_TRITON_GRPC", default=DEFAULT_GRPC_URL,
                       help="Triton's gRPC address, host:port")
    group.add_argument("--gateway-url", env_var="LOCUST_GATEWAY_URL", default=DEFAULT_GATEWAY_URL,
                       help="the gateway's base URL, for the live users")
    group.add_argument("--audio-dir", env_var="LOCUST_AUDIO_DIR", default=str(DEFAULT_AUDIO_DIR),
                       help="folder with the clips and their manifest.tsv")
    group.add_argument("--max-clip-seconds", env_var="LOCUST_MAX_CLIP_SECONDS", type=float,
                       default=DEFAULT_MAX_CLIP_S, help="leave out longer clips")
    group.add_argument("--request-timeout", env_var="LOCUST_REQUEST_TIMEOUT", type=float,
                       default=DEFAULT_REQUEST_TIMEOUT_S, help="seconds before a request counts as failed")
    group.add_argument("--summary-json", env_var="LOCUST_SUMMARY_JSON", default="",
                       help="write the final numbers here as JSON when locust quits")
    group.add_argument("--api-key", env_var=API_KEY_ENV, default="",
                       help="the gateway's API key, for the live users (as `whisper-triton gateway --api-key`)")


def summarize(stats) -> Summary:
    """Our summary of locust's final `RequestStats`."""

    def row(entry) -> RequestStats:
        return RequestStats(
            request_type=entry.method or "",
            name=entry.name,
            requests=entry.num_requests,
            failures=entry.num_failures,
            median_ms=float(entry.median_response_time or 0),
            p95_ms=float(entry.get_response_time_percentile(0.95) or 0),
            requests_per_s=float(entry.total_rps),
        )

    entries = sorted(stats.entries.values(), key=lambda e: (e.method, e.name))
    errors = tuple(f"{e.occurrences} x {e.method} {e.name}: {e.error}" for e in stats.errors.values())
    return Summary(rows=tuple(row(e) for e in entries), total=row(stats.total), errors=errors)


@events.init.add_listener
def write_summary_on_quit(environment, **_kwargs) -> None:
    """Locust's CSV files are rewritten once a second and may miss the last requests; this is final."""
    path = getattr(environment.parsed_options, "summary_json", "")
    if not path:
        return

    def write(**_quit_kwargs) -> None:
        Path(path).write_text(summarize(environment.stats).to_json() + "\n", encoding="utf-8")

    environment.events.quit.add_listener(write)


@lru_cache(maxsize=None)
def clips_from(audio_dir: str, max_clip_seconds: float) -> tuple[Clip, ...]:
    """Read the clips once per process; every user shares the same immutable tuple."""
    return load_clips(Path(audio_dir), max_clip_seconds)


def check_transcript(clip: Clip, text: bytes, segments: bytes) -> None:
    """Raise BadTranscript unless the outputs are a transcript of this clip."""
    if clip.is_speech and not text.decode("utf-8").strip():
        raise BadTranscript(f"empty TEXT for {clip.name}, which has speech")
    if not isinstance(json.loads(segments), list):
        raise BadTranscript(f"SEGMENTS for {clip.name} is not a JSON list")


class TranscribeUser(User):
    """Send one clip after another; subclasses pick the protocol."""

    abstract = True
    request_type: str
    wait_time = between(0.0, 0.5)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.clips = clips_from(options.audio_dir, options.max_clip_seconds)
        self.client = self.connect(options)

    def on_stop(self) -> None:
        self.client.close()

    def connect(self, options):
        raise NotImplementedError

    def infer(self, audio: np.ndarray) -> tuple[bytes, bytes]:
        """One request to the ensemble; returns (TEXT, SEGMENTS) of its one row."""
        raise NotImplementedError

    @task
    def transcribe(self) -> None:
        clip = random.choice(self.clips)
        audio = np.array([[clip.audio]], dtype=np.object_)  # [batch 1, 1 file]
        started = time.perf_counter()
        response_length, exception = 0, None
        try:
            text, segments = self.infer(audio)
            response_length = len(text) + len(segments)
            check_transcript(clip, text, segments)
        except InferenceServerException as error:
            judged = judge(error)
            exception = (Refused if judged.verdict is Verdict.REFUSED else TritonError)(judged.reason)
        except Exception as error:  # every failure is reported to locust, not raised
            exception = error
        self.environment.events.request.fire(
            request_type=self.request_type,
            name=request_name(clip),
            response_time=(time.perf_counter() - started) * 1000.0,
            response_length=response_length,
            exception=exception,
            context={"clip": clip.name},
        )


def first_row(result, name: str) -> bytes:
    return result.as_numpy(name).reshape(-1)[0]


class GrpcTranscribeUser(TranscribeUser):
    request_type = "grpc"

    def connect(self, options):
        self.timeout_s = options.request_timeout
        return tritonclient.grpc.InferenceServerClient(options.triton_grpc)

    def infer(self, audio: np.ndarray) -> tuple[bytes, bytes]:
        audio_input = tritonclient.grpc.InferInput(tensor_names.AUDIO, list(audio.shape), "BYTES")
        audio_input.set_data_from_numpy(audio)
        outputs = [tritonclient.grpc.InferRequestedOutput(n) for n in (tensor_names.TEXT, tensor_names.SEGMENTS)]
        result = self.client.infer(
            tensor_names.ENSEMBLE_NAME, [audio_input], outputs=outputs, client_timeout=self.timeout_s
        )
        return first_row(result, tensor_names.TEXT), first_row(result, tensor_names.SEGMENTS)


class HttpTranscribeUser(TranscribeUser):
    request_type = "http"

    def connect(self, options):
        return tritonclient.http.InferenceServerClient(
            options.triton_http, connection_timeout=options.request_timeout, network_timeout=options.request_timeout
        )

    def infer(self, audio: np.ndarray) -> tuple[bytes, bytes]:
        audio_input = tritonclient.http.InferInput(tensor_names.AUDIO, list(audio.shape), "BYTES")
        audio_input.set_data_from_numpy(audio, binary_data=True)
        outputs = [
            tritonclient.http.InferRequestedOutput(n, binary_data=True) for n in (tensor_names.TEXT, tensor_names.SEGMENTS)
        ]
        result = self.client.infer(tensor_names.ENSEMBLE_NAME, [audio_input], outputs=outputs)
        return first_row(result, tensor_names.TEXT), first_row(result, tensor_names.SEGMENTS)


class LiveUser(LiveTranscriptionUser):
    def clips(self) -> tuple[Clip, ...]:
        options = self.environment.parsed_options
        return clips_from(options.audio_dir, options.max_clip_seconds)
