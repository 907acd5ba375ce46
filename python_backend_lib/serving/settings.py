"""A Triton model's config.pbtxt as the adapters need it, parsed once in `initialize`.

Nothing here imports Triton or torch (the whisper model's pipeline imports torch
when loaded), so it is tested without a server.
"""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from python_backend_lib.core.encoder_kernel import EncoderKernel
from python_backend_lib.core.quantization import DEFAULT_QUANTIZATION, Quantization
from python_backend_lib.serving.admission import AdmissionPolicy

# Overrides every model's `checkpoint` parameter; `whisper-triton serve --checkpoint` sets it.
CHECKPOINT_ENV = "WHISPER_TRITON_CHECKPOINT"
DEFAULT_CHECKPOINT = "default"  # the packaged tiny.en
# Overrides the whisper models' `quantize` parameter; `whisper-triton serve --quantize` sets it.
QUANTIZE_ENV = "WHISPER_TRITON_QUANTIZE"
# The `parameters { key: ... }` a model's config.pbtxt may set (all string values there).
CONFIG_PARAMETERS = (
    "checkpoint",
    "max_audio_seconds",
    "max_queued_requests",
    "kv_slots",
    "kv_memory_fraction",
    "decode_threads",
    "quantize",
    "encoder_attention",
    "log_mel_output",
    "stall_timeout_s",
    "FORCE_CPU_ONLY_INPUT_TENSORS",  # Triton's Python backend reads it too: "no" lets GPU inputs arrive on the GPU
)
CPU_ONLY_INPUTS = "FORCE_CPU_ONLY_INPUT_TENSORS"
YES_NO = {"yes": True, "no": False}


class LogMelOutput(str, enum.Enum):
    """Where `preprocessing` hands its LOG_MEL on from a GPU instance (a CPU instance's is on the host)."""

    DEVICE = "device"  # the GPU tensor itself, through DLPack: Triton copies it into its CUDA memory pool
    HOST = "host"  # copied to host memory first; `whisper` copies it to its GPU




def log_mel_handover(setting: LogMelOutput | None, gpus: int) -> LogMelOutput:
    """How LOG_MEL travels from preprocessing to whisper on a server of `gpus` GPUs: as
    `setting` says, or for "auto" (None) the GPU tensor on one GPU, host memory on several.

    On one GPU the GPU tensor carries as many requests as a host copy and a 5 s clip
    alone comes about a millisecond sooner (docs/benchmarks/mps-bb9e702). On several,
    Triton 2.51 hands any preprocessing instance's output to any whisper instance, so
    a GPU tensor often crosses to another GPU; a whisper instance that received one
    then got no further request from Triton, its stub idle, for as long as the server
    ran (the two-GPU stall, docs/reliability.md). Host memory crosses nothing."""
    if setting is not None:
        return setting
    return LogMelOutput.DEVICE if gpus <= 1 else LogMelOutput.HOST

# Longer audio is refused, naming the limit: an hour of 16 kHz float32 is 230 MB.
DEFAULT_MAX_AUDIO_SECONDS = 3600.0
# Numeric parameters set to this (or left out) take the library's default.
AUTO = "auto"
# Requests waiting for a decoding slot per slot, when max_queued_requests is "auto".
# Twice the saturating load must wait, not be refused: a refused request is sent again
# at once and costs the server its audio decoding and the ensemble for nothing. A lone
# GPU engine turns its slots over several times a second, so its queue can be deep.
# Engines that share Triton's queue (several instances) keep one batch waiting each and
# leave the rest in Triton's queue, which hands it to whichever has room
# (`admission.AdmissionPolicy`). A CPU engine turns its slots over in seconds: one batch
# waits there.
QUEUED_PER_SLOT_GPU = 7
QUEUED_PER_SLOT_SHARED = 1
QUEUED_PER_SLOT_CPU = 1
# How long a full engine's `execute` waits for room when several engines share the
# queue; longer than any decode takes to free a slot, so it refuses only when stuck.
SHARED_ADMISSION_WAIT_S = 2.0
# `whisper-triton serve --require-gpu-engine` sets it: on a GPU, refuse to start
# without FlashInfer and CUDA graphs rather than serve the slow path.
REQUIRE_GPU_ENGINE_ENV = "WHISPER_TRITON_REQUIRE_GPU_ENGINE"
# For tests only (`engine.faults.FaultPlan`): every decoder step holding a request
# with this prompt fails, to show that the failure stays with it ...
FAULT_PROMPT_ENV = "WHISPER_TRITON_FAULT_PROMPT"
# ... and with this prompt the engine's failure handling fails too, so the engine
# loop itself fails, answers everything it holds and restarts.
ENGINE_FAULT_PROMPT_ENV = "WHISPER_TRITON_ENGINE_FAULT_PROMPT"
# For tests only: a decoder step holding a request with this prompt never returns,
# as a stuck device call would (`engine.faults`), for the stall watch to find.
STALL_PROMPT_ENV = "WHISPER_TRITON_STALL_PROMPT"
# Seconds without progress that make a whisper instance stalled; over the config's
# `stall_timeout_s` (`serving.stall_watch`).
STALL_TIMEOUT_ENV = "WHISPER_TRITON_STALL_TIMEOUT_S"
# With this set to a GPU's label (`device_label`), only the engines on that GPU
# arm the fault prompts, to show that the other GPUs' requests are untouched.
FAULT_GPU_ENV = "WHISPER_TRITON_FAULT_GPU"
# Which GPUs a process sees, and in what order (`whisper-triton serve --gpus` sets it).
CUDA_VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class ModelSettings:
    """A model's config.pbtxt, as the adapters need it.

    name: the model's name in the repository.
    max_batch_size: rows a request may carry at most.
    checkpoint: the Whisper checkpoint source (see `weights.load_config`).
    max_audio_seconds: longer audio is refused (INVALID_ARG naming the limit).
    max_queued_requests: requests the whisper model holds beyond its decoding
        slots before it refuses new ones (UNAVAILABLE); None: auto (`admission`).
    kv_slots: windows decoded together (KV-cache slots); None: from free GPU
        memory, 16 on the CPU.
    kv_memory_fraction: share of the free GPU memory for the KV slots when
        `kv_slots` is None; None: the library's default.
    decode_threads: threads decoding audio at once (preprocessing); None: one
        per CPU this process may run on.
    quantization: how the engine's linear layers multiply (`core.quantization`):
        the config's `quantize`, or QUANTIZE_ENV's; int8 on the CPU only.
    encoder_kernel: which kernel runs the encoder's self-attention on a GPU (the
        config's `encoder_attention`, `core.encoder_kernel`); None: "auto".
    log_mel_output: how preprocessing's GPU instances hand LOG_MEL on; None: "auto"
        (`log_mel_handover`).
    cpu_only_inputs: Triton moves every input to the host first (its
        FORCE_CPU_ONLY_INPUT_TENSORS, "yes" unless the config says "no").
    decoupled: the config's model_transaction_policy is decoupled: a request may
        get several responses (the streamed path's `whisper_stream`).
    stall_timeout_s: seconds without progress, while requests are held, after which
        a whisper instance is stalled (STALL_TIMEOUT_ENV overrides it); None: the
        device's default (`serving.stall_watch`).
    """

    name: str
    max_batch_size: int
    checkpoint: str
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    max_queued_requests: int | None = None
    kv_slots: int | None = None
    kv_memory_fraction: float | None = None
    decode_threads: int | None = None
    quantization: Quantization = DEFAULT_QUANTIZATION
    encoder_kernel: EncoderKernel | None = None
    log_mel_output: LogMelOutput | None = None
    cpu_only_inputs: bool = True
    decoupled: bool = False
    stall_timeout_s: float | None = None

    @classmethod
    def from_triton(cls, model_config: str, environ: Mapping[str, str] = os.environ) -> ModelSettings:
        """Parse `args["model_config"]`; ValueError for a config the adapters cannot serve."""
        config = json.loads(model_config)
        name = config.get("name", "?")
        max_batch_size = int(config.get("max_batch_size", 0))
        if max_batch_size < 1:
            raise ValueError(f"model {name!r}: max_batch_size must be at least 1, got {max_batch_size}")
        parameters = config.get("parameters", {})
        unknown = sorted(set(parameters) - set(CONFIG_PARAMETERS))
        if unknown:
            raise ValueError(
                f"model {name!r}: unknown config parameter(s) {unknown}; known: {list(CONFIG_PARAMETERS)}"
            )
        values = {key: parameters[key].get("string_value", "").strip() for key in parameters}
        checkpoint = environ.get(CHECKPOINT_ENV) or values.get("checkpoint") or DEFAULT_CHECKPOINT

        def number(key: str, kind: type, low: float, high: float = math.inf) -> float | int | None:
            text = values.get(key, "")
            if text in ("", AUTO):
                return None
            try:
                value = kind(text)
            except ValueError:
                value = None
            if value is None or not low <= value <= high:
                bound = "" if high == math.inf else f" and at most {high:g}"
                kind_name = "an integer" if kind is int else "a number"
                raise ValueError(
                    f"model {name!r}: config parameter {key!r} must be {AUTO!r} or {kind_name}"
                    f" of at least {low:g}{bound}, got {text!r}"
                )
            return value

        def one_of(key: str, choices: Mapping[str, object], default: object, environ_key: str | None = None) -> object:
            """The parameter `key`, or the variable `environ_key` where that is set."""
            source, text = f"config parameter {key!r}", values.get(key, "")
            if environ_key and environ.get(environ_key, "").strip():
                source, text = f"environment variable {environ_key}", environ[environ_key].strip()
            if text in ("", AUTO):
                return default
            if text not in choices:
                allowed = f"{AUTO!r} or one of {sorted(choices)}"
                raise ValueError(f"model {name!r}: {source} must be {allowed}, got {text!r}")
            return choices[text]

        max_audio_seconds = number("max_audio_seconds", float, 1.0)
        return cls(
            name=name,
            max_batch_size=max_batch_size,
            checkpoint=checkpoint,
            max_audio_seconds=DEFAULT_MAX_AUDIO_SECONDS if max_audio_seconds is None else max_audio_seconds,
            max_queued_requests=number("max_queued_requests", int, 0),
            kv_slots=number("kv_slots", int, 1),
            kv_memory_fraction=number("kv_memory_fraction", float, 0.01, 0.95),
            decode_threads=number("decode_threads", int, 1),
            quantization=one_of("quantize", {q.value: q for q in Quantization}, DEFAULT_QUANTIZATION, QUANTIZE_ENV),
            encoder_kernel=one_of("encoder_attention", {k.value: k for k in EncoderKernel}, None),
            log_mel_output=one_of("log_mel_output", {o.value: o for o in LogMelOutput}, None),
            cpu_only_inputs=one_of(CPU_ONLY_INPUTS, YES_NO, True),
            decoupled=bool(config.get("model_transaction_policy", {}).get("decoupled", False)),
            stall_timeout_s=float(environ[STALL_TIMEOUT_ENV]) if environ.get(STALL_TIMEOUT_ENV)
            else number("stall_timeout_s", float, 1.0),
        )

    def thread_count(self) -> int:
        """`decode_threads`, or one per CPU this process may run on (its affinity, as a container sets it)."""
        if self.decode_threads is not None:
            return self.decode_threads
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def admission(self, slots: int, on_gpu: bool, engines: int = 1) -> AdmissionPolicy:
        """The whisper model's request limit, for an engine of `slots` decoding slots among
        `engines` that share Triton's queue (`engines_sharing_queue`): its slots plus
        `max_queued_requests` (auto: QUEUED_PER_SLOT_* waiting requests per slot)."""
        shared = engines > 1
        if self.max_queued_requests is not None:
            queued = self.max_queued_requests
        elif not on_gpu:
            queued = slots * QUEUED_PER_SLOT_CPU
        else:
            queued = slots * (QUEUED_PER_SLOT_SHARED if shared else QUEUED_PER_SLOT_GPU)
        return AdmissionPolicy(limit=slots + queued, wait_s=SHARED_ADMISSION_WAIT_S if shared else 0.0)


def instance_device(args: Mapping[str, str]) -> str:
    """The device of the model instance Triton is initialising, from its `initialize` args:
    "cuda:<id>" for a GPU instance (the id Triton assigned it), "cpu" for a CPU instance."""
    if args.get("model_instance_kind") == "GPU":
        return f"cuda:{int(args['model_instance_device_id'])}"
    return "cpu"


def device_label(device: Any, environ: Mapping[str, str] = os.environ) -> str:
    """The `gpu` label of an engine on `device` ("cuda:<i>" or "cpu", a str or torch.device):
    the host's number of that GPU, as nvidia-smi counts them, or "cpu".

    CUDA numbers the GPUs a process sees from 0: under `--gpus 1` the host's second
    GPU is the process's cuda:0, and its label says 1. A GPU named in
    CUDA_VISIBLE_DEVICES by its UUID keeps that name."""
    kind, _, index = str(device).partition(":")
    if kind != "cuda":
        return "cpu"
    visible = [name.strip() for name in environ.get(CUDA_VISIBLE_DEVICES_ENV, "").split(",") if name.strip()]
    position = int(index or 0)
    return visible[position] if position < len(visible) else str(position)


@dataclass(frozen=True)
class GpuInstances:
    """Instances per GPU of the models that run on it: whisper engines and preprocessing."""

    whisper: int
    preprocessing: int


# What `whisper-triton serve` runs per GPU when left to choose, by the checkpoint's encoder
# width (the first row that holds it; wider: the last) and by whether the GPU's processes
# share it under CUDA MPS. Each instance is a process with its own interpreter lock.
# tiny's engines are bound by their host work long before the GPU is busy, so several
# serve more, and its preprocessing instances (audio decoding and the log-mel's launches)
# must keep up with them; larger checkpoints keep the GPU busy with one engine. Without
# MPS every process takes the GPU in time slices, and more of them only split it.
# The choices below are the best measured with tiny.en and large-v3 on one GPU, with and
# without MPS (docs/benchmarks/mps-bb9e702, shape-39a00cc and engines.md hold the runs).
# Five tiny engines under MPS (engines.md, sections 10 and 11) came once the graph steps
# had lost most of their host calls: a fourth engine thread no longer fills its core.
INSTANCES_BY_ENCODER_WIDTH = {
    True: ((384, GpuInstances(whisper=5, preprocessing=8)), (1 << 30, GpuInstances(whisper=1, preprocessing=4))),
    False: ((384, GpuInstances(whisper=3, preprocessing=4)), (1 << 30, GpuInstances(whisper=1, preprocessing=4))),
}


def auto_instances_per_gpu(dims: Any, mps: bool) -> GpuInstances:
    """Instances per GPU for a checkpoint of these `ModelDims` (INSTANCES_BY_ENCODER_WIDTH)."""
    table = INSTANCES_BY_ENCODER_WIDTH[mps]
    return next((n for width, n in table if dims.n_audio_state <= width), table[-1][1])


def _instance_groups(model_config: str) -> list[tuple[str, int, list[int]]]:
    """(kind, count, gpus) of each instance group in `args["model_config"]` (normalized
    by Triton: KIND_AUTO resolved, a KIND_GPU group listing its GPUs, its count per GPU)."""
    groups = json.loads(model_config).get("instance_group", [])
    return [(g.get("kind", ""), int(g.get("count", 1)), list(g.get("gpus", []))) for g in groups]


def engines_on_device(model_config: str, device: str) -> int:
    """How many instances of the model Triton runs on `device` ("cuda:<id>" or "cpu"),
    from `args["model_config"]` in `initialize`: they share its memory and cores."""
    kind, _, index = device.partition(":")
    count = 0
    for group_kind, per_device, gpus in _instance_groups(model_config):
        if kind == "cuda" and group_kind == "KIND_GPU" and int(index) in gpus:
            count += per_device
        elif kind == "cpu" and group_kind == "KIND_CPU":
            count += per_device
    return max(1, count)


def engines_sharing_queue(model_config: str) -> int:
    """How many instances of the model Triton runs in all, on every device: one queue feeds them."""
    total = sum(
        per_device * max(1, len(gpus)) if kind == "KIND_GPU" else per_device
        for kind, per_device, gpus in _instance_groups(model_config)
    )
    return max(1, total)
