"""CUDA's Multi-Process Service for one server: `whisper-triton serve --mps auto|on|off`.

Every model instance on a GPU is a process with its own CUDA context: the
whisper engines and the preprocessing instances of one GPU share it by time
slices, one context at a time. Under MPS their kernels run side by side, as
if from one process. The launcher starts a control daemon of its own (its pipe
and log folders in a temporary folder, so it meets no other daemon of the
host), hands tritonserver the folders, and quits the daemon after tritonserver
has exited.

The daemon sees every GPU of the host (no CUDA_VISIBLE_DEVICES): a client's
CUDA_VISIBLE_DEVICES then names the same GPUs as without MPS.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
COMMAND_TIMEOUT_S = 20.0


class MpsError(RuntimeError):
    """The MPS control daemon could not be found or started."""


@dataclass(frozen=True)
class MpsFolders:
    """Where a daemon and its clients meet (the pipe) and where it logs."""

    pipe: Path
    log: Path

    def environ(self) -> dict[str, str]:
        return {PIPE_ENV: str(self.pipe), LOG_ENV: str(self.log)}


class MpsDaemon:
    """One control daemon: `start()` before tritonserver, `environ()` into its environment, `stop()` after it."""

    def __init__(self, control: str | None = None) -> None:
        self.control = control or shutil.which(CONTROL)
        self.folders: MpsFolders | None = None
        self._root: Path | None = None

    @property
    def available(self) -> bool:
        return self.control is not None

    def start(self) -> MpsFolders:
        if self.control is None:
            raise MpsError(f"{CONTROL} is not on PATH (it comes with the NVIDIA driver's utilities)")
        self._root = Path(tempfile.mkdtemp(prefix="whisper-triton-mps-"))
        self.folders = MpsFolders(self._root / "pipe", self._root / "log")
        self.folders.pipe.mkdir()
        self.folders.log.mkdir()
        result = self._run("-d")
        if result.returncode != 0:
            self._remove()
            raise MpsError(f"{CONTROL} -d failed ({result.returncode}): {result.stdout.strip()}")
        return self.folders

    def environ(self) -> dict[str, str]:
        return {} if self.folders is None else self.folders.environ()

    def stop(self) -> None:
        """Quit the daemon (its server exits once its clients have); safe to call twice."""
        if self.folders is None:
            return
        try:
            self._run("", stdin="quit\n")
        except (OSError, subprocess.TimeoutExpired):  # gone already: nothing to quit
            pass
        self._remove()

    def _run(self, flag: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env.update(self.folders.environ())
        return subprocess.run([self.control, *filter(None, [flag])], input=stdin, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=COMMAND_TIMEOUT_S)

    def _remove(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
        self._root = self.folders = None


def daemon_for(setting: bool | None, gpus: int, say: Callable[[str], None]) -> MpsDaemon | None:
    """The started daemon for a server of `gpus` GPUs under `serve --mps` (True: on, False: off,
    None: auto, which serves without MPS, saying so, where the daemon is missing or fails).
    MpsError when MPS was asked for and cannot be."""
    if setting is False or (setting is None and gpus == 0):
        return None
    if gpus == 0:
        raise MpsError("--mps on shares GPUs between processes, and this server has none (--gpus, the driver)")
    daemon = MpsDaemon()
    try:
        daemon.start()
    except MpsError as error:
        if setting:
            raise
        say(f"serving without CUDA MPS: {error}")
        return None
    return daemon
