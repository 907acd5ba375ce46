"""One live turn's transcription: hypotheses of its audio while it grows, the words two
in a row agree on sent as deltas, then its whole audio transcribed once more as the
completed transcript, asked again while the server refuses it as overloaded.

A session (`realtime.Session`) opens a `Turn` for each item and runs one
`TurnTranscription.run` task per turn: the session owns the events and the audio, this
module the requests a turn makes to Triton and the order its answers go out in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway import realtime_protocol as protocol
from gateway.finals_first import FinalsFirst
from gateway.hypothesis_window import Window, in_turn, next_window
from gateway.live_transcriber import LiveTranscript, Transcriber
from gateway.local_agreement import LocalAgreement, delta_text
from gateway.openai_errors import is_overloaded
from gateway.realtime_protocol import SessionSettings
from python_backend_lib.core.geometry import SAMPLE_RATE
from python_backend_lib.core.segments import Word

# A turn's final transcription that the server refuses as overloaded is asked again after
# each of these pauses, then fails: its audio is final, and its text is what a caption
# keeps, while a hypothesis refused so is only skipped. Overload is the server's answer to
# a load that comes and goes, such as the hypotheses of many sessions at once.
FINAL_RETRY_PAUSES_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0)
# A hypothesis once the turn has this much audio, then each time it has grown by HYPOTHESIS_STEP_S
# (one at a time per turn: a slow server gets fewer, longer ones). On real hypotheses a 0.25 s
# cadence committed no misreading (docs/benchmarks/live-agreement), and on a GPU it gave a lone
# session its words sooner than 0.5 s did, and many sessions no later (docs/benchmarks/live-gpu).
FIRST_HYPOTHESIS_S = 1.0
HYPOTHESIS_STEP_S = 0.25
MAX_HYPOTHESIS_STEP_S = 30.0

log = logging.getLogger(__name__)


def check_hypothesis_every(seconds: float) -> None:
    """Raises ValueError for a hypothesis cadence that is no time at all, or longer than a window."""
    if not 0 < seconds <= MAX_HYPOTHESIS_STEP_S:
        raise ValueError(f"a live hypothesis every {seconds:g} s: give more than 0 s and at most "
                         f"{MAX_HYPOTHESIS_STEP_S:g} s (one 30 s window)")


@dataclass(eq=False)  # each turn is itself: sessions keep them in sets
class Turn:
    """One item: a turn's audio, growing until it is committed."""

    item_id: str
    start: int  # its first sample in the session's 16 kHz timeline
    chunks: list[np.ndarray] = field(default_factory=list)
    samples: int = 0
    closed: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # more audio, or closed
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # closed
    task: asyncio.Task | None = None
    # Its completed transcription ended (answered, failed or cancelled): the next turn's
    # waits for it, so that turns complete in the order they were committed.
    transcribed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, audio: np.ndarray) -> None:
        self.chunks.append(audio)
        self.samples += len(audio)
        self.changed.set()

    def audio(self) -> np.ndarray:
        whole = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        self.chunks = [whole]
        return whole

    def close(self, samples: int | None = None) -> None:
        """No more audio; `samples`: cut the turn to this many."""
        if samples is not None and samples < self.samples:
            self.chunks, self.samples = [self.audio()[:samples]], samples
        self.closed = True
        self.changed.set()
        self.ended.set()


class TurnTranscription:
    """The transcriptions of one session's turns. transcriber: its requests to Triton;
    finals: the process's gate that holds hypotheses back while a final waits for room;
    hypothesis_every_s: a turn's next hypothesis once it has grown by this much audio;
    send: the session's way to send an event; session_id: for the logs."""

    def __init__(self, transcriber: Transcriber, finals: FinalsFirst, hypothesis_every_s: float,
                 send: Callable[[dict[str, Any]], Awaitable[None]], session_id: str) -> None:
        self.transcriber, self.finals, self.hypothesis_every_s = transcriber, finals, hypothesis_every_s
        self.send, self.session_id = send, session_id

    async def run(self, turn: Turn, settings: SessionSettings, before: Turn | None = None) -> None:
        """Deltas while the turn grows, then its completed transcript, sent once the turn
        `before` it completed: completed events come in turn order, as captions follow the
        speech, whichever transcription the server answers first."""
        agreement, decoded, window = LocalAgreement(), 0, Window(prompt=settings.prompt)
        try:
            while not turn.closed:
                grown_s = (turn.samples - decoded) / SAMPLE_RATE
                if turn.samples >= FIRST_HYPOTHESIS_S * SAMPLE_RATE and grown_s >= self.hypothesis_every_s:
                    decoded = turn.samples
                    audio = turn.audio()[window.start_sample:decoded]
                    hypothesis = await self._unless_ended(turn, self._hypothesis(audio, settings, window.prompt))
                    if hypothesis is not None and not turn.closed:
                        await self._delta(turn, agreement, agreement.insert(in_turn(hypothesis.words, window)))
                        window = next_window(window, agreement.committed, settings.prompt)
                else:
                    turn.changed.clear()
                    await turn.changed.wait()
            audio = turn.audio()
            transcript = await self._final(audio, settings)
            if before is not None:
                await before.transcribed.wait()
            await self._delta(turn, agreement, agreement.finish(transcript.words))
            await self.send(protocol.completed_event(turn.item_id, transcript.text, len(audio) / SAMPLE_RATE))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the turn fails, the session goes on
            log.exception("the transcription of live item %s failed", turn.item_id)
            await self.send(protocol.server_event(
                "conversation.item.input_audio_transcription.failed", item_id=turn.item_id, content_index=0,
                error={"type": "server_error", "code": "transcription_failed", "message": str(error), "param": None},
            ))  # fmt: skip
        finally:
            turn.transcribed.set()

    async def _final(self, audio: np.ndarray, settings: SessionSettings) -> LiveTranscript:
        """The turn's transcript, asked again after each of FINAL_RETRY_PAUSES_S while the
        server refuses it as overloaded, this process's hypotheses held back meanwhile
        (`FinalsFirst`); any other failure, or the last refusal, is raised."""
        with contextlib.ExitStack() as held:
            for pause in (None, *FINAL_RETRY_PAUSES_S):
                if pause is not None:
                    log.info("a live turn's transcription was refused as overloaded; asked again in %g s", pause)
                    await asyncio.sleep(pause)
                try:
                    return await self.transcriber.transcribe(audio, settings.model, settings.language, settings.prompt)
                except Exception as error:
                    if not is_overloaded(error):
                        raise
                    refused = error
                if pause is None:
                    held.enter_context(self.finals.waiting())
        raise refused

    @staticmethod
    async def _unless_ended(turn: Turn, hypothesis: Awaitable[LiveTranscript | None]) -> LiveTranscript | None:
        """The hypothesis, or None if the turn ends first: it is cancelled (on the server too),
        so that the turn's final transcription does not wait behind it."""
        task = asyncio.ensure_future(hypothesis)
        ended = asyncio.ensure_future(turn.ended.wait())
        try:
            await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the session ends: the hypothesis goes with it
            task.cancel()
            raise
        finally:
            ended.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    async def _hypothesis(
        self, audio: np.ndarray, settings: SessionSettings, prompt: str | None
    ) -> LiveTranscript | None:
        """A transcript of the turn's audio so far from its window's start; None if the server
        could not give one (the next try may)."""
        from tritonclient.utils import InferenceServerException

        if self.finals.holding:
            log.debug("live session %s: a hypothesis skipped while a final waits for room", self.session_id)
            return None
        try:
            return await self.transcriber.transcribe(audio, settings.model, settings.language, prompt)
        except InferenceServerException as error:
            log.warning("a live hypothesis failed: %s", error)
            return None

    async def _delta(self, turn: Turn, agreement: LocalAgreement, words: list[Word]) -> None:
        if words:
            first = len(agreement.committed) == len(words)
            await self.send(protocol.delta_event(turn.item_id, delta_text(words, first)))
