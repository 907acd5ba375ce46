"""Start and stop a real `tritonserver` on our model repository (found by
`triton_installation`); while it runs, `server_watch` reads its metrics (health,
frozen processes, the drain before a stop).

The Python backend's stub imports packages from the `python3` first on PATH, so
this interpreter's directory goes first on PATH: the models then see the same
packages (torch, our library) as the process that started the server.
"""

from __future__ import annotations

import collections
import itertools
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from python_backend_lib.apps import preflight, process_group, repository, shm_regions, triton_environment, triton_output
from python_backend_lib.apps.mps import MpsDaemon, MpsError, daemon_for
from python_backend_lib.apps.server_watch import DRAIN_TIMEOUT_S, ServerWatch
from python_backend_lib.apps.triton_installation import ServerError, TritonInstallation, find_triton
from python_backend_lib.apps.triton_output import Activity
from python_backend_lib.core.quantization import Quantization
from python_backend_lib.serving.cancellation import CancelBoard, board_folder
from python_backend_lib.serving.metrics import PUBLISH_INTERVAL_S
from python_backend_lib.serving.stall_watch import stall_bound_s

# python_backend_lib/, two folders up from this file (apps/server.py).
PACKAGE_ROOT = Path(__file__).resolve().parents[1]

# Triton listens on this address only, unless told otherwise: a server is not
# reachable from other machines until its owner says so (`--host 0.0.0.0`).
DEFAULT_HOST = "127.0.0.1"
# Addresses that mean "every interface": clients on this machine reach them as localhost.
ANY_HOST = ("0.0.0.0", "::", "")
DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 8001
DEFAULT_METRICS_PORT = 8002
DEFAULT_STARTUP_TIMEOUT_S = 600.0  # loading and warming a large checkpoint on a GPU takes minutes
STOP_GRACE_S = triton_environment.EXIT_TIMEOUT_S + 10.0  # tritonserver's own wait, and its unloading
LOG_TAIL_LINES = 100  # Triton's start-up tables and the last model's traceback fit
_servers_started = itertools.count()  # each server's part of its shared-memory regions' names
# Log lines after which tritonserver 2.51 neither becomes ready nor exits.
FATAL_LOG_MARKERS = ("Failed to preinitialize Python stub",)
READY_POLL_S = 0.5
STARTUP_REPORT_S = 20.0  # a start that takes longer says what it waits for this often


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    model_repository: Path
    checkpoint: str | None = None  # None: each model's config.pbtxt (or the inherited environment) decides
    host: str = DEFAULT_HOST  # the address Triton's HTTP, gRPC and metrics endpoints listen on
    http_port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    log_verbose: int = 0
    # Triton's own per-request timestamps (its "triton" trace mode), written to this file
    # when the server stops; one request in trace_rate is traced. None: no trace.
    trace_file: Path | None = None
    trace_rate: int = 1000
    # The GPUs the whisper model runs on, one engine each: CUDA_VISIBLE_DEVICES for
    # Triton ("0,1"; "" for none, the CPU); None: every GPU this process sees.
    gpus: str | None = None
    require_gpu_engine: bool = False  # refuse to start on a GPU without FlashInfer and CUDA graphs
    # How the whisper engines' linear layers multiply (int8: on the CPU only); None: each
    # model's config.pbtxt (or the inherited environment) decides.
    quantization: Quantization | None = None
    # Whisper engines (instances) per GPU, or on the CPU without one; None: auto (`repository`).
    engines: int | None = None
    # Run the GPUs' model processes under CUDA MPS, a daemon of this server's own (`apps.mps`):
    # True, False, or None for auto (with GPUs, where the daemon is installed).
    mps: bool | None = None
    # On a stop, wait this long at most for the requests in flight (`TritonServer.stop`).
    drain_timeout: float = DRAIN_TIMEOUT_S


def packaged_model_repository() -> Path:
    """The repository's `model_repository/`, beside this package (editable install or checkout)."""
    repository = PACKAGE_ROOT.parent / "model_repository"
    if not repository.is_dir():
        raise ServerError(
            f"no model repository at {repository}; install from a checkout with `pip install -e .` "
            "or pass --model-repository"
        )
    return repository


class TritonServer:
    """A tritonserver process serving our model repository.

        with TritonServer(ServerSettings(model_repository=packaged_model_repository())) as server:
            WhisperClient(server.http_url).transcribe("jfk.wav")

    Triton's log goes to `log` (default: kept only as a tail for error messages):
    every line when `verbose`, else all but Triton's routine ones (its tables, each
    model's loading and unloading; `triton_output.is_routine`). `report` hears
    what starting and stopping wait for ("waiting for 3 requests in flight").
    The server is started from, and should be stopped from, the same thread.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        log: IO[str] | None = None,
        verbose: bool = False,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self._log = log
        self._verbose = verbose
        self._report = report
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._process: subprocess.Popen[str] | None = None
        self._pump: threading.Thread | None = None
        self._fatal = threading.Event()
        self._load_failure: str | None = None  # the first model's failure to load, in one line
        self._progress = triton_output.LoadProgress()  # the models loading and loaded, from the log
        self._ready = False  # drain only a server that became ready
        self._watch: ServerWatch | None = None  # its metrics read while it runs
        self._aborted = False  # abort(): stop() waits for nothing
        self.shm_prefix = shm_regions.prefix(os.getpid(), next(_servers_started))
        # What Triton serves: the settings' repository, or a copy with another engine count.
        self.model_repository = settings.model_repository
        self._copy: Path | None = None
        self._mps: MpsDaemon | None = None

    @property
    def connect_host(self) -> str:
        """Where a client on this machine reaches the endpoints: localhost, unless
        Triton listens on one address that is not a loopback one."""
        host = self.settings.host
        if host in ANY_HOST or host.startswith("127.") or host in ("::1", "localhost"):
            return "localhost"
        return f"[{host}]" if ":" in host else host

    @property
    def http_url(self) -> str:
        return f"{self.connect_host}:{self.settings.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.connect_host}:{self.settings.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.connect_host}:{self.settings.metrics_port}/metrics"

    def command(self, installation: TritonInstallation, gpu: bool | None = None) -> list[str]:
        """tritonserver's command line (`triton_environment.server_command`)."""
        settings, served = self.settings, self.model_repository
        return triton_environment.server_command(installation, settings, served, self.shm_prefix, gpu)

    def start(self, timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        """Start tritonserver and wait until every model is ready; ServerError otherwise."""
        if self._process is not None:
            raise ServerError("this server was already started")
        ports = {"--http-port": self.settings.http_port, "--grpc-port": self.settings.grpc_port,
                 "--metrics-port": self.settings.metrics_port}
        problems = (preflight.numpy_problem(), preflight.checkpoint_problem(self.settings.checkpoint),
                    preflight.quantization_problem(self.settings.quantization, self.settings.model_repository,
                                                   triton_output.visible_gpus(self.settings.gpus)),
                    *(preflight.port_problem(port, flag) for flag, port in ports.items()))
        for problem in filter(None, problems):
            raise ServerError(problem)
        installation = find_triton()
        env = triton_environment.server_environment(installation, self.settings)
        problem = preflight.packaged_checkpoint_problem(self.settings.model_repository, env, say=self._report)
        if problem is not None:
            raise ServerError(problem)
        s = self.settings
        gpus = triton_output.visible_gpus(s.gpus)
        try:
            self._mps = daemon_for(s.mps, gpus, say=lambda line: print(f"whisper-triton: {line}", file=sys.stderr))
        except MpsError as error:
            raise ServerError(str(error)) from None
        env.update(self._mps.environ() if self._mps else {})
        mps = self._mps is not None
        self._copy = repository.serving_copy(s.model_repository, s.engines, gpus, env, mps=mps)
        self.model_repository = self._copy or s.model_repository
        if self._report is not None:  # after every check that can refuse the start in one line
            self._report(f"starting tritonserver on {s.model_repository}")
        try:
            self._process = subprocess.Popen(
                self.command(installation),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,  # a terminal's Ctrl-C reaches us; we forward SIGTERM
                preexec_fn=process_group.die_with_parent,
            )
        except BaseException:
            self.stop()  # the MPS daemon, if one started
            raise
        self._watch = ServerWatch(self.metrics_url, self._process, self._report)
        self._pump = threading.Thread(target=self._pump_log, name="tritonserver-log", daemon=True)
        self._pump.start()
        try:
            self._wait_until_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self._ready = True

    def _pump_log(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        quiet_gpu_noise = triton_output.cuda_device_count() == 0
        routine = False  # whether the line before was a routine one (a table goes on without a prefix)
        exit_watch = triton_output.ExitWatch()
        for line in self._process.stdout:
            if quiet_gpu_noise and triton_output.is_no_gpu_noise(line):
                continue
            if (line := triton_output.without_leak_report(line)) is None:
                continue
            line = exit_watch.plain(line)
            self._tail.append(line)
            self._progress.see(line)
            failure = triton_output.load_failure(line)
            if failure is not None and self._load_failure is None:
                self._load_failure = failure
            if failure is not None or any(marker in line for marker in FATAL_LOG_MARKERS):
                self._fatal.set()
            routine = triton_output.is_routine(line, after_routine=routine)
            if self._log is not None and (self._verbose or not routine):
                self._log.write(line)
                self._log.flush()

    def _wait_until_ready(self, timeout: float) -> None:
        started = time.monotonic()
        deadline, report_at = started + timeout, started + STARTUP_REPORT_S
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self._report is not None and time.monotonic() >= report_at:
                self._report(self._progress.describe(time.monotonic() - started))
                report_at += STARTUP_REPORT_S
            if self._process.poll() is not None:
                self._pump.join(timeout=5)
                raise self._failure(f"tritonserver exited with status {self._process.returncode} before it was ready")
            if self._fatal.is_set():
                raise self._failure("tritonserver cannot load the models")
            try:
                with urllib.request.urlopen(url, timeout=READY_POLL_S) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(READY_POLL_S)
        raise ServerError(f"tritonserver was not ready after {timeout:.0f} s; its log ends:\n{self.log_tail()}")

    def _failure(self, what: str) -> ServerError:
        """The cause in one line when a model's failure to load names it (Triton's
        log has the rest); else `what` and the end of the log."""
        if self._load_failure is not None:
            return ServerError(f"cannot load {self._load_failure}")
        return ServerError(f"{what}; its log ends:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return "".join(self._tail)

    def wait(self) -> int:
        """Block until tritonserver exits by itself; its exit status."""
        assert self._process is not None, "start() first"
        return self._process.wait()

    def wait_while_healthy(self) -> int | None:
        """Block until tritonserver exits (its exit status) or a whisper engine gives up, stalls
        or freezes (None; `ServerWatch.wait_while_healthy`). Frozen: no metrics published for
        longer than the stall bound and two publishes."""
        assert self._process is not None and self._watch is not None, "start() first"
        on_gpu = triton_output.visible_gpus(self.settings.gpus) > 0
        configured = repository.stall_timeout_s(self.model_repository, dict(os.environ))
        return self._watch.wait_while_healthy(stall_bound_s(on_gpu, configured) + 2 * PUBLISH_INTERVAL_S)

    def activity(self) -> Activity | None:
        """The server's current `Activity`; None before it starts or when its metrics cannot be read."""
        return None if self._watch is None else self._watch.activity()

    def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> bool:
        """Wait until the requests in flight are answered (`ServerWatch.drain`); False after
        `timeout`. Triton keeps accepting requests meanwhile: take the server out of rotation first."""
        return self._watch is not None and self._watch.drain(timeout)

    def stop(self, drain_timeout: float | None = None) -> int | None:
        """Drain (wait for the requests in flight, up to `drain_timeout`, by default the
        settings'), SIGTERM, answer what is still in flight UNAVAILABLE, wait, then
        SIGKILL; remove what the server leaves (its shared memory, the repository's
        copy, the cancel board). Safe to call twice."""
        drain_timeout = self.settings.drain_timeout if drain_timeout is None else drain_timeout
        process = self._process
        if process is None:  # tritonserver never started: what was made for it
            if self._mps is not None:
                self._mps.stop()
            if self._copy is not None:
                repository.remove_copy(self._copy)
            return None
        board = CancelBoard(board_folder(process.pid))
        if process.poll() is None:
            drained = self.drain(drain_timeout) if drain_timeout > 0 and self._ready else not self._ready
            if self._report is not None and not self._aborted:
                self._report("stopping tritonserver: unloading the models")
            process.terminate()  # Triton takes no new request from here
            if not drained:  # the whisper instances answer what they still hold (UNAVAILABLE) at once
                board.post_stopping()
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        process_group.end_leftovers(process.pid)
        board.close()  # the instances remove it as they unload; not a killed one
        if self._mps is not None:
            self._mps.stop()
        if self._pump is not None:
            self._pump.join(timeout=5)
        shm_regions.remove(self.shm_prefix)  # the group is gone: nothing maps them any more
        if self._copy is not None:
            repository.remove_copy(self._copy)
        return process.returncode

    def abort(self) -> None:
        """Kill tritonserver and its models now, without waiting for the requests in
        flight (they fail); a `stop` under way, or the next, then only cleans up.
        Safe from a signal handler."""
        self._aborted = True
        if self._watch is not None:
            self._watch.aborted = True
        if self._process is not None:
            process_group.end_leftovers(self._process.pid)

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
