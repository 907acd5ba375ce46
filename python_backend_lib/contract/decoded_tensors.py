"""A `DecodedRecording` as the numeric tensors that carry it from `whisper` to `postprocessing`.

`whisper` writes the record (`to_tensors`) and `postprocessing` reads it back
(`from_tensors`), exactly: token ids as int32, every statistic as float64 (the
value the library computed, to the last bit). A client may call `postprocessing`
directly, with tensors of its own, so reading checks every shape and value and
refuses what does not hold together with a `RequestError` naming it.

TOKENS       INT32 [n]         every accepted window's tokens, window after window
WINDOWS      FP64  [w, 10]     a row per window, its columns in `WINDOW_COLUMNS`
ALIGNMENT    FP64  [k, 2]      word timestamps: for each window that has them, its
                               text tokens' (start, probability), then (end of the
                               last, NaN); seconds from the window's start
LANGUAGE     INT32 [1]         the language's index in `core.languages`, -1: none
LANGUAGE_PROBABILITY FP64 [1]  of its detection; NaN: not detected
SAMPLES      INT64 [1]         the recording's length (from `preprocessing`)

No torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from python_backend_lib.contract import tensor_names
from python_backend_lib.core.decoded import DecodedRecording, DecodedWindow
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.languages import LANGUAGE_CODES

# WINDOWS' columns, in order. Counts, frames and flags are whole numbers (exact in float64).
WINDOW_COLUMNS = (
    "tokens",  # how many of TOKENS are this window's
    "seek",
    "frames",
    "temperature",
    "avg_logprob",
    "compression_ratio",
    "no_speech_prob",
    "silent",  # 1: skipped as silent
    "closes_chunk",  # 1: reaches its chunk's end
    "aligned",  # how many rows of ALIGNMENT are this window's (0: no word timestamps)
)
COLUMN = {name: i for i, name in enumerate(WINDOW_COLUMNS)}
NO_LANGUAGE = -1


@dataclass(frozen=True)
class DecodedTensors:
    """The arrays of one request, each without the batch dimension."""

    tokens: np.ndarray
    windows: np.ndarray
    alignment: np.ndarray
    language: np.ndarray
    language_probability: np.ndarray

    def by_name(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, field) for field, name in TENSOR_OF_FIELD.items()}

    @classmethod
    def of(cls, array: Callable[[str], np.ndarray]) -> DecodedTensors:
        """The arrays `array` gives for each tensor's name (`by_name` the other way)."""
        return cls(**{field: array(name) for field, name in TENSOR_OF_FIELD.items()})


# Each field's Triton tensor: what `whisper` writes and `postprocessing` reads.
TENSOR_OF_FIELD = {
    "tokens": tensor_names.TOKENS,
    "windows": tensor_names.WINDOWS,
    "alignment": tensor_names.ALIGNMENT,
    "language": tensor_names.LANGUAGE,
    "language_probability": tensor_names.LANGUAGE_PROBABILITY,
}


def to_tensors(recording: DecodedRecording) -> DecodedTensors:
    rows, tokens, alignment = [], [], []
    for window in recording.windows:
        aligned = [*zip(window.token_times, window.token_probabilities), (window.token_times[-1], math.nan)] if (
            window.token_times
        ) else []
        rows.append([
            len(window.tokens), window.seek, window.frames, window.temperature, window.avg_logprob,
            window.compression_ratio, window.no_speech_prob, window.silent, window.closes_chunk, len(aligned),
        ])  # fmt: skip
        tokens.extend(window.tokens)
        alignment.extend(aligned)
    language = NO_LANGUAGE if recording.language is None else LANGUAGE_CODES.index(recording.language)
    probability = math.nan if recording.language_probability is None else recording.language_probability
    return DecodedTensors(
        tokens=np.array(tokens, dtype=np.int32),
        windows=np.array(rows, dtype=np.float64).reshape(len(rows), len(WINDOW_COLUMNS)),
        alignment=np.array(alignment, dtype=np.float64).reshape(len(alignment), 2),
        language=np.array([language], dtype=np.int32),
        language_probability=np.array([probability], dtype=np.float64),
    )


def from_tensors(tensors: DecodedTensors, samples: int) -> DecodedRecording:
    """The record the tensors carry; RequestError for tensors that do not hold together."""
    windows, tokens, alignment = tensors.windows, tensors.tokens, tensors.alignment
    _expect(windows.ndim == 2 and windows.shape[1] == len(WINDOW_COLUMNS), tensor_names.WINDOWS,
            f"[windows, {len(WINDOW_COLUMNS)}]", windows)
    _expect(tokens.ndim == 1, tensor_names.TOKENS, "[tokens]", tokens)
    _expect(alignment.ndim == 2 and alignment.shape[1] == 2, tensor_names.ALIGNMENT, "[rows, 2]", alignment)
    _expect(tensors.language.shape == (1,), tensor_names.LANGUAGE, "[1]", tensors.language)
    _expect(tensors.language_probability.shape == (1,), tensor_names.LANGUAGE_PROBABILITY, "[1]",
            tensors.language_probability)
    if not np.isfinite(windows[:, [COLUMN["tokens"], COLUMN["seek"], COLUMN["frames"], COLUMN["aligned"]]]).all():
        raise RequestError(f"{tensor_names.WINDOWS} holds a count that is not a number")
    counts = windows[:, [COLUMN["tokens"], COLUMN["aligned"]]]
    if (counts < 0).any() or (counts != np.round(counts)).any():
        raise RequestError(f"{tensor_names.WINDOWS}'s token and alignment counts must be whole numbers of at least 0")
    if int(counts[:, 0].sum()) != len(tokens) or int(counts[:, 1].sum()) != len(alignment):
        raise RequestError(
            f"{tensor_names.WINDOWS} counts {int(counts[:, 0].sum())} tokens and {int(counts[:, 1].sum())} alignment "
            f"rows, but {tensor_names.TOKENS} has {len(tokens)} and {tensor_names.ALIGNMENT} {len(alignment)}"
        )
    decoded, token_at, aligned_at = [], 0, 0
    for row in windows:
        n_tokens, n_aligned = int(row[COLUMN["tokens"]]), int(row[COLUMN["aligned"]])
        times = alignment[aligned_at : aligned_at + n_aligned]
        decoded.append(DecodedWindow(
            tokens=tuple(int(t) for t in tokens[token_at : token_at + n_tokens]),
            seek=int(row[COLUMN["seek"]]),
            frames=int(row[COLUMN["frames"]]),
            temperature=float(row[COLUMN["temperature"]]),
            avg_logprob=float(row[COLUMN["avg_logprob"]]),
            compression_ratio=float(row[COLUMN["compression_ratio"]]),
            no_speech_prob=float(row[COLUMN["no_speech_prob"]]),
            silent=bool(row[COLUMN["silent"]]),
            closes_chunk=bool(row[COLUMN["closes_chunk"]]),
            token_times=tuple(float(t) for t in times[:, 0]),
            token_probabilities=tuple(float(p) for p in times[:-1, 1]),
        ))  # fmt: skip
        token_at, aligned_at = token_at + n_tokens, aligned_at + n_aligned
    return DecodedRecording(
        windows=tuple(decoded),
        samples=samples,
        language=_language(int(tensors.language[0])),
        language_probability=_probability(float(tensors.language_probability[0])),
    )


def _language(index: int) -> str | None:
    if index == NO_LANGUAGE:
        return None
    if not 0 <= index < len(LANGUAGE_CODES):
        raise RequestError(
            f"{tensor_names.LANGUAGE} must be a language's index, 0 to {len(LANGUAGE_CODES) - 1}, "
            f"or {NO_LANGUAGE} for none; got {index}"
        )
    return LANGUAGE_CODES[index]


def _probability(value: float) -> float | None:
    if math.isnan(value):
        return None
    if not 0.0 <= value <= 1.0:
        raise RequestError(f"{tensor_names.LANGUAGE_PROBABILITY} must be from 0 to 1, or NaN for none; got {value}")
    return value


def _expect(ok: bool, name: str, shape: str, array: np.ndarray) -> None:
    if not ok:
        raise RequestError(f"{name} must have the shape {shape}, got {list(array.shape)}")
