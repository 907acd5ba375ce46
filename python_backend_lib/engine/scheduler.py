"""Continuous batching: one thread owns the model and decodes every request.

Callers `submit` a window's features with its options and a callback, from any
thread. Between two decoder steps the engine thread admits waiting requests
(encoding them together), drops cancelled ones and answers finished ones, so
requests join and leave the running batch without waiting for each other.

A failure stays with the request that caused it: when a step (or the encoding
of new requests) raises, the engine puts the rows back as they were and runs
them one at a time, so only the rows that fail alone get the error. Every
submitted window gets exactly one answer, and the thread survives its own bugs.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from python_backend_lib.checkpoints.weights import ModelConfig
from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.core.options import DecodingOptions, DecodingResult
from python_backend_lib.engine.decoding import Admission, DecodeBatch, initial_tokens
from python_backend_lib.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Callback = Callable[[DecodingResult | BaseException], None]


# Queue waits kept for a metrics reader between two reads; older ones are dropped.
MAX_RECENT_WAITS = 10_000


@dataclass(frozen=True)
class EngineOptions:
    """max_admit: new requests encoded together before the next step.
    fault_prompt: a test hook, off by default: every decoder step that holds a request
        whose prompt is exactly this text raises `InjectedFault`, as a bug triggered
        by one request would (`WHISPER_TRITON_FAULT_PROMPT` sets it in the server).
    """

    max_admit: int = 16
    fault_prompt: str | None = None


class InjectedFault(ValueError):
    """Raised by the `fault_prompt` test hook."""


@dataclass
class EngineStats:
    """Counts of windows (30 s decodes) since the start, for monitoring.

    Written by the engine thread only; `recent_waits` holds each admitted
    window's seconds from `submit` to joining the batch, for a reader to drain.
    """

    submitted: int = 0
    admitted: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    failed_steps: int = 0  # steps that raised and were retried row by row
    recent_waits: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_RECENT_WAITS))


@dataclass(eq=False)
class _Job:
    on_done: Callback
    is_cancelled: Callable[[], bool] | None
    submitted_at: float = field(default_factory=time.monotonic)

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
        self._pending: list[Admission] = []  # taken off `_waiting`, not yet admitted
        self.stats = EngineStats()
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

    @property
    def slots(self) -> int:
        """Windows decoded together at most (the KV slots)."""
        return self.batch.pool.shape.n_slots

    @property
    def running(self) -> int:
        """Windows in the decode batch now."""
        return len(self.batch.rows)

    @property
    def waiting(self) -> int:
        """Windows submitted and not yet in the batch (approximate from other threads)."""
        return self._waiting.qsize() + len(self._pending)

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
        pending = self._pending
        while True:
            idle = not self.batch.rows and not pending
            stop = self._collect(pending, block=idle)
            if stop and not self.batch.rows and not pending:
                return
            try:
                self._admit(pending)
                self._drop_cancelled()
                self._step()
            except Exception as error:  # a bug of ours: fail what is in flight, keep serving
                log.exception("the engine failed; failing %d running and %d waiting windows",
                              len(self.batch.rows), len(pending))  # fmt: skip
                self._fail_all(pending, error)

    def _collect(self, pending: list[Admission], block: bool) -> bool:
        """Move submitted requests to `pending`; True once close() was called."""
        stop = False
        try:
            item = self._waiting.get(block=block)
            while True:
                if item is None:
                    stop = True
                else:
                    self.stats.submitted += 1
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
            self._encode(live)
        except Exception:  # e.g. out of memory encoding them together: one at a time
            log.warning("encoding %d new requests together failed; encoding them one by one", len(live), exc_info=True)
            for admission in live:
                try:
                    self._encode([admission])
                except Exception as error:
                    log.exception("encoding a request failed")
                    self._answer(admission.tag, error)

    def _encode(self, admissions: list[Admission]) -> None:
        self.batch.admit(admissions)
        now = time.monotonic()
        for admission in admissions:
            self.stats.admitted += 1
            self.stats.recent_waits.append(now - admission.tag.submitted_at)

    def _drop_cancelled(self) -> None:
        for row in list(self.batch.rows):
            if row.tag.cancelled():
                self.batch.drop(row.tag)
                self._answer(row.tag, CancelledError("request cancelled"))

    def _step(self) -> None:
        if not self.batch.rows:
            return
        saved = self.batch.checkpoint()
        try:
            self._check_fault(row.options for row in self.batch.rows)
            finished = self.batch.step()
        except Exception as error:
            finished = self._step_one_by_one(saved, error)
        for job, result in finished:
            self._answer(job, result)

    def _step_one_by_one(self, saved: list, error: Exception) -> list[tuple[_Job, DecodingResult]]:
        """After a failed step: rewind, then step each row alone; only the rows
        that fail alone get an error (and leave the batch)."""
        self.stats.failed_steps += 1
        log.warning("a decoder step over %d requests failed; retrying them one by one", len(saved), exc_info=error)
        for row in self.batch.rewind(saved):  # left the batch inside the failed step: result lost
            self._answer(row.tag, error)
        finished = []
        for row in list(self.batch.rows):
            try:
                self._check_fault([row.options])
                finished += self.batch.step([row])
            except Exception as row_error:
                log.exception("a request failed its decoder step alone")
                self.batch.drop(row.tag)
                self._answer(row.tag, row_error)
        return finished

    def _check_fault(self, options: Iterable[DecodingOptions]) -> None:
        """The `fault_prompt` test hook."""
        fault = self.options.fault_prompt
        if fault is not None and any(o.prompt == fault for o in options):
            raise InjectedFault(f"injected fault for the prompt {fault!r}")

    def _fail_all(self, pending: list[Admission], error: Exception) -> None:
        for row in list(self.batch.rows):
            self.batch.drop(row.tag)
            self._answer(row.tag, error)
        for admission in pending:
            self._answer(admission.tag, error)
        pending.clear()

    def _answer(self, job: _Job, outcome: DecodingResult | BaseException) -> None:
        if isinstance(outcome, CancelledError):
            self.stats.cancelled += 1
        elif isinstance(outcome, BaseException):
            self.stats.failed += 1
        else:
            self.stats.finished += 1
        try:
            job.on_done(outcome)
        except Exception:
            log.exception("a result callback raised")
