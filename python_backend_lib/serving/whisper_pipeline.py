"""The whisper model's `Pipeline`, loaded as its settings and the environment ask: on
which device, how many engines share it, whether a GPU engine is required, the
quantization (refused where it cannot run), and the test-only fault prompts
(`fault_plan`) that the served tests arm through the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from python_backend_lib.core.quantization import GPU_ONLY, device_problem
from python_backend_lib.serving.settings import (
    ENGINE_FAULT_PROMPT_ENV,
    FAULT_GPU_ENV,
    FAULT_PROMPT_ENV,
    REQUIRE_GPU_ENGINE_ENV,
    STALL_PROMPT_ENV,
    ModelSettings,
    device_label,
)


def fault_plan(device: str | None, environ: Mapping[str, str] = os.environ) -> Any:
    """The test-only `engine.faults.FaultPlan` the environment asks of an engine on `device`:
    the fault prompts, armed on every engine, or only on the GPU that FAULT_GPU_ENV names."""
    from python_backend_lib.engine.faults import FaultPlan

    faulty_gpu = environ.get(FAULT_GPU_ENV) or None
    if faulty_gpu is not None and (device is None or device_label(device, environ) != faulty_gpu):
        return FaultPlan()
    return FaultPlan(
        step_prompt=environ.get(FAULT_PROMPT_ENV) or None,
        engine_prompt=environ.get(ENGINE_FAULT_PROMPT_ENV) or None,
        stall_prompt=environ.get(STALL_PROMPT_ENV) or None,
    )


def load_pipeline(
    settings: ModelSettings, device: str | None = None, environ: Mapping[str, str] = os.environ, *, engines: int = 1
) -> Any:
    """The whisper model's `Pipeline` on `device` (default: the first GPU, else the CPU),
    as its settings and the environment (`REQUIRE_GPU_ENGINE_ENV`, the fault prompts) ask;
    `engines` instances share the device (`engines_on_device`).

    Raises loading.GpuMemoryError, saying what to change, when it does not fit on the GPU,
    and ValueError for a quantization that cannot run on `device`.
    """
    from python_backend_lib.engine.loading import DEFAULT_KV_MEMORY_FRACTION, EngineSetup, default_device
    from python_backend_lib.transcription.pipeline import Pipeline

    problem = device_problem(settings.quantization, str(device or default_device()))
    if problem is not None:
        where = (
            "on a GPU (kind: KIND_GPU in its config.pbtxt)" if settings.quantization in GPU_ONLY
            else "on the CPU (`whisper-triton serve --gpus none`, or kind: KIND_CPU in its config.pbtxt)"
        )
        raise ValueError(f"model {settings.name!r}: {problem}; serve it {where}, or set quantize to none")
    setup = EngineSetup(
        slots=settings.kv_slots,
        kv_memory_fraction=settings.kv_memory_fraction or DEFAULT_KV_MEMORY_FRACTION,
        engines_on_device=engines,
        require_gpu_engine=environ.get(REQUIRE_GPU_ENGINE_ENV, "") not in ("", "0"),
        quantization=settings.quantization,
        encoder_kernel=settings.encoder_kernel,
        faults=fault_plan(device, environ),
    )
    # preprocessing computes the log-mels: no captured log-mel here.
    return Pipeline.load(settings.checkpoint, device=device, setup=setup, log_mel_graphs=False)
