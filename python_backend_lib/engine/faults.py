"""Faults injected on purpose, for tests of failure handling: off unless asked for.

`FaultyDecodeBatch` is built instead of a `DecodeBatch` only when a `FaultPlan`
names a prompt, so the production step carries no check at all. A request
whose prompt is exactly the planned text then fails as a bug triggered by one
request would: inside a decoder step (the engine rewinds and retries rows one
by one, and only that request fails), or inside a step and again while the
engine handles that failure (the loop itself fails: the engine fails every
window it holds and restarts), or by never returning from a step, as a stuck
device call would (`stall_prompt`: only a watch from outside the engine thread
can then answer its requests, `serving.stall_watch`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from python_backend_lib.engine.batch import DecodeBatch, Finished
from python_backend_lib.engine.rows import Row


class InjectedFault(ValueError):
    """Raised by a planned fault. A ValueError that is not a RequestError: the
    server's fault, reported as INTERNAL, never as the client's mistake."""


@dataclass(frozen=True)
class FaultPlan:
    """step_prompt: every decoder step holding a request with this prompt raises.
    engine_prompt: the same, and dropping such a request (the engine's failure
        handling) raises too, so the failure escapes to the engine loop.
    stall_prompt: every decoder step holding a request with this prompt blocks until
        `released` is set (a test's; never, served)."""

    step_prompt: str | None = None
    engine_prompt: str | None = None
    stall_prompt: str | None = None  # a step holding a request with this prompt blocks until `released`
    released: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    @property
    def empty(self) -> bool:
        return self.step_prompt is None and self.engine_prompt is None and self.stall_prompt is None


class FaultyDecodeBatch(DecodeBatch):
    def __init__(self, *args: Any, plan: FaultPlan, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan = plan
        self.stalls = 0  # steps that blocked on the stall prompt

    def _holding(self, rows: Sequence[Row], prompt: str | None) -> bool:
        return prompt is not None and any(row.options.prompt == prompt for row in rows)

    def step(self, rows: Sequence[Row] | None = None) -> list[Finished]:
        stepped = self.rows if rows is None else rows
        if self._holding(stepped, self.plan.stall_prompt):
            self.stalls += 1
            self.plan.released.wait()  # never set while serving: the engine thread is stuck here
        for prompt in (self.plan.step_prompt, self.plan.engine_prompt):
            if self._holding(stepped, prompt):
                raise InjectedFault(f"injected fault for the prompt {prompt!r}")
        return super().step(rows)

    def drop(self, tag: Any) -> bool:
        if self._holding([row for row in self.rows if row.tag is tag], self.plan.engine_prompt):
            raise InjectedFault(f"injected fault while dropping the prompt {self.plan.engine_prompt!r}")
        return super().drop(tag)
