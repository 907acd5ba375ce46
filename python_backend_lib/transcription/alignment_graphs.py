"""The word alignment's decoder passes captured as CUDA graphs, one per fixed shape.

On a GPU every alignment pass takes one of a few shapes (`alignment.pass_shapes`), so
that a window gets the same bits alone and in company. The same fixed shapes let each
be captured once: an eager pass is several hundred launches on the engine thread, paid
while the running batch waits; a replay is one. A captured pass reads the windows' K/V
from their kept KV slots (the pool's tensors never move), which is how the engine's
windows come; a window encoded again from its features takes the eager pass.

Static buffers per shape (rows, length): the token ids [rows, length], the token each
position predicts [rows, length] and each row's slot [rows], filled from pinned host
memory. The outputs (`alignment.PassScores`) live in the graphs' private pool and are
rewritten by the next replay of the same shape: the caller reads them first, on the
engine thread, before it aligns anything else. Only that thread replays: a kept slot
holds its window only while the window's callback runs there (`Engine.submit`'s
keep_audio), and only passes over kept slots are replayed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.devices.graph_capture import CapturedGraph, capture_graphs
from python_backend_lib.devices.transfers import pinned
from python_backend_lib.engine.kv_cache import KVSlotPool
from python_backend_lib.engine.model import Whisper
from python_backend_lib.transcription.alignment import PassScores, pass_shapes, slot_rows, teacher_forced_pass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Buffers:
    ids: torch.Tensor  # [rows, length]
    following: torch.Tensor  # [rows, length]
    slots: torch.Tensor  # [rows]


def captured_passes(model: Whisper, config: ModelConfig, pool: KVSlotPool) -> AlignmentGraphs | None:
    """Every fixed shape's pass captured, or None where capturing failed (out of device
    memory, say), with a warning that names why: the eager passes give the same words,
    only at a higher cost to the engine thread, so a server still starts."""
    graphs = AlignmentGraphs(model, config, pool)
    try:
        graphs.capture()
    except RuntimeError as error:
        log.warning("word alignments run eagerly: capturing their passes failed: %s", error)
        return None
    return graphs


class AlignmentGraphs:
    def __init__(self, model: Whisper, config: ModelConfig, pool: KVSlotPool) -> None:
        self.model = model
        self.config = config
        self.pool = pool
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.rows = {length: rows for rows, length in pass_shapes(config)}  # length: rows
        self._graphs: dict[int, CapturedGraph[_Buffers, PassScores]] = {}
        self.capture_seconds = 0.0

    def fits(self, rows: int, length: int) -> bool:
        return self.rows.get(length) == rows and length in self._graphs

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every shape (`devices.graph_capture`; keyed by length, each with its rows)."""
        self._graphs, cost = capture_graphs(list(self.rows), self._buffers, self._forward, self.device)
        self.capture_seconds = cost.seconds
        shapes = ", ".join(f"{rows}x{length}" for length, rows in self.rows.items())
        log.info("captured %d alignment graphs (%s) in %.2f s, %.0f MiB",
                 len(self._graphs), shapes, cost.seconds, cost.bytes / 2**20)

    def _buffers(self, length: int) -> _Buffers:
        rows = self.rows[length]
        eot = self.config.special.eot
        zeros = torch.zeros(rows, length, dtype=torch.long, device=self.device)
        # Until the first run, a pass of <|endoftext|> rows over the scratch slot 0.
        return _Buffers(zeros + eot, zeros.clone(), torch.zeros(rows, dtype=torch.long, device=self.device))

    def _forward(self, buffers: _Buffers) -> PassScores:
        audio = [(slot_rows(k, buffers.slots, self.dtype), slot_rows(v, buffers.slots, self.dtype))
                 for k, v in zip(self.pool.cross_k, self.pool.cross_v)]
        return teacher_forced_pass(self.model, self.config, audio, buffers.ids, buffers.following)

    @torch.inference_mode()
    def run(
        self, ids: torch.Tensor, following: torch.Tensor, slots: Sequence[int], *, replay: bool = True
    ) -> PassScores:
        """The pass over ids and following ([rows, length] on the host, a captured shape),
        row r attending to the window in KV slot slots[r].

        replay=False launches the captured pass's kernels directly on the same buffers
        instead of replaying the graph: the same bits (tests check it)."""
        captured = self._graphs[ids.shape[1]]
        buffers = captured.buffers
        # From pinned memory, as the engine's own graphs are fed: no wait for the stream.
        buffers.ids.copy_(pinned(ids.numpy()), non_blocking=True)
        buffers.following.copy_(pinned(following.numpy()), non_blocking=True)
        buffers.slots.copy_(pinned(np.asarray(slots, dtype=np.int64)), non_blocking=True)
        return captured.replay() if replay else self._forward(buffers)
