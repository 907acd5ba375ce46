"""Requests joining a decode batch: their slots, their encoded audio and their rows.

`join` takes what the scheduler admits at once, allocates a slot for each row a
request needs (one, or one per beam or sample), encodes every clip together (through
a captured encoder graph when one holds the batch), writes the cross-attention K/V
of each request's first slot and shares it with the rest of its group. The rows
come back in admission order, their prompts pending; `DecodeBatch` steps them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.devices.transfers import to_device
from python_backend_lib.engine import beams
from python_backend_lib.engine.attention import AttentionBackend
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.rows import Admission, Row, SilenceCheck, new_row, silence_flags

if TYPE_CHECKING:
    from python_backend_lib.engine.encoder_graphs import EncoderGraphs


def join(
    admissions: Sequence[Admission],
    model: Whisper,
    config: ModelConfig,
    attention: AttentionBackend,
    encoder_graphs: EncoderGraphs | None,
    stop: Callable[[], bool] | None = None,
) -> list[list[Row]]:
    """Each admission's rows (its beams or samples share one group), their audio encoded.

    A window that asked for the silence check (`content_frames`) carries it on its
    first row (`Row.silence`): the check runs on the device, and nothing here waits
    for it. When encoding fails (out of memory, say) the slots taken are freed again.
    The eager encoder stops between layers once `stop()` says so (`EncodingStopped`);
    a captured graph runs whole, its pass being short.
    """
    device = next(model.parameters()).device
    pool = attention.pool
    # Each clip to the device first (pinned or device features copy asynchronously), then stacked there.
    features = torch.stack([a.features.to(device, non_blocking=True) for a in admissions])
    silence = silence_flags([a.content_frames for a in admissions], features)
    mel = features.to(next(model.parameters()).dtype)
    slots: list[int] = []  # the requests' slots, one per row (beams and samples are rows too)
    try:
        slots += [pool.allocate() for a in admissions for _ in range(beams.rows_needed(a.options))]
        owned = beams.owned_slots(slots, [a.options for a in admissions])
        heads = [own[0] for own in owned]
        if heads and encoder_graphs is not None and encoder_graphs.fits(len(heads)):
            encoder_graphs.run(mel, heads)
        else:
            audio = model.encode(mel, attention, stop)
            pool.write_cross(to_device(np.array(heads), device), model.cross_kv(audio))
        beams.share_audio(pool, owned)
    except BaseException:  # the slots hold nothing yet
        for slot in slots:
            pool.release(slot)
        raise
    joined = []
    for i, (admission, own) in enumerate(zip(admissions, owned)):
        rows = [new_row(admission, slot, config, stream) for stream, slot in enumerate(own)]
        beams.form_group(admission.tag, rows, admission.options)
        if admission.content_frames is not None:  # one check answers for the group
            rows[0].silence = SilenceCheck(silence, i)
        joined.append(rows)
    return joined
