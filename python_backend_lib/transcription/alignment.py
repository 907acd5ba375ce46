"""Word timestamps from cross-attention and dynamic time warping.

Some of Whisper's cross-attention heads (the checkpoint's "alignment heads")
look at the audio frame being spoken. For a decoded window we re-run the
decoder once, teacher-forced over `<|startoftranscript|> ... <|notimestamps|>
text <|endoftext|>`, record those heads' attention, smooth it, and find the
monotonic token-to-frame path of least cost (DTW): each text token starts
where the path reaches it. Words are made from those times by `text.words`,
wherever the transcript is written. This costs one extra decoder pass, paid only
by requests that ask for word timestamps; everything else keeps the fast attention
path. The window's cross-attention K/V are those its decoding used, still in its
KV slot while the result's callback runs (`Engine.submit`'s keep_audio); without a
slot (a caller that did not keep it) the window is encoded again. It runs in the
engine's callback, on the engine thread, so the running batch's next step waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from python_backend_lib.core import geometry
from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.core.options import Task
from python_backend_lib.core.segments import Segment
from python_backend_lib.engine.attention import StepLayout, sdpa_encoder_attention
from python_backend_lib.engine.kv_cache import KVSlotPool
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.prompt import transcript_prefix
from python_backend_lib.text.tokenizer import Tokenizer
from python_backend_lib.text.windows import text_tokens

MEDIAN_FILTER_WIDTH = 7  # positions of 20 ms
class _RecordingAttention:
    """Plain attention over one teacher-forced sequence that keeps the
    alignment heads' scaled cross-attention scores: {layer: [heads, tokens, frames]}."""

    def __init__(self, cross_kv: list[tuple[torch.Tensor, torch.Tensor]], layers: set[int]) -> None:
        self.cross_kv = cross_kv
        self.layers = layers
        self.scores: dict[int, torch.Tensor] = {}

    def encoder_attention(self, q, k, v):
        return sdpa_encoder_attention(q, k, v)

    def begin_step(self, layout: StepLayout) -> None:
        pass

    def self_attention(self, layer: int, q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)

    def cross_attention(self, layer: int, q):
        keys, values = (t[0].transpose(0, 1) for t in self.cross_kv[layer])  # [heads, frames, head_dim]
        scores = (q.transpose(0, 1).float() @ keys.float().transpose(1, 2)) * q.shape[-1] ** -0.5
        if layer in self.layers:
            self.scores[layer] = scores
        weights = scores.softmax(dim=-1)  # [heads, tokens, frames]
        return (weights.to(values.dtype) @ values).transpose(0, 1)


@dataclass(frozen=True)
class Aligner:
    model: Whisper
    config: ModelConfig
    tokenizer: Tokenizer
    pool: KVSlotPool | None = None  # the engine's, whose kept slots hold windows' encoder K/V

    @torch.inference_mode()
    def align(
        self,
        segments: tuple[Segment, ...],
        features: torch.Tensor | None,
        content_frames: int,
        language: str | None,
        task: Task,
        *,
        audio_slot: int | None = None,
    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """When each text token of one window's segments starts (seconds into the window),
        then when the last one ends, and each token's probability: what `text.words`
        makes the words from (`DecodedWindow.token_times`). The window is the pool's
        `audio_slot`, else encoded from `features` ([n_mels, 3000])."""
        tokens = [t for mine in text_tokens(segments, self.config.special.eot) for t in mine]
        if not tokens or not self.config.alignment_heads:
            return (), ()
        audio = self.window_audio(features, audio_slot)
        starts, probabilities = self.token_starts(audio, tokens, content_frames, language, task)
        return tuple(float(t) for t in starts), tuple(probabilities)

    def window_audio(
        self, features: torch.Tensor | None, audio_slot: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's cross-attention K and V of the window, [1, 1500, heads, head_dim]."""
        parameter = next(self.model.parameters())
        if audio_slot is not None and self.pool is not None:  # an FP8 pool's K/V cast back
            kept = slice(audio_slot, audio_slot + 1)
            return [(k[kept].to(parameter.dtype), v[kept].to(parameter.dtype))
                    for k, v in zip(self.pool.cross_k, self.pool.cross_v)]
        if features is None:
            raise ValueError("a window to align needs its features or its kept KV slot")
        audio_features = self.model.encode(features[None].to(parameter.device, parameter.dtype),
                                           _RecordingAttention([], set()))
        return self.model.cross_kv(audio_features)

    @torch.inference_mode()
    def token_starts(
        self, audio: list[tuple[torch.Tensor, torch.Tensor]], text_tokens: list[int], content_frames: int,
        language: str | None, task: Task,
    ) -> tuple[np.ndarray, list[float]]:
        """When each text token starts (seconds into the window), plus one more
        entry for the end of the last token; and each token's probability. audio:
        each decoder layer's cross-attention K and V of the window (`window_audio`)."""
        special = self.config.special
        # Through <|notimestamps|>, whose position predicts the first text token.
        prompt = transcript_prefix(self.config, language or "en", task, timestamps=False)
        # The length invariant: a window that filled the text context while decoding
        # (with a shorter prompt, timestamps among its tokens) may not fit behind this
        # prompt. The tokens past the context are not aligned: they start where the
        # last aligned one ends, with probability 0 (the model never weighed them).
        fits = self.config.dims.n_text_ctx - len(prompt) - 1
        if len(text_tokens) > fits:
            starts, probabilities = self.token_starts(audio, text_tokens[:fits], content_frames, language, task)
            beyond = len(text_tokens) - fits
            return np.concatenate([starts, np.full(beyond, starts[-1])]), probabilities + [0.0] * beyond
        sequence = [*prompt, *text_tokens, special.eot]
        first = len(prompt) - 1  # the position that predicts text_tokens[0]
        device = next(self.model.parameters()).device
        heads = self.config.alignment_heads
        recorder = _RecordingAttention(audio, {layer for layer, _ in heads})
        ids = torch.tensor(sequence, device=device)
        layout = StepLayout(torch.zeros(1, dtype=torch.long, device=device), (len(sequence),), (0,))
        logits = self.model.decode_step(ids, layout, recorder, torch.arange(len(sequence), device=device))

        # How sure the model was of each text token, as openai-whisper reports it.
        text_logits = logits[first : first + len(text_tokens), : special.eot].cpu()
        probabilities = text_logits.softmax(dim=-1)[torch.arange(len(text_tokens)), text_tokens].tolist()

        # Attention over the frames that hold audio only: the padding must not
        # take probability away from them.
        frames = max(1, content_frames // geometry.ENCODER_STRIDE)
        scores = torch.stack([recorder.scores[layer][head, :, :frames] for layer, head in heads])
        weights = scores.softmax(dim=-1)
        std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
        weights = median_filter((weights - mean) / std, MEDIAN_FILTER_WIDTH)
        # Rows: the positions that predict each text token (<|notimestamps|> predicts
        # the first), then the last text token's position, which predicts the end.
        matrix = weights.mean(dim=0)[first:-1]
        text_index, time_index = dynamic_time_warping(-matrix.double().cpu().numpy())
        jumps = np.pad(np.diff(text_index), (1, 0), constant_values=1).astype(bool)
        return time_index[jumps] * geometry.SECONDS_PER_POSITION, probabilities


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over the last axis in a sliding window of `width` (odd), edges reflected."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    rows = x.reshape(-1, 1, x.shape[-1])  # reflect padding wants [batch, channels, length]
    padded = F.pad(rows, (pad, pad), mode="reflect")[:, 0]
    return padded.unfold(-1, width, 1).median(dim=-1).values.reshape(x.shape)


def dynamic_time_warping(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through `cost` [rows, cols] from the top-left
    to the bottom-right corner, stepping down, right or diagonally. Returns the
    row and column index of each step.

    Each row is solved at once: going right accumulates cost, so the best way
    into cell j is min over k <= j of (best from above at k) + cost[k+1..j],
    a running minimum over a cumulative sum.
    """
    rows, cols = cost.shape
    total = np.full((rows + 1, cols + 1), np.inf)
    total[0, 0] = 0.0
    came_from = np.zeros((rows + 1, cols + 1), dtype=np.int8)  # 0 diagonal, 1 down, 2 right
    for i in range(1, rows + 1):
        diagonal, down = total[i - 1, :-1], total[i - 1, 1:]
        from_above = np.minimum(diagonal, down) + cost[i - 1]
        running = np.cumsum(cost[i - 1])
        entry = from_above - running
        best = np.minimum.accumulate(entry)
        total[i, 1:] = best + running
        moved_right = np.concatenate([[False], best[1:] < entry[1:]])
        came_from[i, 1:] = np.where(moved_right, 2, np.where(diagonal <= down, 0, 1))
    path_rows, path_cols = [], []
    i, j = rows, cols
    while i > 0 and j > 0:
        path_rows.append(i - 1)
        path_cols.append(j - 1)
        step = came_from[i, j]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    return np.array(path_rows[::-1]), np.array(path_cols[::-1])


