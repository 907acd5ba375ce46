"""How tritonserver is started: the environment its Python stubs see, and its command line.

The Python backend's stub imports packages from the `python3` first on PATH, so
this interpreter's directory goes first on PATH: the models then see the same
packages (torch, our library) as the process that started the server.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from python_backend_lib.apps import repository, triton_output
from python_backend_lib.core.cache import cache_root
from python_backend_lib.serving.settings import CHECKPOINT_ENV, QUANTIZE_ENV, REQUIRE_GPU_ENGINE_ENV

if TYPE_CHECKING:
    from python_backend_lib.apps.server import ServerSettings
    from python_backend_lib.apps.triton_installation import TritonInstallation

# glibc gives each thread that allocates its own heap (arena), up to eight per core, and
# returns little of a heap's freed memory to the system. A whisper stub's threads (the
# engine, the responders, Triton's) each took large blocks in turn, so its resident memory
# kept rising under mixed load with no leak; two arenas hold less of it, and the idle
# engine gives the rest back (devices.host_memory.IDLE_RELEASE_S). A user's own value is kept.
MALLOC_ARENAS = ("MALLOC_ARENA_MAX", "2")


def server_environment(installation: TritonInstallation, settings: ServerSettings) -> dict[str, str]:
    """tritonserver's environment: this Python first on PATH, the wheel's libraries, the
    checkpoint, the GPUs, whether the GPU engine is required, the quantization and
    glibc's arenas (MALLOC_ARENAS)."""
    env = dict(os.environ)
    env.setdefault(*MALLOC_ARENAS)
    if settings.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = settings.gpus
    if settings.require_gpu_engine:
        env[REQUIRE_GPU_ENGINE_ENV] = "1"
    if settings.quantization is not None:
        env[QUANTIZE_ENV] = settings.quantization.value
    checkpoint = settings.checkpoint
    env["PATH"] = os.pathsep.join([str(_python3_directory()), env.get("PATH", "")])
    if installation.library_path:
        paths = [str(p) for p in installation.library_path] + [env.get("LD_LIBRARY_PATH", "")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
    if checkpoint is not None:
        env[CHECKPOINT_ENV] = checkpoint
    return env


def _python3_directory() -> Path:
    """A directory whose `python3` is this interpreter (venv included)."""
    directory = Path(sys.executable).parent
    python3 = directory / "python3"
    if python3.exists() and python3.samefile(sys.executable):
        return directory
    shim_dir = cache_root() / f"python-{hashlib.sha1(sys.executable.encode()).hexdigest()[:12]}"
    shim_dir.mkdir(parents=True, exist_ok=True)
    shim = shim_dir / "python3"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    return shim_dir


# tritonserver's own wait at a stop (its default is 30 s). The launcher drains first and
# then marks the stop, so that the whisper instances answer what they still hold at once:
# Triton's wait covers answers already on their way, and HTTP connections that clients
# keep open between requests, which Triton 2.51 waits for until this runs out.
EXIT_TIMEOUT_S = 10


def server_command(
    installation: TritonInstallation,
    settings: ServerSettings,
    model_repository: Path,
    shm_prefix: str,
    gpu: bool | None = None,
) -> list[str]:
    """tritonserver's command line for `model_repository` (the settings' own, or the copy
    served), its stubs' shared memory named by `shm_prefix`. gpu: whether there is a CUDA
    device (None: ask the driver)."""
    s = settings
    gpu = triton_output.cuda_device_count() > 0 if gpu is None else gpu
    return [
        str(installation.binary),
        f"--model-repository={model_repository}",
        f"--backend-directory={installation.backend_directory}",
        f"--http-address={s.host}",
        f"--http-port={s.http_port}",
        f"--grpc-address={s.host}",
        f"--grpc-port={s.grpc_port}",
        f"--metrics-address={s.host}",
        f"--metrics-port={s.metrics_port}",
        f"--log-verbose={s.log_verbose}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        "--strict-readiness=true",
        "--exit-on-error=true",
        # Every config.pbtxt served names its backend, inputs and outputs; with auto-complete
        # on, the Python backend starts a throwaway stub per model, importing its model.py
        # (torch), only to ask for a completion none needs: start-up waited for it.
        "--disable-auto-complete-config",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        *(() if gpu else triton_output.NO_GPU_FLAGS),
        *repository.cuda_pool_flags(model_repository, triton_output.visible_gpus(s.gpus) if gpu else 0),
        *(() if s.trace_file is None else triton_output.trace_flags(s.trace_file, s.trace_rate)),
    ]
