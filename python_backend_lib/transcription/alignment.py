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
slot (a caller that did not keep it) the window is encoded again. It runs on the
engine thread, so the running batch's next step waits for it: `align_many` aligns the
windows an engine step delivers together in one padded pass (`alignment_rounds`), so
that their launches and reads back to the host are paid once, not once a window; on a
GPU that pass is replayed from a CUDA graph (`alignment_graphs`), and the smoothing's
output is warped into times on the host (`time_warping`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

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
from python_backend_lib.transcription.time_warping import dynamic_time_warping_many, median_filter

MEDIAN_FILTER_WIDTH = 7  # positions of 20 ms
# Device memory one padded pass may take for what grows with its tokens (float32: every
# head's transient attention scores and weights, the alignment heads' kept, the logits
# and their reduction): windows beyond it go in another pass. A token of large-v3 takes
# about 0.9 MB, so a pass holds some 1,100 tokens (two or three long windows).
PASS_SCORE_BYTES = 1 << 30
# A pass's shape on a GPU: its sequences padded to the first of these lengths that holds
# the longest, its rows to PASS_ROWS (fewer where PASS_SCORE_BYTES says). cuBLAS picks its
# kernels by shape, so in passes shaped by their company a window's token times would
# differ with the windows aligned beside it, and with them where a long recording's next
# window starts. On the CPU a pass is its rows as they come, padded to the longest.
PASS_LENGTHS = (32, 64, 128, 256, 448)
PASS_ROWS = 8
# Each text token's start (seconds into the window) and the last one's end, then each
# token's probability: what `text.words` makes the words from.
Aligned = tuple[tuple[float, ...], tuple[float, ...]]


@dataclass(frozen=True)
class AlignmentRequest:
    """One decoded window to align: its segments, its audio (the engine's KV slot that
    decoded it, else its features [n_mels, 3000] to encode again), the frames that hold
    audio, and the language and task it was decoded with."""

    segments: tuple[Segment, ...]
    features: torch.Tensor | None
    content_frames: int
    language: str | None
    task: Task
    audio_slot: int | None = None


@dataclass(frozen=True)
class PassScores:
    """What one teacher-forced pass gives, on the device: each position's probability of
    the token it predicts [rows, tokens], and the alignment heads' scaled cross-attention
    scores [rows, heads, tokens, frames]."""

    chances: torch.Tensor
    scores: torch.Tensor


class CapturedPasses(Protocol):
    """Passes of fixed shapes replayed from CUDA graphs (`alignment_graphs`)."""

    def fits(self, rows: int, length: int) -> bool: ...

    def run(self, ids: torch.Tensor, following: torch.Tensor, slots: Sequence[int]) -> PassScores:
        """ids, following: [rows, length] on the host; slots: each row's kept KV slot."""
        ...


@dataclass(frozen=True)
class _Row:
    """One request's teacher-forced sequence in the padded pass."""

    request: int  # its index among the requests
    sequence: list[int]  # prompt, the text tokens that fit, <|endoftext|>
    first: int  # the position that predicts the first text token
    text: int  # text tokens aligned
    beyond: int  # text tokens past the context, not aligned


@dataclass(frozen=True)
class _Pass:
    """Rows aligned in one decoder pass of `count` rows of `length` tokens (the rows
    past these padding)."""

    rows: list[_Row]
    count: int
    length: int


class _RecordingAttention:
    """Plain attention over teacher-forced sequences of `length` tokens each, rows
    flattened, that keeps the alignment heads' scaled cross-attention scores:
    {(layer, head): [rows, tokens, frames]}. cross_kv: each layer's K and V of the rows'
    windows, [rows, frames, heads, head_dim]."""

    def __init__(
        self, cross_kv: list[tuple[torch.Tensor, torch.Tensor]], heads: Sequence[tuple[int, int]], length: int = 1
    ) -> None:
        self.cross_kv = cross_kv
        self.heads = heads
        self.length = length
        self.scores: dict[tuple[int, int], torch.Tensor] = {}
        self._later: torch.Tensor | None = None  # [length, length]: the positions after each one

    def encoder_attention(self, q, k, v):
        return sdpa_encoder_attention(q, k, v)

    def begin_step(self, layout: StepLayout) -> None:
        pass

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """[rows * length, heads, head_dim] -> [rows, heads, length, head_dim]"""
        return x.view(-1, self.length, *x.shape[1:]).transpose(1, 2)

    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, heads, length, head_dim] -> [rows * length, heads, head_dim]"""
        return x.transpose(1, 2).reshape(-1, *x.shape[1:2], x.shape[-1])

    def self_attention(self, layer: int, q, k, v):
        # Padding follows each row's tokens, so causal attention keeps it out of them.
        # Written out rather than through SDPA: on Hopper SDPA takes cuDNN's kernel, which
        # builds a plan for each new shape on the engine thread (docs/performance.md has
        # the profile that pointed at it), and choosing SDPA's kernels is process-wide.
        if self._later is None:
            self._later = torch.ones(self.length, self.length, dtype=torch.bool, device=q.device).triu(1)
        q, k, v = self._rows(q), self._rows(k), self._rows(v)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        return self._flat(scores.masked_fill(self._later, float("-inf")).softmax(dim=-1) @ v)

    def cross_attention(self, layer: int, q):
        keys, values = (t.transpose(1, 2) for t in self.cross_kv[layer])  # [rows, heads, frames, head_dim]
        scores = (self._rows(q).float() @ keys.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        for kept in self.heads:
            if kept[0] == layer:  # a copy: a view would hold every head's scores
                self.scores[kept] = scores[:, kept[1]].clone()
        weights = scores.softmax(dim=-1)  # [rows, heads, tokens, frames]
        return self._flat(weights.to(values.dtype) @ values)


@dataclass(frozen=True)
class Aligner:
    model: Whisper
    config: ModelConfig
    tokenizer: Tokenizer
    pool: KVSlotPool | None = None  # the engine's, whose kept slots hold windows' encoder K/V
    # On a GPU, the passes over kept slots replayed from CUDA graphs (None: launched eagerly).
    graphs: CapturedPasses | None = None

    def align(
        self,
        segments: tuple[Segment, ...],
        features: torch.Tensor | None,
        content_frames: int,
        language: str | None,
        task: Task,
        *,
        audio_slot: int | None = None,
    ) -> Aligned:
        """When each text token of one window's segments starts (seconds into the window),
        then when the last one ends, and each token's probability: what `text.words`
        makes the words from (`DecodedWindow.token_times`). The window is the pool's
        `audio_slot`, else encoded from `features` ([n_mels, 3000])."""
        return self.align_many([AlignmentRequest(segments, features, content_frames, language, task, audio_slot)])[0]

    @torch.inference_mode()
    def align_many(self, requests: Sequence[AlignmentRequest]) -> list[Aligned]:
        """`align` for several windows, in one teacher-forced decoder pass over their
        sequences padded together (each row its own window's K/V; `_passes` says how),
        with one read back to the host for the probabilities and one for the cost
        matrices; the time warping then runs on the host, a row at a time."""
        eot = self.config.special.eot
        texts = [[t for mine in text_tokens(r.segments, eot) for t in mine] for r in requests]
        aligned: list[Aligned] = [((), ())] * len(requests)
        rows = [self._row(i, requests[i], text) for i, text in enumerate(texts)
                if text and self.config.alignment_heads]
        if not rows:
            return aligned
        for a_pass in self._passes(rows, fixed_pass_shapes(next(self.model.parameters()).device)):
            for row, (starts, probabilities) in zip(a_pass.rows, self._token_starts(a_pass, requests)):
                aligned[row.request] = (tuple(float(t) for t in starts), tuple(probabilities))
        return aligned

    def _passes(self, rows: list[_Row], fixed: bool) -> list[_Pass]:
        """The rows in passes whose attention scores fit PASS_SCORE_BYTES (at least one row
        a pass), shortest sequences first so that a pass pads little. `fixed`: of the
        shapes PASS_LENGTHS and PASS_ROWS allow only."""
        dims = self.config.dims
        per_token = _bytes_per_token(self.config)
        passes: list[_Pass] = []
        for row in sorted(rows, key=lambda r: len(r.sequence)):
            length = len(row.sequence)
            if fixed:
                length = next((n for n in PASS_LENGTHS if n >= length), dims.n_text_ctx)
                count = pass_rows(self.config, length)
                if passes and passes[-1].length == length and len(passes[-1].rows) < count:
                    passes[-1] = _Pass([*passes[-1].rows, row], count, length)
                else:
                    passes.append(_Pass([row], count, length))
            elif passes and (len(passes[-1].rows) + 1) * length * per_token <= PASS_SCORE_BYTES:
                passes[-1] = _Pass([*passes[-1].rows, row], len(passes[-1].rows) + 1, length)
            else:
                passes.append(_Pass([row], 1, length))
        return passes

    def _row(self, index: int, request: AlignmentRequest, text: list[int]) -> _Row:
        # Through <|notimestamps|>, whose position predicts the first text token.
        prompt = transcript_prefix(self.config, request.language or "en", request.task, timestamps=False)
        # The length invariant: a window that filled the text context while decoding
        # (with a shorter prompt, timestamps among its tokens) may not fit behind this
        # prompt. The tokens past the context are not aligned: they start where the
        # last aligned one ends, with probability 0 (the model never weighed them).
        fits = min(len(text), self.config.dims.n_text_ctx - len(prompt) - 1)
        return _Row(index, [*prompt, *text[:fits], self.config.special.eot], len(prompt) - 1, fits, len(text) - fits)

    def window_audio(
        self, features: torch.Tensor | None, audio_slot: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's cross-attention K and V of the window, [1, 1500, heads, head_dim]."""
        return self.windows_audio([AlignmentRequest((), features, 0, None, Task.TRANSCRIBE, audio_slot)])

    @torch.inference_mode()
    def windows_audio(self, requests: Sequence[AlignmentRequest]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each decoder layer's cross-attention K and V of the requests' windows, [windows,
        1500, heads, head_dim]: gathered from their kept slots (an FP8 pool's cast back),
        or encoded again from their features."""
        parameter = next(self.model.parameters())
        kept = [i for i, r in enumerate(requests) if r.audio_slot is not None and self.pool is not None]
        again = [i for i in range(len(requests)) if i not in kept]
        if any(requests[i].features is None for i in again):
            raise ValueError("a window to align needs its features or its kept KV slot")
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        if kept:
            slots = torch.tensor([requests[i].audio_slot for i in kept], device=parameter.device)
            parts.append([(slot_rows(k, slots, parameter.dtype), slot_rows(v, slots, parameter.dtype))
                          for k, v in zip(self.pool.cross_k, self.pool.cross_v)])
        if again:
            mel = torch.stack([requests[i].features for i in again]).to(parameter.device, parameter.dtype)
            # On a GPU one window at a time: the convolutions' and GEMMs' kernels follow the
            # batch, so a window encoded beside others would get other bits (the fixed
            # shapes' reason). Encoding again is for callers that kept no slot: rare.
            batches = mel.split(1) if fixed_pass_shapes(parameter.device) else (mel,)
            encoded = [self.model.cross_kv(self.model.encode(b, _RecordingAttention([], ()))) for b in batches]
            parts.append([(torch.cat([e[layer][0] for e in encoded]), torch.cat([e[layer][1] for e in encoded]))
                          for layer in range(len(encoded[0]))])
        if len(parts) == 1:
            return parts[0]
        order = torch.tensor([*kept, *again]).argsort().to(parameter.device)  # back to the requests' order
        return [(torch.cat([a[0], b[0]]).index_select(0, order), torch.cat([a[1], b[1]]).index_select(0, order))
                for a, b in zip(*parts)]

    @torch.inference_mode()
    def token_starts(
        self, audio: list[tuple[torch.Tensor, torch.Tensor]], text_tokens: list[int], content_frames: int,
        language: str | None, task: Task,
    ) -> tuple[np.ndarray, list[float]]:
        """When each text token starts (seconds into the window), plus one more entry
        for the end of the last token; and each token's probability. audio: each decoder
        layer's cross-attention K and V of the window (`window_audio`)."""
        request = AlignmentRequest((), None, content_frames, language, task)
        row = self._row(0, request, list(text_tokens))
        return self._token_starts(_Pass([row], 1, len(row.sequence)), [request], audio)[0]

    @torch.inference_mode()
    def _token_starts(
        self, a_pass: _Pass, requests: Sequence[AlignmentRequest],
        audio: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[tuple[np.ndarray, list[float]]]:
        """When each of the pass's rows' text tokens start (seconds into its window), plus
        one more entry for the end of its last token; and each token's probability. audio:
        the rows' cross-attention K/V (default: `windows_audio` of their requests)."""
        device = next(self.model.parameters()).device
        rows, count, length = a_pass.rows, a_pass.count, a_pass.length
        eot = self.config.special.eot
        ids = torch.full((count, length), eot, dtype=torch.long)  # the padding rows: <|endoftext|> only
        following = torch.zeros(count, length, dtype=torch.long)  # the token each position predicts
        for r, row in enumerate(rows):
            ids[r, : len(row.sequence)] = torch.tensor(row.sequence)
            following[r, row.first : row.first + row.text] = torch.tensor(row.sequence[row.first + 1 : -1])
        slots = [requests[row.request].audio_slot for row in rows]
        if audio is None and self.graphs is not None and None not in slots and self.graphs.fits(count, length):
            scored = self.graphs.run(ids, following, [*slots, *[slots[0]] * (count - len(rows))])
        else:
            if audio is None:
                audio = self.windows_audio([requests[row.request] for row in rows])
            if count > len(rows):  # the padding rows attend to the first row's audio
                padded = torch.tensor([*range(len(rows)), *[0] * (count - len(rows))], device=device)
                audio = [(k.index_select(0, padded), v.index_select(0, padded)) for k, v in audio]
            scored = teacher_forced_pass(self.model, self.config, audio, ids.to(device), following.to(device))
        chances, scores = scored.chances.cpu(), scored.scores
        # Each row's cost matrix is made where its scores are: on the host, the median
        # filter alone would cost more than the decoder pass. One read back for them all.
        matrices = scores.new_zeros(len(rows), max(row.text for row in rows) + 1, scores.shape[-1])
        frames = [max(1, requests[row.request].content_frames // geometry.ENCODER_STRIDE) for row in rows]
        for r, row in enumerate(rows):
            # Attention over the frames that hold audio only: the padding must not
            # take probability away from them.
            weights = scores[r, :, : len(row.sequence), : frames[r]].softmax(dim=-1)
            std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
            weights = median_filter((weights - mean) / std, MEDIAN_FILTER_WIDTH)
            # Rows: the positions that predict each text token (<|notimestamps|> predicts
            # the first), then the last text token's position, which predicts the end.
            matrices[r, : row.text + 1, : frames[r]] = weights.mean(dim=0)[row.first : -1]
        matrices = matrices.cpu().double().numpy()
        paths = dynamic_time_warping_many([-matrices[r, : row.text + 1, : frames[r]] for r, row in enumerate(rows)])
        found = []
        for r, (row, (text_index, time_index)) in enumerate(zip(rows, paths)):
            probabilities = chances[r, row.first : row.first + row.text].tolist()
            jumps = np.pad(np.diff(text_index), (1, 0), constant_values=1).astype(bool)
            starts = time_index[jumps] * geometry.SECONDS_PER_POSITION
            if row.beyond:
                starts = np.concatenate([starts, np.full(row.beyond, starts[-1])])
                probabilities += [0.0] * row.beyond
            found.append((starts, probabilities))
        return found


def teacher_forced_pass(
    model: Whisper, config: ModelConfig, audio: list[tuple[torch.Tensor, torch.Tensor]],
    ids: torch.Tensor, following: torch.Tensor,
) -> PassScores:
    """One decoder pass over the rows' sequences ids [rows, length] (on the device), each
    row attending to its window's cross-attention K/V (`audio`, each layer's [rows, frames,
    heads, head_dim]); following: the token each position predicts (0 where none). What a
    captured pass records too (`alignment_graphs`)."""
    count, length = ids.shape
    heads = config.alignment_heads
    recorder = _RecordingAttention(audio, heads, length)
    layout = StepLayout(torch.zeros(count, dtype=torch.long, device=ids.device), (length,) * count, (0,) * count)
    logits = model.decode_step(ids.view(-1), layout, recorder, torch.arange(count * length, device=ids.device))
    # How sure the model was of each text token, as openai-whisper reports it: its
    # softmax over the text tokens, without a copy of them all.
    text_logits = logits.view(count, length, -1)[..., : config.special.eot]
    picked = text_logits.gather(-1, following[..., None])[..., 0]
    chances = (picked - text_logits.logsumexp(dim=-1)).exp()
    return PassScores(chances, torch.stack([recorder.scores[kept] for kept in heads], dim=1))


def pass_rows(config: ModelConfig, length: int) -> int:
    """The rows of a fixed-shape pass of `length` tokens: PASS_ROWS, fewer where their
    scores would pass PASS_SCORE_BYTES."""
    return max(1, min(PASS_ROWS, PASS_SCORE_BYTES // (length * _bytes_per_token(config))))


def pass_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """Every fixed shape a pass may take on a GPU: (rows, length)."""
    return [(pass_rows(config, length), length) for length in PASS_LENGTHS]


def _bytes_per_token(config: ModelConfig) -> int:
    """What grows with a pass's tokens, in float32: every head's transient attention scores
    and weights, the alignment heads' kept, the logits and their reduction."""
    dims = config.dims
    scores = (2 * dims.n_text_head + len(config.alignment_heads)) * dims.n_audio_ctx
    return (scores + 3 * dims.n_vocab) * 4


def fixed_pass_shapes(device: torch.device) -> bool:
    """Whether passes on `device` take only the shapes PASS_LENGTHS and PASS_ROWS allow."""
    return device.type == "cuda"


def slot_rows(t: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The slots' rows of a pool tensor in `dtype` (an FP8 one selected as its bytes)."""
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8).index_select(0, slots).view(t.dtype).to(dtype)
    return t.index_select(0, slots).to(dtype)
