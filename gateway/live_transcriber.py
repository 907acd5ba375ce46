"""Live sessions' transcriptions: 16 kHz audio through Triton's `transcribe` ensemble,
as raw float32 samples (`pcm_f32le`: no WAV to write, nor 16-bit rounding), on the
gateway's connection (`triton_calls`), with word timestamps
(which `local_agreement` lines hypotheses up by), marked `live` (the engine
admits them before batch windows); a transcription whose session ends is
cancelled on the server too. tritonclient is imported when a
transcription is made, as `triton_calls` is: the `whisper-triton` command starts
without it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from clients.api import new_request_id
from gateway.openai_api import WORD, AudioRequest
from python_backend_lib.contract import tensor_names
from python_backend_lib.contract.parameters import InputFormat
from python_backend_lib.core.geometry import SAMPLE_RATE
from python_backend_lib.core.options import Task
from python_backend_lib.core.segments import Word
from python_backend_lib.text.formats import Document, ResponseFormat

if TYPE_CHECKING:
    from gateway.triton_calls import TritonCalls


@dataclass(frozen=True)
class LiveTranscript:
    """A transcript of a live turn's audio so far: its text, and its words with their times."""

    text: str
    words: tuple[Word, ...]


class Transcriber:
    """Transcribes a live session's audio with the gateway's Triton calls."""

    def __init__(self, calls: TritonCalls) -> None:
        self.calls = calls

    async def transcribe(
        self, audio: np.ndarray, model: str, language: str | None, prompt: str | None
    ) -> LiveTranscript:
        """`model` is the session's (one of the gateway's model ids)."""
        import tritonclient.grpc.aio as triton

        request = AudioRequest(model=model, task=Task.TRANSCRIBE, response_format=ResponseFormat.VERBOSE_JSON,
                               language=language, prompt=prompt, granularities=(WORD,))
        tensor = triton.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[pcm_f32le(audio)]], dtype=np.object_))
        request_id = new_request_id()
        parameters = {**request.triton_parameters(), "request_id": request_id, "live": True,
                      "input_format": InputFormat.PCM_F32LE.value, "sample_rate": SAMPLE_RATE}
        call = asyncio.ensure_future(self.calls.client.infer(
            self.calls.model, [tensor], outputs=[triton.InferRequestedOutput(tensor_names.FORMATTED)],
            parameters=parameters, client_timeout=self.calls.timeout_s,
        ))  # fmt: skip
        try:
            result = await call
        except asyncio.CancelledError:
            await self.calls.cancel(request_id)
            raise
        document = Document.from_verbose_json(result.as_numpy(tensor_names.FORMATTED).reshape(-1)[0])
        return LiveTranscript(text=document.text.strip(), words=document.words)


def pcm_f32le(audio: np.ndarray) -> bytes:
    """16 kHz float samples as the AUDIO bytes of input_format pcm_f32le."""
    return np.ascontiguousarray(audio, dtype="<f4").tobytes()
