"""Word timestamps from cross-attention and dynamic time warping.

Some of Whisper's cross-attention heads (the checkpoint's "alignment heads")
look at the audio frame being spoken. For a decoded window we re-run the
decoder once, teacher-forced over `<|startoftranscript|> ... <|notimestamps|>
text <|endoftext|>`, record those heads' attention, smooth it, and find the
monotonic token-to-frame path of least cost (DTW). A word starts where the
path reaches its first token. This costs one extra encoder and decoder pass,
paid only by requests that ask for word timestamps; everything else keeps the
fast attention path. It runs in the engine's callback, on the engine thread, so
the running batch's next step waits for it.
"""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from python_backend_lib.core import geometry
from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.core.options import Task
from python_backend_lib.core.segments import Segment, Word
from python_backend_lib.engine.attention import StepLayout, sdpa_encoder_attention
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.prompt import transcript_prefix
from python_backend_lib.text.tokenizer import Tokenizer

MEDIAN_FILTER_WIDTH = 7  # positions of 20 ms
# DTW lets the first word after a pause begin anywhere in the silence before it.
# Such a word is cut to WORD_AFTER_PAUSE_MEDIANS times the window's median word
# duration (that median taken as at most MAX_MEDIAN_WORD_S), the length
# openai-whisper cuts it to; a segment's first word follows a pause when it ends
# more than PAUSE_MEDIANS median words after the previous segment's last word
# (or the window's start).
MAX_MEDIAN_WORD_S = 0.7
WORD_AFTER_PAUSE_MEDIANS = 2
PAUSE_MEDIANS = 4
# Punctuation joins the neighbouring word instead of getting a time of its own.
LEADING_PUNCTUATION = "\"'“¿([{-"
TRAILING_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"


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

    @torch.inference_mode()
    def add_words(
        self,
        segments: tuple[Segment, ...],
        features: torch.Tensor,
        content_frames: int,
        offset: float,
        language: str | None,
        task: Task,
    ) -> tuple[Segment, ...]:
        """Give one window's segments their words. features: [n_mels, 3000];
        offset: the window's start in seconds."""
        eot = self.config.special.eot
        per_segment = [[t for t in s.tokens if t < eot] for s in segments]
        text_tokens = [t for tokens in per_segment for t in tokens]
        if not text_tokens or not self.config.alignment_heads:
            return segments
        starts, probabilities = self.token_starts(features, text_tokens, content_frames, language, task)
        words = iter(timed_words(self.tokenizer, text_tokens, starts, probabilities, offset))
        grouped, pending = [], next(words, None)
        for tokens in per_segment:
            mine, remaining = [], len(tokens)
            while pending is not None and remaining > 0:
                word, n_tokens = pending
                mine.append(word)
                remaining -= n_tokens
                pending = next(words, None)
            grouped.append(mine)
        grouped = shorten_words_after_pauses(grouped, offset)
        return tuple(dataclasses.replace(segment, words=tuple(mine)) for segment, mine in zip(segments, grouped))

    @torch.inference_mode()
    def token_starts(
        self, features: torch.Tensor, text_tokens: list[int], content_frames: int, language: str | None, task: Task
    ) -> tuple[np.ndarray, list[float]]:
        """When each text token starts (seconds into the window), plus one more
        entry for the end of the last token; and each token's probability."""
        special = self.config.special
        # Through <|notimestamps|>, whose position predicts the first text token.
        prompt = transcript_prefix(self.config, language or "en", task, timestamps=False)
        sequence = [*prompt, *text_tokens, special.eot]
        first = len(prompt) - 1  # the position that predicts text_tokens[0]
        device = next(self.model.parameters()).device
        dtype = next(self.model.parameters()).dtype

        audio_features = self.model.encode(features[None].to(device, dtype), _RecordingAttention([], set()))
        heads = self.config.alignment_heads
        recorder = _RecordingAttention(self.model.cross_kv(audio_features), {layer for layer, _ in heads})
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


def shorten_words_after_pauses(segments: list[list[Word]], window_start: float) -> list[list[Word]]:
    """The words of one window's segments, the first word of a segment that
    follows a pause cut to WORD_AFTER_PAUSE_MEDIANS median words (its end
    stays). Only segment openings: inside a segment a long word is as likely
    to hold the silence after it as the one before."""
    durations = [w.end - w.start for words in segments for w in words if w.end > w.start]
    if not durations:
        return segments
    median = min(MAX_MEDIAN_WORD_S, float(np.median(durations)))
    longest = WORD_AFTER_PAUSE_MEDIANS * median
    result, last_speech = [], window_start
    for words in segments:
        if words:
            first = words[0]
            if first.end - last_speech > PAUSE_MEDIANS * median and first.end - first.start > longest:
                words = [dataclasses.replace(first, start=round(first.end - longest, 3)), *words[1:]]
            last_speech = words[-1].end
        result.append(words)
    return result


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


def split_words(tokenizer: Tokenizer, tokens: list[int]) -> list[tuple[str, list[int]]]:
    """Group text tokens into words: a word starts at a token that begins with a
    space or is punctuation; tokens that only complete a multi-byte character
    stay with the one they complete."""
    pieces: list[tuple[str, list[int]]] = []
    current: list[int] = []
    for token in tokens:
        current.append(token)
        text = tokenizer.decode(current)
        if "\ufffd" not in text:
            pieces.append((text, current))
            current = []
    words: list[tuple[str, list[int]]] = []
    for text, piece in pieces:
        if text.startswith(" ") or text.strip() in string.punctuation or not words:
            words.append((text, list(piece)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + piece)
    return words


def timed_words(
    tokenizer: Tokenizer, text_tokens: list[int], starts: np.ndarray, probabilities: list[float], offset: float
) -> list[tuple[Word, int]]:
    """Words with times and mean token probability, and how many tokens each
    covers (punctuation merged into a neighbour brings its tokens along)."""
    grouped = split_words(tokenizer, text_tokens)
    bounds = np.cumsum([0] + [len(tokens) for _, tokens in grouped])
    rows = [
        [
            text,
            float(starts[bounds[k]]),
            float(starts[bounds[k + 1]]),
            float(np.mean(probabilities[bounds[k] : bounds[k + 1]])),
            len(tokens),
        ]
        for k, (text, tokens) in enumerate(grouped)
    ]
    return [
        (Word(text, round(offset + start, 3), round(offset + end, 3), round(p, 4)), n)
        for text, start, end, p, n in merge_punctuation(rows)
    ]


def merge_punctuation(rows: list[list]) -> list[list]:
    """Attach opening punctuation to the next word and closing punctuation to
    the previous one; the word keeps its own times. Rows: [text, start, end,
    probability, n_tokens]."""
    merged: list[list] = []
    opening: list | None = None
    for row in rows:
        stripped = row[0].strip()
        if stripped and merged and all(c in TRAILING_PUNCTUATION for c in stripped):
            merged[-1][0] += stripped
            merged[-1][4] += row[4]
        elif stripped and all(c in LEADING_PUNCTUATION for c in stripped):
            opening = row if opening is None else [opening[0] + row[0], *opening[1:4], opening[4] + row[4]]
        else:
            if opening is not None:
                row = [opening[0] + row[0].lstrip(), row[1], row[2], row[3], opening[4] + row[4]]
                opening = None
            merged.append(row)
    if opening is not None:
        merged.append(opening)
    return merged
