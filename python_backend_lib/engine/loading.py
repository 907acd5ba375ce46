"""A checkpoint on a device as a running engine: weights, KV slot pool, attention
backend, CUDA graphs, decode batch and engine thread, each phase timed.

On a CUDA device the engine decodes with FlashInfer and replays CUDA graphs;
without flashinfer it falls back to PyTorch SDPA without graphs, and says so
in a warning (or refuses to start when `require_gpu_engine` is set), because
that path is several times slower. Running out of GPU memory while loading
raises `GpuMemoryError` saying which setting to lower.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import torch

from python_backend_lib.checkpoints.weights import Checkpoint
from python_backend_lib.core.encoder_kernel import EncoderKernel, encoder_kernel_for
from python_backend_lib.core.quantization import DEFAULT_QUANTIZATION, Quantization
from python_backend_lib.devices.cudnn import cudnn_problem
from python_backend_lib.engine.attention import SdpaAttention
from python_backend_lib.engine.batch import DecodeBatch
from python_backend_lib.engine.faults import FaultPlan, FaultyDecodeBatch
from python_backend_lib.engine.fp8_linear import FP8
from python_backend_lib.engine.kv_cache import KVSlotPool, PoolShape, slots_for_memory
from python_backend_lib.engine.model import Whisper

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


class AttentionBackendName(str, enum.Enum):
    """What decodes, as the `whisper_attention_backend` metric reports it."""

    FLASHINFER_GRAPHS = "flashinfer+cuda_graphs"  # the GPU engine
    FLASHINFER = "flashinfer"  # eager FlashInfer (graphs turned off)
    SDPA = "sdpa"  # PyTorch attention: the CPU path, or a GPU host without flashinfer


class GpuMemoryError(RuntimeError):
    """The checkpoint, its KV slots or its CUDA graphs do not fit in GPU memory."""


class GpuEngineUnavailable(RuntimeError):
    """`require_gpu_engine` was set, but this host cannot run FlashInfer with CUDA graphs."""


@dataclass(frozen=True)
class EngineSetup:
    """How to build the decode batch (see `build_batch`).

    slots: requests decoded together (KV slots); None: DEFAULT_SLOTS on the CPU,
        on a GPU as many as `kv_memory_fraction` of the free memory holds (at
        most MAX_GPU_SLOTS; see `kv_budget` for several engines on one GPU).
    engines_on_device: engines (Triton instances, each its own process) sharing
        this device: on a GPU they split its KV memory, on the CPU its cores.
    cuda_graphs: capture the decode step per batch bucket (FlashInfer only).
    step_kernels: in those steps, feed the rows, apply the logit rules and choose the
        tokens with Triton kernels (`engine.step_kernels`) when Triton is installed;
        False: with PyTorch's operations (about 80 more kernels a step; for comparisons).
    require_gpu_engine: on a CUDA device, refuse to start without FlashInfer and
        CUDA graphs instead of falling back to SDPA.
    quantization: how the linear layers multiply (`core.quantization`); int8 on the
        CPU only (ValueError elsewhere).
    fp8_cross_kv: keep the cross-attention K/V in FP8 (`engine.kv_cache`): half the
        bytes each decoder step reads. None (the default): with FP8 quantization, where
        it paid without a measurable cost in accuracy (docs/performance.md, the big
        checkpoints); False keeps them in the model's dtype; True without FP8
        quantization is refused.
    encoder_kernel: which kernel runs the encoder's self-attention on a GPU
        (`core.encoder_kernel`), in the captured encoder passes and eagerly; None (the
        default): FlashInfer's with FP8 quantization, SDPA otherwise. The CPU always
        runs SDPA.
    faults: test-only faults to inject (`engine.faults`); none by default.
    """

    slots: int | None = None
    attention: AttentionKind = AttentionKind.AUTO
    cuda_graphs: bool = True
    step_kernels: bool = True
    kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION
    engines_on_device: int = 1
    require_gpu_engine: bool = False
    quantization: Quantization = DEFAULT_QUANTIZATION
    fp8_cross_kv: bool | None = None
    encoder_kernel: EncoderKernel | None = None
    faults: FaultPlan = FaultPlan()

    @property
    def cross_kv_in_fp8(self) -> bool:
        return self.quantization is Quantization.FP8 if self.fp8_cross_kv is None else self.fp8_cross_kv

    @property
    def encoder_attention(self) -> EncoderKernel:
        return encoder_kernel_for(self.encoder_kernel, self.quantization is Quantization.FP8)


@dataclass
class LoadTimes:
    """Seconds each start phase took, in order (printed to the server log)."""

    phases: dict[str, float] = field(default_factory=dict)

    def timed(self, phase: str, start: float) -> None:
        self.phases[phase] = time.perf_counter() - start

    def describe(self) -> str:
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items())


@dataclass(frozen=True)
class LoadedBatch:
    batch: DecodeBatch
    backend: AttentionBackendName
    times: LoadTimes


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device, quantization: Quantization = DEFAULT_QUANTIZATION) -> torch.dtype:
    """float16 on a GPU (bfloat16 with FP8 products, which return it), float32 on the CPU."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if quantization is Quantization.FP8 else torch.float16


def build_batch(
    checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype, setup: EngineSetup, times: LoadTimes
) -> LoadedBatch:
    """The model, its KV pool, attention backend and graphs, as a decode batch on `device`."""
    config = checkpoint.config
    stage, slots = "loading the weights", setup.slots
    if setup.fp8_cross_kv and setup.quantization is not Quantization.FP8:
        raise ValueError("an FP8 cross-attention cache comes with FP8 quantization only")
    cross_dtype = FP8 if setup.cross_kv_in_fp8 else None
    if device.type == "cpu" and setup.engines_on_device > 1:  # each engine its share of the cores
        torch.set_num_threads(max(1, torch.get_num_threads() // setup.engines_on_device))
    try:
        start = time.perf_counter()
        model = Whisper.from_checkpoint(checkpoint, device=device, dtype=dtype, quantization=setup.quantization)
        times.timed("weights", start)
        if slots is None:
            slots = (
                gpu_slots(config.dims, dtype, device, setup.kv_memory_fraction, setup.engines_on_device, cross_dtype)
                if device.type == "cuda"
                else DEFAULT_SLOTS
            )
        start = time.perf_counter()
        shape = PoolShape.for_model(config.dims, slots)
        gib = shape.bytes_per_slot(dtype, cross_dtype) * (slots + 1) / 2**30
        stage = f"allocating {slots} KV slots ({gib:.2f} GiB)"
        pool = KVSlotPool(shape, device=device, dtype=dtype, cross_dtype=cross_dtype)
        times.timed("kv_pool", start)
        start = time.perf_counter()
        backend = make_attention(AttentionKind(setup.attention), pool, setup.encoder_attention)
        times.timed("attention", start)
        graphs = encoder_graphs = None
        if setup.cuda_graphs and device.type == "cuda" and not isinstance(backend, SdpaAttention):
            from python_backend_lib.engine.cuda_graphs import DecodeGraphs
            from python_backend_lib.engine.encoder_graphs import EncoderGraphs

            start = time.perf_counter()
            stage = f"capturing CUDA graphs for up to {slots} requests"
            graphs = DecodeGraphs(model, config, backend, max_batch=slots, step_kernels=setup.step_kernels)
            graphs.capture()
            times.timed("cuda_graphs", start)
            start = time.perf_counter()
            stage = "capturing the encoder's CUDA graphs"
            encoder_graphs = EncoderGraphs(model, pool, kernel=setup.encoder_attention)
            encoder_graphs.capture()
            times.timed("encoder_graphs", start)
    except torch.cuda.OutOfMemoryError as error:
        advice = out_of_memory_advice(config.source, device, stage, setup.slots, setup.kv_memory_fraction)
        raise GpuMemoryError(advice) from error
    if isinstance(backend, SdpaAttention):
        name = AttentionBackendName.SDPA
    else:
        name = AttentionBackendName.FLASHINFER_GRAPHS if graphs is not None else AttentionBackendName.FLASHINFER
    if device.type == "cuda" and name is not AttentionBackendName.FLASHINFER_GRAPHS:
        message = (
            f"the GPU engine is not running on {device}: decoding with {name.value} "
            "(several times slower than flashinfer+cuda_graphs)"
        )
        if setup.require_gpu_engine:
            raise GpuEngineUnavailable(f"{message}; install the gpu extra and turn CUDA graphs on")
        log.warning("%s", message)
    if device.type == "cuda" and (problem := cudnn_problem()) is not None:
        log.warning("%s", problem)
    arguments = (model, config, backend, graphs, encoder_graphs)
    batch = DecodeBatch(*arguments) if setup.faults.empty else FaultyDecodeBatch(*arguments, plan=setup.faults)
    return LoadedBatch(batch, name, times)


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


def kv_budget(free_bytes: int, total_bytes: int, fraction: float, engines: int) -> int:
    """Bytes of KV cache for one of `engines` engines on a GPU: `fraction` of the memory
    free now, and no more than its equal share of `fraction` of the whole GPU.

    Alone, an engine takes `fraction` of what is free. Several take equal shares
    whether Triton loads them one after another (each later one sees less free
    memory) or at once (each sees all of it).
    """
    return int(min(fraction * free_bytes, fraction * total_bytes / max(1, engines)))


def gpu_slots(
    dims, dtype: torch.dtype, device: torch.device, fraction: float, engines: int = 1,
    cross_dtype: torch.dtype | None = None,
) -> int:
    """Request slots that fit in this engine's `kv_budget` of the GPU's memory."""
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    budget = kv_budget(free_bytes, total_bytes, fraction, engines)
    return slots_for_memory(dims, dtype, budget, MAX_GPU_SLOTS, cross_dtype)


def make_attention(kind: AttentionKind, pool: KVSlotPool, encoder: EncoderKernel = EncoderKernel.SDPA):
    """The attention backend: FlashInfer on CUDA when asked for (or, with AUTO,
    when it is installed), its encoder attention through `encoder`; PyTorch SDPA
    otherwise."""
    on_cuda = pool.self_k[0].device.type == "cuda"
    if kind is AttentionKind.SDPA or (kind is AttentionKind.AUTO and not (on_cuda and flashinfer_available())):
        return SdpaAttention(pool)
    if not on_cuda:
        raise ValueError("FlashInfer attention needs a CUDA device")
    from python_backend_lib.engine.flashinfer_attention import FlashInferAttention

    return FlashInferAttention(pool, encoder=encoder)  # ImportError naming the package when flashinfer is missing


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True
