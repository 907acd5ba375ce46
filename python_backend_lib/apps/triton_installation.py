"""Where tritonserver and a Python backend for this interpreter are.

Two installations are supported, looked for in this order:
1. the official container: `tritonserver` on PATH, backends in /opt/tritonserver/backends;
2. the `nvidia-pytriton` wheel, which ships `tritonserver` and the Python backend but
   keeps the backend stubs apart, one per Python version. We assemble a backend
   directory for this interpreter under the user's cache directory.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from python_backend_lib.core.cache import cache_root

CONTAINER_BACKENDS = Path("/opt/tritonserver/backends")
STUB_NAME = "triton_python_backend_stub"
PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")


class ServerError(RuntimeError):
    """tritonserver could not be found, started, or did not become ready."""


@dataclass(frozen=True)
class TritonInstallation:
    binary: Path
    backend_directory: Path
    library_path: tuple[Path, ...] = ()  # prepended to LD_LIBRARY_PATH


def find_triton(cache_dir: Path | None = None) -> TritonInstallation:
    """Locate tritonserver and a Python backend that runs this interpreter."""
    on_path = shutil.which("tritonserver")
    if on_path is not None:
        binary = Path(on_path).resolve()
        backends = CONTAINER_BACKENDS if CONTAINER_BACKENDS.is_dir() else binary.parent.parent / "backends"
        return TritonInstallation(binary=binary, backend_directory=backends)
    try:
        import pytriton
    except ImportError:
        raise ServerError(
            "tritonserver is not on PATH and the nvidia-pytriton wheel is not installed; "
            "run inside the Triton container or `pip install nvidia-pytriton`"
        ) from None
    triton_root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    libraries = triton_root.parent.parent / "nvidia_pytriton.libs"
    backends = _assemble_backends(triton_root, cache_dir or cache_root())
    return TritonInstallation(
        binary=triton_root / "bin" / "tritonserver", backend_directory=backends, library_path=(libraries,)
    )


def _assemble_backends(triton_root: Path, cache_dir: Path) -> Path:
    """Copy the wheel's Python backend and this Python's stub into one backend directory."""
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = triton_root / "python_backend_stubs" / python_version / STUB_NAME
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton has no Python backend stub for Python {python_version} ({stub})")
    sources = [triton_root / "backends" / "python" / name for name in PYTHON_BACKEND_FILES] + [stub]
    wheel_version = importlib.metadata.version("nvidia-pytriton")
    backends = cache_dir / f"backends-pytriton{wheel_version}-py{python_version}"
    target = backends / "python"
    if all(_same_file_content(source, target / source.name) for source in sources):
        return backends
    staging = cache_dir / f".staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "python").mkdir(parents=True)
    for source in sources:
        shutil.copy2(source, staging / "python" / source.name)
    shutil.rmtree(backends, ignore_errors=True)
    try:
        staging.rename(backends)
    except OSError:  # another process assembled it first
        shutil.rmtree(staging, ignore_errors=True)
    return backends


def _same_file_content(source: Path, copy: Path) -> bool:
    return copy.is_file() and copy.stat().st_size == source.stat().st_size and (
        copy.stat().st_mtime == source.stat().st_mtime
    )
