"""The library's front door: audio in, transcript out.

`Pipeline.load` puts a checkpoint on a device with its attention backend, KV
slot pool and engine; `transcribe` takes audio bytes or a 16 kHz waveform and
returns a typed `Transcript`. The Triton `whisper` model uses the same engine,
so served results equal these.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from . import audio
from .attention import SdpaAttention
from .decoding import DecodeBatch
from .engine import Engine, EngineOptions
from .kv_cache import KVSlotPool, PoolShape
from .model import Whisper
from .options import DecodingOptions, DecodingResult
from .tokenizer import Segment, Tokenizer, load_tokenizer
from .weights import DEFAULT_SOURCE, ModelConfig, load_checkpoint

DEFAULT_SLOTS = 16


@dataclass(frozen=True)
class Transcript:
    text: str
    segments: tuple[Segment, ...]
    language: str | None
    duration: float  # seconds of audio
    result: DecodingResult


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.float32


class Pipeline:
    def __init__(self, model: Whisper, config: ModelConfig, tokenizer: Tokenizer | None, engine: Engine) -> None:
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.engine = engine

    @classmethod
    def load(
        cls,
        source: str = DEFAULT_SOURCE,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        slots: int = DEFAULT_SLOTS,
        engine_options: EngineOptions = EngineOptions(),
    ) -> "Pipeline":
        device = torch.device(device) if device is not None else default_device()
        dtype = dtype or default_dtype(device)
        checkpoint = load_checkpoint(source)
        config = checkpoint.config
        model = Whisper.from_checkpoint(checkpoint, device=device, dtype=dtype)
        pool = KVSlotPool(PoolShape.for_model(config.dims, slots), device=device, dtype=dtype)
        batch = DecodeBatch(model, config, SdpaAttention(pool))
        tokenizer = load_tokenizer(config) if config.tokenizer_path else None
        return cls(model, config, tokenizer, Engine(batch, config, tokenizer, engine_options))

    @property
    def n_mels(self) -> int:
        return self.config.dims.n_mels

    def features(self, waveform: np.ndarray) -> torch.Tensor:
        return audio.window_features(waveform, self.n_mels)

    def submit(self, waveform: np.ndarray, options: DecodingOptions) -> "Future[Transcript]":
        """Queue one recording (at most 30 s, 16 kHz mono) for the engine."""
        future: Future[Transcript] = Future()
        duration = len(waveform) / audio.SAMPLE_RATE

        def on_done(outcome: DecodingResult | BaseException) -> None:
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(self.transcript(outcome, duration))

        self.engine.submit(self.features(waveform), options, on_done)
        return future

    def transcribe(self, data: bytes | np.ndarray, options: DecodingOptions = DecodingOptions()) -> Transcript:
        """Transcribe audio file bytes or a 16 kHz mono float32 waveform."""
        return self.transcribe_many([data], options)[0]

    def transcribe_many(
        self, recordings: Sequence[bytes | np.ndarray], options: DecodingOptions | Sequence[DecodingOptions]
    ) -> list[Transcript]:
        """Transcribe several recordings decoded together in one batch."""
        if isinstance(options, DecodingOptions):
            options = [options] * len(recordings)
        waveforms = [audio.decode_audio(r) if isinstance(r, (bytes, bytearray)) else r for r in recordings]
        futures = [self.submit(w, o) for w, o in zip(waveforms, options)]
        return [f.result() for f in futures]

    def transcript(self, result: DecodingResult, duration: float) -> Transcript:
        """Text and segments of a decoding result (the same functions the served
        postprocessing model uses)."""
        if self.tokenizer is None:
            return Transcript("", (), result.language, duration, result)
        return make_transcript(self.tokenizer, result, duration)

    def close(self) -> None:
        self.engine.close()


def make_transcript(tokenizer: Tokenizer, result: DecodingResult, duration: float) -> Transcript:
    return Transcript(
        text=tokenizer.decode(result.tokens).strip(),
        segments=tokenizer.segments(result.tokens, duration),
        language=result.language,
        duration=duration,
        result=result,
    )
