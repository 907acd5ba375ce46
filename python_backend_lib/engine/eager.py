"""The eager decoder pass: every row's pending tokens at once, through the attention backend.

The CPU's only path; on a GPU, the path of prompts longer than the graphs feed
one token a step (previous text) and of batches beyond the largest graph. It
waits for the device: the logits are read on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.engine.attention import AttentionBackend, StepLayout
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.rows import Row


@dataclass(frozen=True)
class EagerPass:
    """What a pass gives the rows it fed.

    logits: [rows, vocab] raw logits at each row's last new token.
    fresh: the indexes of the rows that fed <|startoftranscript|> in it, and for
        those rows: no_speech, the no-speech probability there, and languages,
        their likeliest language (an index among the language tokens) with its
        probability (None on English-only checkpoints).
    """

    logits: torch.Tensor
    fresh: list[int]
    no_speech: list[float]
    languages: list[tuple[int, float]] | None


def eager_pass(model: Whisper, config: ModelConfig, attention: AttentionBackend, rows: Sequence[Row]) -> EagerPass:
    """Feed every row's pending tokens (they leave `pending` for the cache)."""
    device = next(model.parameters()).device
    layout = StepLayout(
        slots=torch.tensor([r.slot for r in rows], device=device),
        query_lens=tuple(len(r.pending) for r in rows),
        cached_lens=tuple(r.cached for r in rows),
        slot_ids=tuple(r.slot for r in rows),
    )
    tokens = torch.tensor([t for r in rows for t in r.pending], device=device)
    last = layout.last_token_index(device)
    # Rows that feed <|startoftranscript|> now also need the logits there
    # (no-speech probability, language detection).
    fresh = [i for i, r in enumerate(rows) if not r.prefilled]
    starts = [sum(layout.query_lens[:i]) + rows[i].prompt.sot_index - rows[i].cached for i in fresh]
    index = torch.cat([last, torch.tensor(starts, device=device, dtype=last.dtype)])
    logits = model.decode_step(tokens, layout, attention, index)
    logits, sot_logits = logits[: len(rows)], logits[len(rows) :]
    for row in rows:
        row.cached += len(row.pending)
        row.pending = []
    special = config.special
    no_speech = sot_logits.float().softmax(dim=-1)[:, special.nospeech].tolist() if fresh else []
    languages = None
    if config.multilingual and fresh:
        best = sot_logits[:, list(special.language_tokens)].float().softmax(dim=-1).max(dim=-1)
        languages = list(zip(best.indices.tolist(), best.values.tolist()))
    return EagerPass(logits, fresh, no_speech, languages)
