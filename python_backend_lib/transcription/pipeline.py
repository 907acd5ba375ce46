"""The library's front door: audio in, transcript out.

`Pipeline.load` puts a checkpoint on a device with its attention backend, KV
slot pool and engine; `transcribe` takes audio bytes or a 16 kHz waveform of
any length and returns a typed `Transcript`; `decode` returns the model's raw
result for one 30 s window. The Triton `whisper` model uses the same engine,
so served results equal these.
"""

from __future__ import annotations

import enum
import logging
from concurrent.futures import Future
from typing import Callable, Sequence

import numpy as np
import torch

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.features import features_for, window_features
from python_backend_lib.checkpoints.weights import DEFAULT_SOURCE, ModelConfig, load_checkpoint
from python_backend_lib.core import geometry
from python_backend_lib.core.options import DecodingOptions, DecodingResult
from python_backend_lib.engine.attention import SdpaAttention
from python_backend_lib.engine.decoding import DecodeBatch
from python_backend_lib.engine.kv_cache import KVSlotPool, PoolShape, slots_for_memory
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.scheduler import Engine, EngineOptions
from python_backend_lib.text.tokenizer import Tokenizer, load_tokenizer
from python_backend_lib.transcription.alignment import Aligner
from python_backend_lib.transcription.longform import LongFormJob, TranscribeOptions, Transcript

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 16  # on the CPU
# On a GPU the KV pool takes this share of the memory left free once the
# weights are loaded, up to MAX_GPU_SLOTS requests decoded together.
DEFAULT_KV_MEMORY_FRACTION = 0.5
MAX_GPU_SLOTS = 256


class AttentionKind(str, enum.Enum):
    AUTO = "auto"  # FlashInfer on a CUDA device when flashinfer is installed, else SDPA
    SDPA = "sdpa"
    FLASHINFER = "flashinfer"


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
        has_heads = tokenizer is not None and bool(config.alignment_heads)
        self.aligner = Aligner(model, config, tokenizer) if has_heads else None

    @classmethod
    def load(
        cls,
        source: str = DEFAULT_SOURCE,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        slots: int | None = None,
        engine_options: EngineOptions = EngineOptions(),
        attention: AttentionKind = AttentionKind.AUTO,
        cuda_graphs: bool = True,
        kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION,
    ) -> "Pipeline":
        """slots: requests decoded together (KV slots); None: DEFAULT_SLOTS on
        the CPU, on a GPU as many as `kv_memory_fraction` of the free memory
        holds (at most MAX_GPU_SLOTS). cuda_graphs: capture the decode step per
        batch bucket (FlashInfer attention only)."""
        device = torch.device(device) if device is not None else default_device()
        dtype = dtype or default_dtype(device)
        checkpoint = load_checkpoint(source)
        config = checkpoint.config
        stage, requested = "loading the weights", slots
        try:
            model = Whisper.from_checkpoint(checkpoint, device=device, dtype=dtype)
            if slots is None:
                slots = gpu_slots(config.dims, dtype, device, kv_memory_fraction) if device.type == "cuda" else DEFAULT_SLOTS
            shape = PoolShape.for_model(config.dims, slots)
            stage = f"allocating {slots} KV slots ({shape.bytes_per_slot(dtype) * (slots + 1) / 2**30:.2f} GiB)"
            pool = KVSlotPool(shape, device=device, dtype=dtype)
            backend = make_attention(AttentionKind(attention), pool)
            graphs = None
            if cuda_graphs and device.type == "cuda" and not isinstance(backend, SdpaAttention):
                from python_backend_lib.engine.cuda_graphs import DecodeGraphs

                stage = f"capturing CUDA graphs for up to {slots} requests"
                graphs = DecodeGraphs(model, config, backend, max_batch=slots)
                graphs.capture()
        except torch.cuda.OutOfMemoryError as error:
            raise GpuMemoryError(out_of_memory_advice(source, device, stage, requested, kv_memory_fraction)) from error
        batch = DecodeBatch(model, config, backend, graphs)
        tokenizer = load_tokenizer(config) if config.tokenizer_path else None
        return cls(model, config, tokenizer, Engine(batch, config, tokenizer, engine_options))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

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
        self, waveform: np.ndarray, options: TranscribeOptions, is_cancelled: Callable[[], bool] | None = None
    ) -> "Future[Transcript]":
        """Queue a recording of any length (16 kHz mono) for transcription."""
        future: Future[Transcript] = Future()
        features = features_for(waveform, self.n_mels, self.device)
        self.start(features, len(waveform) / geometry.SAMPLE_RATE, options, _settle(future), is_cancelled)
        return future

    def start(
        self,
        features: torch.Tensor,
        duration: float,
        options: TranscribeOptions,
        on_done: Callable[[Transcript | BaseException], None],
        is_cancelled: Callable[[], bool] | None = None,
    ) -> None:
        """Start transcribing log-mel `features` (as `longform.features_for` makes
        them) of `duration` seconds; `on_done` gets the Transcript or the error,
        on the engine thread. Raises ValueError at once for options or features
        that do not fit the checkpoint."""
        if self.tokenizer is None:
            raise ValueError(f"checkpoint {self.config.source!r} has no tokenizer: it can decode but not transcribe")
        LongFormJob(
            self.engine.submit,
            self.config,
            self.tokenizer,
            features,
            duration,
            options,
            on_done,
            is_cancelled,
            self.aligner.add_words if self.aligner else None,
        ).start()

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
        futures = [self.submit(w, o) for w, o in zip(waveforms, options)]
        return [f.result() for f in futures]

    def close(self) -> None:
        self.engine.close()


class GpuMemoryError(RuntimeError):
    """The checkpoint, its KV slots or its CUDA graphs do not fit in GPU memory."""


def out_of_memory_advice(
    source: str, device: torch.device, stage: str, slots: int | None, kv_memory_fraction: float
) -> str:
    """What to change when loading ran out of GPU memory while doing `stage`.

    slots: the KV slots asked for (None: sized from free memory by `kv_memory_fraction`).
    """
    asked = f"{slots} (set)" if slots else f"auto, sized to {kv_memory_fraction:g} of free memory"
    return (
        f"out of GPU memory on {device} while {stage} for checkpoint {source!r}. To fit: set fewer KV slots "
        f"(the whisper model's `kv_slots` parameter in config.pbtxt, `slots` in Pipeline.load; now {asked}), "
        "or lower `kv_memory_fraction` to leave more room for activations and CUDA graphs, "
        "or use a smaller checkpoint; check with nvidia-smi that no other process holds the GPU's memory."
    )


def _settle(future: Future) -> Callable[[object], None]:
    """An engine callback that completes `future` with a result or an exception."""

    def on_done(outcome: object) -> None:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    return on_done


def gpu_slots(dims, dtype: torch.dtype, device: torch.device, fraction: float) -> int:
    """Request slots that fit in `fraction` of the GPU memory free now."""
    free_bytes, _ = torch.cuda.mem_get_info(device)
    return slots_for_memory(dims, dtype, int(free_bytes * fraction), MAX_GPU_SLOTS)


def make_attention(kind: AttentionKind, pool: KVSlotPool):
    """The attention backend: FlashInfer on CUDA when asked for (or, with AUTO,
    when it is installed), PyTorch SDPA otherwise."""
    on_cuda = pool.self_k[0].device.type == "cuda"
    if kind is AttentionKind.SDPA or (kind is AttentionKind.AUTO and not (on_cuda and _flashinfer_available())):
        return SdpaAttention(pool)
    if not on_cuda:
        raise ValueError("FlashInfer attention needs a CUDA device")
    from python_backend_lib.engine.flashinfer_attention import FlashInferAttention

    return FlashInferAttention(pool)


def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True
