"""The library's front door: audio in, transcript out.

`Pipeline.load` puts a checkpoint on a device with its attention backend, KV
slot pool and engine; `transcribe` takes audio bytes or a 16 kHz waveform of
any length and returns a typed `Transcript`; `decode` returns the model's raw
result for one 30 s window. `start` is the served path's half: log-mel in, a
`DecodedRecording` out, which `assemble` (here, or in the `postprocessing`
model) makes a transcript. The Triton `whisper` model uses the same engine and
the same assembly, so served results equal these.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Callable, Sequence

import numpy as np
import torch

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.feature_graphs import FeatureGraphs
from python_backend_lib.audio.features import features_for_many, window_features
from python_backend_lib.checkpoints.configs import DEFAULT_SOURCE
from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core.decoded import DecodedRecording
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.core.options import DecodingOptions, DecodingResult, TranscribeOptions
from python_backend_lib.devices.placement import on_device
from python_backend_lib.engine.loading import (
    AttentionBackendName,
    EngineSetup,
    LoadTimes,
    build_batch,
    default_device,
    default_dtype,
)
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.scheduler import Engine, EngineOptions
from python_backend_lib.text.tokenizer import Tokenizer, load_tokenizer
from python_backend_lib.text.transcript import Transcript, assemble
from python_backend_lib.transcription.alignment import Aligner
from python_backend_lib.transcription.alignment_graphs import AlignmentGraphs, captured_passes
from python_backend_lib.transcription.alignment_rounds import AlignmentRounds
from python_backend_lib.transcription.longform import LongFormJob

log = logging.getLogger(__name__)


def aligns(config: ModelConfig, tokenizer: Tokenizer | None) -> bool:
    """Whether the checkpoint can give word timestamps: its alignment heads and tokenizer."""
    return tokenizer is not None and bool(config.alignment_heads)


class Pipeline:
    def __init__(
        self, model: Whisper, config: ModelConfig, tokenizer: Tokenizer | None, engine: Engine,
        alignment_graphs: AlignmentGraphs | None = None,
    ) -> None:
        self.model = model
        # Fixed once the engine's graphs are captured on it; read for every request,
        # where walking the model's parameters to find it would cost the interpreter lock.
        self.device: torch.device = next(model.parameters()).device
        self.config = config
        self.tokenizer = tokenizer
        self.engine = engine
        self.aligner: Aligner | None = None
        if aligns(config, tokenizer):
            self.aligner = Aligner(model, config, tokenizer, engine.batch.pool, alignment_graphs)
        # The windows one engine step delivers are aligned together (`alignment_rounds`).
        self.alignments = AlignmentRounds(self.aligner) if self.aligner else None
        if self.alignments is not None:
            engine.delivery_round = self.alignments.round
        self.attention_backend = AttentionBackendName.SDPA  # set by `load`
        self.load_times = LoadTimes()
        self.feature_graphs: FeatureGraphs | None = None  # captured log-mel passes (`load`, on a GPU)

    @classmethod
    def load(
        cls,
        source: str = DEFAULT_SOURCE,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        setup: EngineSetup = EngineSetup(),
        engine_options: EngineOptions = EngineOptions(),
        log_mel_graphs: bool = True,
    ) -> Pipeline:
        """Load `source` on `device` (default: the first GPU, else the CPU) as `setup`
        says; `load_times` and `attention_backend` say how it went.

        log_mel_graphs: on the GPU engine, capture the log-mel's replays for `features`;
        False where the log-mels come from elsewhere (the served whisper model's).
        """
        device = torch.device(device) if device is not None else default_device()
        dtype = dtype or default_dtype(device, setup.quantization)
        times = LoadTimes()
        start = time.perf_counter()
        checkpoint = load_checkpoint(source)
        times.timed("checkpoint", start)
        with on_device(device):
            loaded = build_batch(checkpoint, device, dtype, setup, times)
            config = checkpoint.config
            tokenizer = load_tokenizer(config) if config.tokenizer_path else None
            engine = Engine(loaded.batch, config, tokenizer, engine_options)
            alignment_graphs = None
            if loaded.backend is AttentionBackendName.FLASHINFER_GRAPHS and aligns(config, tokenizer):
                start = time.perf_counter()  # word alignments replayed too
                alignment_graphs = captured_passes(loaded.batch.model, config, loaded.batch.pool)
                times.timed("alignment_graphs", start)
            pipeline = cls(loaded.batch.model, config, tokenizer, engine, alignment_graphs)
            pipeline.attention_backend = loaded.backend
            if log_mel_graphs and loaded.backend is AttentionBackendName.FLASHINFER_GRAPHS:  # captured log-mel too
                start = time.perf_counter()
                pipeline.feature_graphs = FeatureGraphs(config.dims.n_mels, device)
                pipeline.feature_graphs.capture()
                times.timed("feature_graphs", start)
        pipeline.load_times = times
        log.info("loaded %s on %s with %s: %s", source, device, loaded.backend.value, times.describe())
        return pipeline

    @property
    def n_mels(self) -> int:
        return self.config.dims.n_mels

    def decode(
        self, waveforms: Sequence[np.ndarray], options: DecodingOptions | Sequence[DecodingOptions]
    ) -> list[DecodingResult]:
        """Decode the first 30 s window of each waveform, all in one batch: the
        model's raw output, without fallback or long-form seeking."""
        if isinstance(options, DecodingOptions):
            options = [options] * len(waveforms)
        futures: list[Future[DecodingResult]] = []
        for waveform, window_options in zip(waveforms, options):
            future: Future[DecodingResult] = Future()
            self.engine.submit(
                window_features(waveform, self.n_mels), window_options, _settle(future)
            )
            futures.append(future)
        return [f.result() for f in futures]

    def submit(
        self,
        waveform: np.ndarray,
        options: TranscribeOptions,
        is_cancelled: Callable[[], bool] | None = None,
        *,
        features: torch.Tensor | None = None,
    ) -> Future[Transcript]:
        """Queue a recording of any length (16 kHz mono) for transcription; its
        log-mel is computed here unless `features` (from `features`) are given."""
        if features is None:
            (features,) = self.features([waveform])
        future: Future[Transcript] = Future()
        self.start(features, len(waveform), options, _settle(future, self.assemble), is_cancelled)
        return future

    def submit_decoded(
        self, features: torch.Tensor, samples: int, options: TranscribeOptions
    ) -> Future[DecodedRecording]:
        """`start`, with a future for the `DecodedRecording` (what the served whisper model answers)."""
        future: Future[DecodedRecording] = Future()
        self.start(features, samples, options, _settle(future))
        return future

    def features(self, waveforms: Sequence[np.ndarray | torch.Tensor]) -> list[torch.Tensor]:
        """The log-mel of 16 kHz waveforms, on the engine's device, computed together
        (`features_for_many`, or its captured replay on the GPU engine) and without
        waiting for the device: the engine's thread uses them later, in stream order."""
        if self.feature_graphs is not None:
            return self.feature_graphs.features(waveforms)
        with on_device(self.device):
            return features_for_many(waveforms, self.n_mels, self.device)

    def start(
        self,
        features: torch.Tensor,
        samples: int,
        options: TranscribeOptions,
        on_done: Callable[[DecodedRecording | BaseException], None],
        is_cancelled: Callable[[], bool] | None = None,
        on_progress: Callable[[DecodedRecording], None] | None = None,
    ) -> None:
        """Start decoding a recording of `samples` samples from its log-mel on the
        engine's device (`features`, whole or `without_padding`); `on_done` gets its
        `DecodedRecording` or the error, on the engine thread (`assemble` makes the
        transcript), and `on_progress`, if given, the windows decoded so far whenever
        more of them are settled (`LongFormJob`). Raises RequestError at once for
        options that do not fit the checkpoint.
        """
        if self.tokenizer is None:
            raise RequestError(f"checkpoint {self.config.source!r} has no tokenizer: it can decode but not transcribe")
        with on_device(self.device):  # the job reads the features and cuts its first windows here
            LongFormJob(
                self.engine.submit,
                self.config,
                self.tokenizer,
                features,
                samples,
                options,
                on_done,
                is_cancelled,
                self.alignments.align if self.alignments else None,
                on_progress,
            ).start()

    def assemble(self, recording: DecodedRecording) -> Transcript:
        """The transcript of a decoded recording (`text.transcript.assemble`)."""
        return assemble(recording, self.tokenizer)

    def transcribe(
        self, data: bytes | np.ndarray, options: TranscribeOptions | DecodingOptions = TranscribeOptions()
    ) -> Transcript:
        """Transcribe audio file bytes or a 16 kHz mono float32 waveform, any length."""
        return self.transcribe_many([data], options)[0]

    def transcribe_many(
        self,
        recordings: Sequence[bytes | np.ndarray],
        options: TranscribeOptions | DecodingOptions | Sequence[TranscribeOptions],
    ) -> list[Transcript]:
        """Transcribe several recordings; their windows share the engine's batch."""
        if isinstance(options, DecodingOptions):
            options = TranscribeOptions(decoding=options)
        if isinstance(options, TranscribeOptions):
            options = [options] * len(recordings)
        waveforms = [decode_audio(r) if isinstance(r, (bytes, bytearray)) else r for r in recordings]
        futures = []
        features = self.features(waveforms)
        with self.engine.together():  # their first windows encode in one pass, not the first alone
            for waveform, recording_features, recording_options in zip(waveforms, features, options):
                future: Future[Transcript] = Future()
                self.start(recording_features, len(waveform), recording_options, _settle(future, self.assemble))
                futures.append(future)
        return [f.result() for f in futures]

    def close(self) -> None:
        self.engine.close()


def _settle(future: Future, finish: Callable[[object], object] = lambda outcome: outcome) -> Callable[[object], None]:
    """An engine callback that completes `future` with `finish` of a result, or an exception."""

    def on_done(outcome: object) -> None:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
            return
        try:
            future.set_result(finish(outcome))
        except Exception as error:
            future.set_exception(error)

    return on_done
