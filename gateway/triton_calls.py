"""The gateway's requests to Triton, over the async gRPC client, and their cancels.

A transcription is one call to the `transcribe` ensemble; a streamed one
(`stream=true`) one request on gRPC's stream_infer to `transcribe_stream`. Each
carries an id of its own (request parameter `request_id`): when its HTTP client
goes away, the gateway sends the `whisper` model a cancel naming it (Triton
2.51 passes no cancel into a running ensemble step, server#6739) and reads the
server's answers to the end, rather than closing a gRPC call that Triton still
runs (server#7368). A call left unanswered past the gateway's `--timeout` is cancelled
the same way: its gRPC deadline alone would leave Triton decoding it. Imported when
the app is made: tritonclient is slow to import.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as triton
from tritonclient.utils import InferenceServerException

from clients.api import CANCEL_INPUTS, is_timeout, new_request_id
from clients.connection import ServerAddress
from gateway.openai_errors import error_from_triton
from gateway.transcript_events import StreamedReply, replies_of
from python_backend_lib.contract import tensor_names
from python_backend_lib.contract.parameters import CANCEL_KEY

# How often a transcription in flight checks whether its HTTP client is still there, and
# how long the cancel sent when it is not may take.
DISCONNECT_POLL_S = 0.25
CANCEL_TIMEOUT_S = 5.0

log = logging.getLogger(__name__)


class TritonCalls:
    """Requests to the Triton server at `address` for one gateway process."""

    def __init__(self, address: ServerAddress, model: str, timeout_s: float | None) -> None:
        self.address, self.model, self.timeout_s = address, model, timeout_s
        self.client = triton.InferenceServerClient(address.location)
        self._cleanups: set[asyncio.Task] = set()  # cancels of abandoned streams, still running

    async def transcribe(self, http_request: Any, audio: bytes, parameters: dict[str, Any]) -> str:
        """The FORMATTED output of one `transcribe` call; an ApiError when Triton refuses or fails it."""
        request_id = new_request_id()
        call = asyncio.ensure_future(self.client.infer(
            self.model,
            [_audio_tensor(audio)],
            outputs=[triton.InferRequestedOutput(tensor_names.FORMATTED)],
            parameters={**parameters, "request_id": request_id},
            client_timeout=self.timeout_s,
        ))  # fmt: skip
        await self.cancel_if_abandoned(http_request, call, request_id)
        try:
            result = await call
        except InferenceServerException as error:
            if is_timeout(error):
                await self.cancel(request_id)
            raise error_from_triton(error, self.address) from None
        return result.as_numpy(tensor_names.FORMATTED).reshape(-1)[0].decode("utf-8")

    async def stream(
        self, http_request: Any, audio: bytes, parameters: dict[str, Any]
    ) -> tuple[StreamedReply, AsyncIterator[StreamedReply], str]:
        """A `transcribe_stream` request (TEXT and FORMATTED in verbose_json): its first reply,
        the others to come, and its id."""
        request_id = new_request_id()
        request = {
            "model_name": tensor_names.STREAM_ENSEMBLE_NAME,
            "inputs": [_audio_tensor(audio)],
            "outputs": [triton.InferRequestedOutput(n) for n in (tensor_names.TEXT, tensor_names.FORMATTED)],
            "parameters": {**parameters, "response_format": "verbose_json", "request_id": request_id},
        }

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield request

        answers = self.client.stream_infer(requests(), stream_timeout=self.timeout_s)
        replies = replies_of(self._cancel_past_timeout(answers, request_id), self.address)
        first = asyncio.ensure_future(replies.__anext__())
        await self.cancel_if_abandoned(http_request, first, request_id)
        return await first, replies, request_id

    async def _cancel_past_timeout(
        self, answers: AsyncIterator[tuple[Any, Any]], request_id: str
    ) -> AsyncIterator[tuple[Any, Any]]:
        """The stream's (result, error) pairs; the request cancelled first when its timeout ends it."""
        async for result, error in _as_pairs(answers):
            if error is not None and is_timeout(error):
                await self.cancel(request_id)
            yield result, error

    def abandon(self, request_id: str, replies: AsyncIterator[StreamedReply]) -> None:
        """A stream whose HTTP client left: cancel it and read it to its end, in a task of its
        own (the caller's task is being cancelled)."""
        task = asyncio.ensure_future(self._cancel_and_drain(request_id, replies))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _cancel_and_drain(self, request_id: str, replies: AsyncIterator[StreamedReply]) -> None:
        await self.cancel(request_id)
        async for _ in replies:
            pass

    async def cancel_if_abandoned(self, http_request: Any, call: asyncio.Future, request_id: str) -> None:
        """Wait for `call`; if the HTTP client goes away first, have the server stop decoding
        it, and let the call end with the server's answer rather than cancelling it here."""
        while not call.done():
            await asyncio.wait({call}, timeout=DISCONNECT_POLL_S)
            if not call.done() and await http_request.is_disconnected():
                await self.cancel(request_id)
                return

    async def cancel(self, request_id: str) -> None:
        """Have the server stop the request of this id; a failure only costs decoding time."""
        inputs = []
        for name, array, datatype in CANCEL_INPUTS:
            inputs.append(triton.InferInput(name, list(array.shape), datatype))
            inputs[-1].set_data_from_numpy(array)
        try:
            await self.client.infer(tensor_names.WHISPER_NAME, inputs, parameters={CANCEL_KEY: request_id},
                                    client_timeout=CANCEL_TIMEOUT_S)
        except InferenceServerException as error:  # the request runs to its end: only time lost
            log.warning("could not cancel request %s, whose client left: %s", request_id, error)

    async def close(self) -> None:
        await self.client.close()


async def _as_pairs(answers: AsyncIterator[tuple[Any, Any]]) -> AsyncIterator[tuple[Any, Any]]:
    """The aio client's (result, error) pairs of a stream. It raises gRPC's own error for
    the stream's deadline, where it hands over other errors: that one comes as the last
    pair, as it should have."""
    try:
        async for pair in answers:
            yield pair
    except grpc.RpcError as raised:
        yield None, InferenceServerException(msg=raised.details(), status=str(raised.code()))


def _audio_tensor(audio: bytes) -> Any:
    tensor = triton.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[audio]], dtype=np.object_))
    return tensor
