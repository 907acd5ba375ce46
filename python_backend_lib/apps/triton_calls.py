"""Transcribing audio through Triton's `transcribe` ensemble from the gateway, and
cancelling a request there by its id: what the live sessions and the gateway's
abandoned requests share."""

from __future__ import annotations

import asyncio
import io
import logging
import wave
from typing import TYPE_CHECKING

import numpy as np

from clients.api import CANCEL_INPUTS, new_request_id
from python_backend_lib.apps.openai_api import AudioRequest
from python_backend_lib.core.geometry import SAMPLE_RATE
from python_backend_lib.core.options import Task
from python_backend_lib.serving import tensor_names
from python_backend_lib.serving.parameters import CANCEL_KEY
from python_backend_lib.text.formats import ResponseFormat

if TYPE_CHECKING:
    import tritonclient.grpc.aio

CANCEL_TIMEOUT_S = 5.0  # how long the cancel of a request whose client left may take

log = logging.getLogger(__name__)


async def cancel(client: tritonclient.grpc.aio.InferenceServerClient, request_id: str, why: str) -> None:
    """Stop the request sent with `request_id` on the server: a cancel naming its id, sent to
    the `whisper` model (Triton 2.51 passes none into a running ensemble step). `why` is
    for the log. If it fails, the request runs to its end: only time is lost."""
    import tritonclient.grpc.aio as triton

    inputs = []
    for name, array, datatype in CANCEL_INPUTS:
        inputs.append(triton.InferInput(name, list(array.shape), datatype))
        inputs[-1].set_data_from_numpy(array)
    try:
        await client.infer(tensor_names.WHISPER_NAME, inputs, parameters={CANCEL_KEY: request_id},
                           client_timeout=CANCEL_TIMEOUT_S)
    except Exception as error:  # Triton's refusal, or a gateway shutting down
        log.warning("could not cancel request %s, %s: %s", request_id, why, error)


class Transcriber:
    """Transcribes 16 kHz audio through the `transcribe` ensemble, sent as a WAV file;
    a transcription whose caller is cancelled is cancelled on the server too."""

    def __init__(self, client: tritonclient.grpc.aio.InferenceServerClient, model: str,
                 timeout_s: float | None) -> None:
        self.client, self.model, self.timeout_s = client, model, timeout_s

    async def transcribe(self, audio: np.ndarray, model: str, language: str | None, prompt: str | None) -> str:
        """The transcript's text; `model` is the request's (one of the gateway's model ids)."""
        import tritonclient.grpc.aio as triton

        request = AudioRequest(model=model, task=Task.TRANSCRIBE, response_format=ResponseFormat.TEXT,
                               language=language, prompt=prompt)
        tensor = triton.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[wav_bytes(audio)]], dtype=np.object_))
        request_id = new_request_id()
        call = asyncio.ensure_future(self.client.infer(
            self.model, [tensor], outputs=[triton.InferRequestedOutput(tensor_names.FORMATTED)],
            parameters={**request.triton_parameters(), "request_id": request_id}, client_timeout=self.timeout_s,
        ))  # fmt: skip
        try:
            result = await call
        except asyncio.CancelledError:
            await cancel(self.client, request_id, "whose live session ended")
            raise
        return result.as_numpy(tensor_names.FORMATTED).reshape(-1)[0].decode("utf-8").strip()


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
