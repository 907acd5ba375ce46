"""`whisper-triton serve` as a user starts it, in a process of its own, for one benchmark phase.

The command is the project's console script (through this interpreter, so the
same environment serves), with free ports; its output goes to a log file.
Stopping sends SIGTERM, as Ctrl-C or `docker stop` would: the launcher drains
and stops tritonserver.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

READY_POLL_S = 0.5
STOP_TIMEOUT_S = 90.0  # the launcher drains for up to 30 s, then waits up to 40 s for tritonserver


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def whisper_triton() -> list[str]:
    """This interpreter's `whisper-triton` console script, else the module it runs."""
    script = Path(sys.executable).parent / "whisper-triton"
    return [str(script)] if script.exists() else [sys.executable, "-m", "whisper_triton.cli"]


def checkout_record(checkout: Path | None) -> dict:
    """What a served checkout ran: its folder, and the commit written beside a `git
    archive` (COMMIT), so that a record never takes a checkout for the call's own commit."""
    if checkout is None:
        return {}
    record = {"checkout": str(checkout)}
    if (checkout / "COMMIT").exists():
        record["checkout_commit"] = (checkout / "COMMIT").read_text().strip()
    return record


def checkout_label(record: dict, digits: int = 7) -> str | None:
    """Which checkout a record's `checkout_record` fields name: its commit (shortened to
    `digits` when it is a commit's hash; a checkout changed on the device says what it
    changed), else its folder; None when the record ran this repository's code."""
    name = record.get("checkout_commit") or record.get("checkout")
    return name[:digits] if name and re.fullmatch(r"[0-9a-f]{40}", name) else name


@dataclass
class ServeCommand:
    """What to serve: a checkpoint (None: the model configs' own) and a model repository (None: the packaged one)."""

    checkpoint: str | None
    model_repository: Path | None = None
    gpus: str | None = None  # `serve --gpus`: "0", "0,1", "all" (None: every visible GPU)
    engines: int | None = None  # `serve --engines` (None: auto)
    trace_file: Path | None = None  # `serve --trace-file`, every request traced
    mps: bool | None = None  # `serve --mps on` / `off` (None: the launcher's auto)
    quantize: str | None = None  # `serve --quantize` (None: the config's, exact)
    # Serve the code of another checkout (its library and its packaged repository), as of another
    # commit: `python -m python_backend_lib.apps.cli serve`, which every commit has, with that
    # folder first on PYTHONPATH.
    checkout: Path | None = None
    ports: dict[str, int] = field(default_factory=lambda: {p: free_port() for p in ("http", "grpc", "metrics")})

    def argv(self) -> list[str]:
        program = whisper_triton() if self.checkout is None else [sys.executable, "-m", "python_backend_lib.apps.cli"]
        argv = [*program, "serve",
                f"--http-port={self.ports['http']}", f"--grpc-port={self.ports['grpc']}",
                f"--metrics-port={self.ports['metrics']}"]
        if self.checkpoint is not None:
            argv.append(f"--checkpoint={self.checkpoint}")
        if self.model_repository is not None:
            argv.append(f"--model-repository={self.model_repository}")
        if self.gpus is not None:
            argv.append(f"--gpus={self.gpus}")
        if self.engines is not None:
            argv.append(f"--engines={self.engines}")
        if self.trace_file is not None:
            argv += [f"--trace-file={self.trace_file}", "--trace-rate=1"]
        if self.mps is not None:
            argv.append(f"--mps={'on' if self.mps else 'off'}")
        if self.quantize is not None:
            argv.append(f"--quantize={self.quantize}")
        return argv

    def environ(self) -> dict[str, str]:
        """The environment to run it in: this one, and the other checkout first on PYTHONPATH."""
        if self.checkout is None:
            return dict(os.environ)
        path = os.pathsep.join(filter(None, (str(self.checkout.resolve()), os.environ.get("PYTHONPATH"))))
        return {**os.environ, "PYTHONPATH": path}

    @property
    def display(self) -> str:
        """The command as a user types it."""
        where = "" if self.checkout is None else f"PYTHONPATH={self.checkout} "
        return where + " ".join(["whisper-triton", *self.argv()[self.argv().index("serve"):]])

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.ports['metrics']}/metrics"


class ServerProcess:
    """A running `whisper-triton serve`; `with ServerProcess(command, log, timeout) as server: ...`."""

    def __init__(self, command: ServeCommand, log_path: Path, startup_timeout_s: float) -> None:
        self.command, self.log_path, self.startup_timeout_s = command, log_path, startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command.argv(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            env=self.command.environ(), cwd=self.command.checkout)
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.ready_s = round(time.monotonic() - started, 1)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _wait_ready(self, started: float) -> None:
        """Poll Triton's readiness over HTTP, each try bounded (a gRPC call can hang while the port opens)."""
        url = f"http://localhost:{self.command.ports['http']}/v2/health/ready"
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"whisper-triton serve exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() - started > self.startup_timeout_s:
                raise RuntimeError(f"not ready after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=READY_POLL_S * 4) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(READY_POLL_S)

    def metadata(self) -> dict:
        """Triton's name and version, from the server itself."""
        import tritonclient.grpc as grpc

        client = grpc.InferenceServerClient(self.command.grpc_url)
        try:
            data = client.get_server_metadata(as_json=True, client_timeout=20.0)
        finally:
            client.close()
        return {"name": data.get("name"), "version": data.get("version")}

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self) -> int | None:
        """SIGTERM to the launcher's process group, then SIGKILL if it outlives STOP_TIMEOUT_S."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            group = os.getpgid(process.pid)
            os.killpg(group, signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(group, signal.SIGKILL)
                process.wait()
        return process.returncode
