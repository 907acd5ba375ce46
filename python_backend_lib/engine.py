"""Continuous batching: one thread owns the model and decodes every request.

Callers `submit` a window's features with its options and a callback, from any
thread. Between two decoder steps the engine thread admits waiting requests
(encoding them together), drops cancelled ones and answers finished ones, so
requests join and leave the running batch without waiting for each other.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Callable

import torch

from .audio import N_FRAMES
from .decoding import Admission, DecodeBatch, initial_tokens
from .options import DecodingOptions, DecodingResult
from .tokenizer import Tokenizer
from .weights import ModelConfig

log = logging.getLogger(__name__)

Callback = Callable[[DecodingResult | BaseException], None]


@dataclass(frozen=True)
class EngineOptions:
    max_admit: int = 16  # new requests encoded together before the next step


@dataclass(eq=False)
class _Job:
    on_done: Callback
    is_cancelled: Callable[[], bool] | None

    def cancelled(self) -> bool:
        try:
            return bool(self.is_cancelled and self.is_cancelled())
        except Exception:  # a broken probe must not stop the engine
            return False


class Engine:
    def __init__(
        self,
        batch: DecodeBatch,
        config: ModelConfig,
        tokenizer: Tokenizer | None,
        options: EngineOptions = EngineOptions(),
    ) -> None:
        self.batch = batch
        self.config = config
        self.tokenizer = tokenizer
        self.options = options
        self._waiting: queue.SimpleQueue[Admission | None] = queue.SimpleQueue()
        self._jobs: dict[_Job, None] = {}
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(
        self,
        features: torch.Tensor,
        options: DecodingOptions,
        on_done: Callback,
        is_cancelled: Callable[[], bool] | None = None,
    ) -> None:
        """Queue one window for decoding; `on_done` later receives its result or
        exception on the engine thread. Raises ValueError at once when the
        features or options do not fit the model."""
        expected = (self.config.dims.n_mels, N_FRAMES)
        if tuple(features.shape) != expected:
            raise ValueError(f"features must have shape {list(expected)}, got {list(features.shape)}")
        if self._closing.is_set():
            raise RuntimeError("the engine is shut down")
        prompt = initial_tokens(self.config, options, self.tokenizer)
        self._ensure_started()
        self._waiting.put(Admission(_Job(on_done, is_cancelled), features, options, prompt))

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish the requests already submitted, then stop the thread."""
        self._closing.set()
        self._waiting.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="whisper-engine", daemon=True)
                self._thread.start()

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        pending: list[Admission] = []
        while True:
            idle = not self.batch.rows and not pending
            stop = self._collect(pending, block=idle)
            if stop and not self.batch.rows and not pending:
                return
            self._admit(pending)
            self._drop_cancelled()
            self._step()

    def _collect(self, pending: list[Admission], block: bool) -> bool:
        """Move submitted requests to `pending`; True once close() was called."""
        stop = False
        try:
            item = self._waiting.get(block=block)
            while True:
                if item is None:
                    stop = True
                else:
                    pending.append(item)
                item = self._waiting.get_nowait()
        except queue.Empty:
            pass
        return stop or self._closing.is_set()

    def _admit(self, pending: list[Admission]) -> None:
        n = min(len(pending), self.batch.free_slots, self.options.max_admit)
        if n == 0:
            return
        admitted, pending[:] = pending[:n], pending[n:]
        live = []
        for admission in admitted:
            if admission.tag.cancelled():
                self._answer(admission.tag, CancelledError("request cancelled"))
            else:
                live.append(admission)
        try:
            self.batch.admit(live)
        except Exception as error:  # e.g. out of memory while encoding
            log.exception("encoding %d requests failed", len(live))
            for admission in live:
                self.batch.drop(admission.tag)
                self._answer(admission.tag, error)

    def _drop_cancelled(self) -> None:
        for row in list(self.batch.rows):
            if row.tag.cancelled():
                self.batch.drop(row.tag)
                self._answer(row.tag, CancelledError("request cancelled"))

    def _step(self) -> None:
        if not self.batch.rows:
            return
        try:
            finished = self.batch.step()
        except Exception as error:
            log.exception("decoder step failed; failing the %d requests in the batch", len(self.batch.rows))
            for row in list(self.batch.rows):
                self.batch.drop(row.tag)
                self._answer(row.tag, error)
            return
        for job, result in finished:
            self._answer(job, result)

    @staticmethod
    def _answer(job: _Job, outcome: DecodingResult | BaseException) -> None:
        try:
            job.on_done(outcome)
        except Exception:
            log.exception("a result callback raised")
