"""Continuous batching: one thread owns the model and decodes every request.

Callers `submit` a window's features with its options and a callback, from any
thread; the windows submitted in one `together` block reach the engine at once.
Between two decoder steps the engine thread admits waiting requests (encoding them
together), drops cancelled ones (running or still waiting for a slot) and answers
finished ones, so requests join and leave the running batch
without waiting for each other. A pass encoding only requests cancelled
meanwhile stops at the next encoder layer.

Every submitted window gets exactly one answer:
- A failing step stays with the request that caused it: the engine puts the
  rows back as they were and steps them one at a time, so only the rows that
  fail alone get the error; rows that finished before the failure keep their results.
- Anything else that goes wrong on the engine thread (a bug of ours, in the
  failure handling too) fails every window the engine holds with that error
  and the loop starts again with an empty batch (`EngineStats.restarts`).
- After `MAX_CONSECUTIVE_RESTARTS` restarts without one good step in between
  the engine is unhealthy: it refuses new windows at once (`EngineUnavailable`)
  and says so (`healthy`), so that the server can be replaced.
- A thread that never returns (a stuck device call) cannot raise: a watcher
  that sees `turns` stand still while work is held calls `stall`, which makes
  the engine unhealthy the same way (`serving.stall_watch`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Callable

import torch

from python_backend_lib.core.errors import RequestError, ServerUnavailable
from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.core.options import DecodingOptions, DecodingResult
from python_backend_lib.devices.host_memory import IDLE_RELEASE_S, release_free_memory
from python_backend_lib.devices.placement import on_device
from python_backend_lib.engine.batch import DecodeBatch, Finished, StepFailed
from python_backend_lib.engine.beams import admissible, rows_needed, with_beam_mates
from python_backend_lib.engine.inbox import Inbox
from python_backend_lib.engine.model import EncodingStopped
from python_backend_lib.engine.prompt import initial_tokens
from python_backend_lib.engine.rows import Admission, RowState, SegmentListener
from python_backend_lib.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Callback = Callable[[DecodingResult | BaseException], None]

# Queue waits kept for a metrics reader between two reads; older ones are dropped.
MAX_RECENT_WAITS = 10_000
# Cancellation flags are read at most this often: a cancelled window leaves the
# batch within this long of its flag being set.
CANCEL_CHECK_INTERVAL_S = 0.05
# Restarts in a row, with no decoder step succeeding in between, after which the
# engine gives up and reports itself unhealthy.
MAX_CONSECUTIVE_RESTARTS = 3


@dataclass(frozen=True)
class EngineOptions:
    """max_admit: new requests encoded together before the next step.
    admit_wait_s: while others decode, new requests wait up to this long for
        more to arrive, so that one encoder pass serves several (an idle engine
        admits at once)."""

    max_admit: int = 16
    admit_wait_s: float = 0.005


class EngineUnavailable(ServerUnavailable):
    """The engine is shut down, or gave up after failing repeatedly; retry on another server."""


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
    restarts: int = 0  # times the loop failed everything it held and started again
    memory_releases: int = 0  # times the idle engine gave freed host memory back
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
        self._inbox = Inbox()  # submitted, one window or one `together` block's at a time
        self._pending: list[Admission] = []  # taken from the inbox, not yet admitted
        self.stats = EngineStats()
        self._closing = False
        self._unhealthy: str | None = None  # why the engine gave up
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # submit against close and start
        self._cancel_checked_at = 0.0
        self._stepped = False  # a step succeeded since the loop last (re)started
        # Loop turns completed: a watcher that sees it stand still while the engine holds
        # work knows the engine thread is stuck (`serving.stall_watch`).
        self.turns = 0
        # Entered around each delivery of the windows a step finished, before their kept
        # slots are freed: a pipeline's word alignments wait in it and run together as it
        # ends (`transcription.alignment_rounds`).
        self.delivery_round: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        # Stop the thread before the interpreter tears down, even if nobody calls close():
        # a thread still inside torch at exit aborts the process.
        atexit.register(_close_at_exit, weakref.ref(self))

    def submit(
        self,
        features: torch.Tensor,
        options: DecodingOptions,
        on_done: Callback,
        is_cancelled: Callable[[], bool] | None = None,
        *,
        content_frames: int | None = None,
        keep_audio: bool = False,
        live: bool = False,
        on_segment: SegmentListener | None = None,
    ) -> None:
        """Queue one window for decoding; `on_done` later receives its result or
        exception on the engine thread.

        content_frames: the frames of `features` that hold audio; when given, a
            window of digital silence is answered as silent without decoding.
        keep_audio: the window's encoder K/V stay in their slot while `on_done` runs,
            which the result names (`DecodingResult.audio_slot`): word timestamps align
            on them instead of encoding the window again.
        live: admitted before every waiting window that is not live (FIFO among
            each), at once rather than waiting for others to encode with it: a live
            session's hypothesis never waits behind batch windows.
        on_segment: told on the engine thread of each segment the window ends and
            goes on past (the last comes with `on_done`), with its result up to that
            segment's end (`rows.SegmentListener`), when it decodes as one row
            (neither beams nor best_of candidates, whose text is chosen at the end).
        Raises RequestError at once when the options do not fit the checkpoint,
        EngineUnavailable when the engine is shut down or unhealthy.
        """
        expected = (self.config.dims.n_mels, N_FRAMES)
        if tuple(features.shape) != expected:
            raise ValueError(f"features must have shape {list(expected)}, got {list(features.shape)}")
        prompt = initial_tokens(self.config, options, self.tokenizer)
        if (needed := rows_needed(options)) > self.slots:
            raise RequestError(
                f"beam_size/best_of {needed} needs {needed} decoding slots; this server has {self.slots}"
            )
        admission = Admission(
            _Job(on_done, is_cancelled), features, options, prompt, content_frames, keep_audio, live, on_segment
        )
        with self._lock:
            if (refusal := self._refusal()) is not None:
                raise refusal
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="whisper-engine", daemon=True)
                self._thread.start()
            if not self._inbox.hold(admission):
                self._inbox.put([admission])

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Hand the engine the windows this thread submits in the block at once, as it
        ends: an idle engine would otherwise take the first alone, and the rest a step
        later, in an encoder pass of their own. Nothing in the block may wait for
        them. Where the engine shut down or gave up meanwhile, each gets EngineUnavailable."""
        group = None
        try:
            with self._inbox.gathering() as group:
                yield
        finally:
            if group:
                with self._lock:
                    refusal = self._refusal()
                    if refusal is None:
                        self._inbox.put(group)
                for admission in group if refusal is not None else ():
                    try:
                        admission.tag.on_done(refusal)
                    except Exception:
                        log.exception("a result callback raised")

    def _refusal(self) -> EngineUnavailable | None:
        """Why new windows are refused now, if they are (under `_lock`)."""
        if self._closing:
            return EngineUnavailable("the engine is shut down")
        if self._unhealthy is not None:
            return EngineUnavailable(f"the engine is unhealthy and refuses new work: {self._unhealthy}")
        return None

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
        return self._inbox.waiting + len(self._pending)

    @property
    def healthy(self) -> bool:
        """False once the engine gave up after failing repeatedly (it then refuses new windows)."""
        return self._unhealthy is None and (self._thread is None or self._thread.is_alive() or self._closing)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish the windows already submitted, then stop the thread."""
        with self._lock:
            self._closing = True
            self._inbox.put(None)
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        with on_device(self.batch.device):  # a new thread starts on the first GPU
            self._loop()

    def _loop(self) -> None:
        restarts_in_a_row = 0
        while True:
            self._stepped = False
            try:
                self._serve()
                return  # closed, and nothing left
            except BaseException as error:  # a bug of ours: fail what is held, start again
                self.stats.restarts += 1
                restarts_in_a_row = 1 if self._stepped else restarts_in_a_row + 1
                held = len(self.batch.rows) + len(self._pending)
                log.exception(
                    "the engine failed (%d in a row); failing the %d windows it holds", restarts_in_a_row, held
                )
                self._fail_everything(error)
                if restarts_in_a_row >= MAX_CONSECUTIVE_RESTARTS:
                    self._give_up(error)
                    return

    def _serve(self) -> None:
        """The loop proper; returns once closed and idle, raises on anything unexpected."""
        pending = self._pending
        while True:
            idle = not self.batch.rows and not pending
            stop = self._collect(pending, block=idle)
            if stop and not self.batch.rows and not pending:
                return
            self._admit(pending)
            self._drop_cancelled()
            self._step()
            self.turns += 1

    def _collect(self, pending: list[Admission], block: bool) -> bool:
        """Move submitted windows to `pending`; True once close() was called."""
        stop = False
        try:
            # Never wait once closing: close()'s marker may have been taken by an earlier
            # collect, while windows were still decoding, and no other comes.
            item = self._next(block=block and not self._closing)
            while True:
                if item is None:
                    stop = True
                else:
                    self.stats.submitted += len(item)
                    pending += item
                item = self._inbox.take()
        except queue.Empty:
            pass
        pending.sort(key=lambda admission: not admission.live)  # stable: live first, FIFO within each
        return stop or self._closing

    def _next(self, block: bool) -> list[Admission] | None:
        """The next submitted item (queue.Empty if none and not `block`). Idle for
        IDLE_RELEASE_S, the engine gives the memory its windows freed back to the system
        first: otherwise the process keeps the peak of its last burst."""
        if not block:
            return self._inbox.take()
        try:
            return self._inbox.take(block=True, timeout=IDLE_RELEASE_S)
        except queue.Empty:
            self.stats.memory_releases += release_free_memory()
            return self._inbox.take(block=True)

    def _admit(self, pending: list[Admission]) -> None:
        if not self.batch.accepting:  # the side stream holds enough to encode (`side_encoding`)
            return
        n = admissible([a.options for a in pending[: self.options.max_admit]], self.batch.free_slots)
        if n == 0:
            return
        waited = time.monotonic() - pending[0].tag.submitted_at
        batching = self.batch.rows and n < self.options.max_admit and waited < self.options.admit_wait_s
        if batching and not pending[0].live:
            return
        admitted, pending[:] = pending[:n], pending[n:]
        live = []
        for admission in admitted:
            if admission.tag.cancelled():
                self._answer_cancelled(admission.tag)
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
        """Admit them; if every one is cancelled while their audio is encoded, answer them
        at the next layer instead of at the end of the pass."""
        try:
            self.batch.admit(admissions, stop=lambda: all(a.tag.cancelled() for a in admissions))
        except EncodingStopped:
            for admission in admissions:
                self._answer_cancelled(admission.tag)
            return
        now = time.monotonic()
        for admission in admissions:
            self.stats.admitted += 1
            self.stats.recent_waits.append(now - admission.tag.submitted_at)

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        if now - self._cancel_checked_at < CANCEL_CHECK_INTERVAL_S:
            return
        self._cancel_checked_at = now
        for job in dict.fromkeys(row.tag for row in self.batch.rows):  # a beam search's rows share one
            if job.cancelled():
                self.batch.drop(job)
                self._answer_cancelled(job)
        # Those still waiting for a slot too: on a full engine a slot may be a long way off,
        # and the request holds its place in the server's request limit until answered.
        kept, cancelled = [], []
        for admission in self._pending:
            (cancelled if admission.tag.cancelled() else kept).append(admission)
        if cancelled:
            self._pending[:] = kept
            for admission in cancelled:
                self._answer_cancelled(admission.tag)

    def _step(self) -> None:
        if not self.batch.rows:
            return
        saved = self.batch.checkpoint()
        try:
            finished = self.batch.step()
        except StepFailed as failure:
            self._deliver(failure.finished)
            finished = self._step_one_by_one(saved, failure.cause)
        except Exception as error:
            finished = self._step_one_by_one(saved, error)
        self._stepped = True
        self._deliver(finished)

    def _step_one_by_one(self, saved: list[RowState], error: BaseException) -> list[Finished]:
        """After a failed step: rewind the rows still in the batch, then step each
        alone; only the rows that fail alone get an error (and leave the batch)."""
        self.stats.failed_steps += 1
        log.warning("a decoder step over %d requests failed; retrying them one by one", len(saved), exc_info=error)
        for job in self.batch.rewind(saved):
            self._answer(job, error)
        finished: list[Finished] = []
        stepped: set = set()
        for row in list(self.batch.rows):
            if row in stepped or row not in self.batch.rows:
                continue
            unit = with_beam_mates([row])  # a beam search steps with all its beams
            stepped.update(unit)
            try:
                finished += self.batch.step(unit)
            except StepFailed as failure:  # cannot happen for one row, but keep what finished
                finished += failure.finished
                self._fail_row(row, failure.cause)
            except Exception as row_error:
                log.exception("a request failed its decoder step alone")
                self._fail_row(row, row_error)
        return finished

    def _fail_row(self, row, error: BaseException) -> None:
        self.batch.drop(row.tag)
        self._answer(row.tag, error)

    def _fail_everything(self, error: BaseException) -> None:
        """Answer every window the engine holds with `error` and empty the batch.
        Never raises: it runs when something already went wrong."""
        jobs = list(dict.fromkeys(row.tag for row in self.batch.rows)) + [a.tag for a in self._pending]
        try:
            self.batch.reset()
        except BaseException:
            log.exception("could not empty the decode batch")
        self._pending.clear()
        for job in jobs:
            self._answer(job, error)

    @property
    def thread(self) -> threading.Thread | None:
        """The engine thread, once the first window started it."""
        return self._thread

    def stall(self, reason: str) -> None:
        """Mark the engine unhealthy from another thread: its own thread is stuck. New
        windows are refused at once (`EngineUnavailable`); the windows it holds are the
        caller's to answer, since the stuck thread will not."""
        with self._lock:
            if self._unhealthy is None:
                self._unhealthy = reason

    def _give_up(self, error: BaseException) -> None:
        """Mark the engine unhealthy and refuse whatever still arrives."""
        with self._lock:
            self._unhealthy = f"{type(error).__name__}: {error}"
            refusal = self._refusal()
        log.error("the engine failed %d times in a row and gives up: %s", MAX_CONSECUTIVE_RESTARTS, self._unhealthy)
        while True:
            try:
                item = self._inbox.take()
            except queue.Empty:
                return
            for admission in item or ():
                self._answer(admission.tag, refusal)

    def _deliver(self, finished: list[Finished]) -> None:
        try:
            if finished:  # most steps finish nothing: no round to open
                with self.delivery_round():
                    for job, result in finished:
                        self._answer(job, result)
        finally:
            self.batch.release_kept()  # the slots kept for these callbacks (`submit`'s keep_audio)

    def _answer_cancelled(self, job: _Job) -> None:
        self._answer(job, CancelledError("request cancelled"))

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


def _close_at_exit(engine_ref: weakref.ref) -> None:
    engine = engine_ref()
    if engine is not None:
        engine.close(timeout=10.0)
