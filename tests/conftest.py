"""Fixtures shared by the test files: a real `whisper-triton serve` for the server tests."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import worker_groups

from python_backend_lib.apps.cli import READY_LINE
from python_backend_lib.apps.repository import InstanceGroup, read_instance_group, with_instance_group
from python_backend_lib.apps.server import packaged_model_repository
from python_backend_lib.contract import tensor_names
from python_backend_lib.devices.memory_use import host_resident_bytes
from python_backend_lib.serving.settings import ENGINE_FAULT_PROMPT_ENV, FAULT_PROMPT_ENV

# Every test process, and every server or command it starts, may use every core: the two
# xdist workers of .ci/run compute at different times as often as together. Their OpenMP
# threads wait passively (asleep) between parallel regions: spinning, they took the cores
# from the processes beside them. xdist's controller reads this file before it starts the
# workers, which inherit both variables before they import torch; one worker thread each
# while their servers took both, and spinning threads everywhere, were both slower on the
# whole suite (docs/benchmarks/test-suite.md). A value of the user's own is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))

# Without a GPU, Triton kernels (engine.step_kernels) run in Triton's interpreter,
# which is chosen when they are decorated: before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

AUDIO_DIR = Path(__file__).parent / "data" / "audio"
# The session server fails every decoder step holding a request with this prompt
# (FAULT_PROMPT_ENV): tests/served/test_faults.py shows the failure stays with that
# request. No other request carries it.
FAULT_PROMPT = "fail this request inside the engine"
# ... and with this one the engine loop itself fails (ENGINE_FAULT_PROMPT_ENV): it
# fails every window it holds and restarts. A single such request at a time, each
# followed by good ones, so that the session server never gives up.
ENGINE_FAULT_PROMPT = "fail the engine loop itself"
SESSION_FAULTS = {FAULT_PROMPT_ENV: FAULT_PROMPT, ENGINE_FAULT_PROMPT_ENV: ENGINE_FAULT_PROMPT}
STARTUP_TIMEOUT_S = 600
SHUTDOWN_TIMEOUT_S = 60


# A worker that holds more than this after a module gives what it freed back. Below it,
# the next module reuses the freed blocks: a full collection walks every object of the
# worker's heap, and pages given back are faulted in and zeroed again by the next module;
# after each of some ninety modules, both together cost more than many whole test files.
RELEASE_ABOVE_BYTES = 2 * 2**30


@pytest.fixture(scope="module", autouse=True)
def release_freed_memory() -> Iterator[None]:
    """After each test module that leaves this process large, hand the heap memory it
    freed back to the system. glibc keeps freed blocks for reuse: after the large-v3
    comparison in tests/served/test_random_models.py this process stayed at 13 GB, and
    the servers the later modules start then ran the 24 GB CI machine out of memory."""
    yield
    resident = host_resident_bytes()
    if resident is not None and resident <= RELEASE_ABOVE_BYTES:
        return
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name and hasattr(ctypes.CDLL(libc_name), "malloc_trim"):
        ctypes.CDLL(libc_name).malloc_trim(0)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-seconds", type=float, default=0.0, help="run tests/served/test_soak.py's long soak for this long (e.g. 600)"
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's xdist group (worker_groups.py), in a worker of `--dist loadgroup`."""
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    groups = worker_groups.worker_groups({item.nodeid: item.fixturenames for item in items})
    for item in items:
        item.add_marker(pytest.mark.xdist_group(name=groups[item.nodeid]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """The longest group left to each free worker (`--dist loadgroup` only)."""
    if config.getvalue("dist") == "loadgroup":
        return worker_groups.LongestGroupFirst(config, log)
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """xdist marks a grouped test by its node id; where it cannot, every worker
    would start every shared server: stop rather than run that way."""
    if hasattr(session.config, "workerinput") and session.config.getvalue("loadgroup"):
        ungrouped = [item.nodeid for item in session.items if "@" not in item.nodeid]
        if ungrouped:
            raise pytest.UsageError(
                f"pytest-xdist did not group {ungrouped[0]} (pytest-dev/pytest-xdist#1386): install pytest<9.2"
            )


@dataclass(frozen=True)
class RunningServer:
    http_url: str
    grpc_url: str
    metrics_url: str  # Triton's Prometheus endpoint, http://.../metrics
    log: Path

    def url(self, protocol: str) -> str:
        return self.http_url if protocol == "http" else self.grpc_url


def whisper_triton_command() -> list[str]:
    """The installed console script of this interpreter, else the module it points to."""
    script = Path(sys.executable).parent / "whisper-triton"
    if script.exists():
        return [str(script)]
    found = shutil.which("whisper-triton")
    return [found] if found else [sys.executable, "-m", "whisper_triton.cli"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@dataclass(frozen=True)
class LaunchedServer:
    """A `whisper-triton serve` process of a test's own, and where to reach it."""

    process: subprocess.Popen
    server: RunningServer


# The tests' servers on a host without a GPU run one preprocessing and one postprocessing
# instance instead of the shipped four each: every instance is a process that imports
# torch at the start (some 2 s of CPU each) and that Triton's stop waits for, one after
# another, about a second each. Ready in 6 to 9 s instead of 11 to 12, stopped in 5 s
# instead of 8, on this project's 2-core machine; the suite starts some twenty servers.
# A test that needs the shipped counts passes the packaged repository itself
# (--model-repository); on a GPU host the tests serve the packaged one as it is.
TEST_INSTANCE_COUNTS = {} if torch.cuda.is_available() else {"preprocessing": 1, "postprocessing": 1}


def _with_test_instances(repository: Path) -> None:
    """Rewrite the instance counts of `repository` (a copy) to TEST_INSTANCE_COUNTS."""
    for model, count in TEST_INSTANCE_COUNTS.items():
        config = repository / model / "config.pbtxt"
        text = config.read_text()
        config.write_text(with_instance_group(text, InstanceGroup(count, read_instance_group(text).kind)))


# The streamed path's two models. A server of a test that sends no streamed request is
# started without them, as a user who serves batch requests only may: one whisper
# process fewer, which imports torch and loads an engine at the start.
STREAMED_PATH_MODELS = (tensor_names.STREAM_ENSEMBLE_NAME, tensor_names.WHISPER_STREAM_NAME)


def _copy_packaged_repository(repository: Path, streamed_path: bool) -> None:
    leave_out = () if streamed_path else STREAMED_PATH_MODELS
    shutil.copytree(packaged_model_repository(), repository, ignore=shutil.ignore_patterns("__pycache__", *leave_out))
    _with_test_instances(repository)


def lean_model_repository(folder: Path, streamed_path: bool = True) -> Path:
    """A copy of the packaged model repository in `folder`, with TEST_INSTANCE_COUNTS
    (and without STREAMED_PATH_MODELS unless `streamed_path`)."""
    repository = folder / "lean_model_repository"
    _copy_packaged_repository(repository, streamed_path)
    return repository


@contextlib.contextmanager
def launch_server(
    folder: Path, environ: Mapping[str, str] | None = None, arguments: tuple[str, ...] = (), streamed_path: bool = True
) -> Iterator[LaunchedServer]:
    """`whisper-triton serve` on free ports, as a user would start it, with `environ`
    added to this process's environment, once it is ready; its log in `folder`.
    Without --model-repository in `arguments`, it serves `lean_model_repository`: on a host
    without a GPU, or without the streamed path (unless `streamed_path`).
    Stopped at the end if it still runs (SIGTERM, then SIGKILL; stop it first to check how it stops)."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    given = any(argument.startswith("--model-repository") for argument in arguments)
    if not given and (TEST_INSTANCE_COUNTS or not streamed_path):
        arguments = (f"--model-repository={lean_model_repository(folder, streamed_path)}", *arguments)
    log = folder / "whisper-triton-serve.log"
    command = whisper_triton_command() + [
        "serve", f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}", *arguments,
    ]
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(environ or {})}
        )
    try:
        _wait_until_ready(process, http_port, log)
        yield LaunchedServer(
            process,
            RunningServer(
                http_url=f"localhost:{http_port}",
                grpc_url=f"localhost:{grpc_port}",
                metrics_url=f"http://localhost:{metrics_port}/metrics",
                log=log,
            ),
        )
    finally:
        if process.poll() is None:
            process.terminate()  # a killed launcher could not stop tritonserver and its models
            try:
                process.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="session")
def base_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """`whisper-triton serve --checkpoint base` (the packaged multilingual checkpoint), shared by the files that need it."""
    with launch_server(tmp_path_factory.mktemp("base-server"), arguments=("--checkpoint", "base")) as launched:
        yield launched.server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    """`whisper-triton serve` with the fault prompts armed; stopped with SIGTERM, which it must obey.
    Its log is Triton's whole log (`--verbose`), for the tests that read it."""
    with launch_server(tmp_path_factory.mktemp("server"), SESSION_FAULTS, ("--verbose",)) as launched:
        yield launched.server
        _stop(launched.process, "whisper-triton serve", launched.server.log)


def model_repository_with(folder: Path, model: str, streamed_path: bool = True, **parameters: str) -> Path:
    """A copy of the packaged model repository in `folder` whose `model` has these
    config.pbtxt parameters changed (each must be there already), and TEST_INSTANCE_COUNTS
    (and without STREAMED_PATH_MODELS unless `streamed_path`)."""
    repository = folder / "model_repository"
    _copy_packaged_repository(repository, streamed_path)
    config = repository / model / "config.pbtxt"
    text = config.read_text()
    for key, value in parameters.items():
        pattern = rf'(key: "{key}"\s*value: \{{ string_value: )"[^"]*"'
        text, count = re.subn(pattern, rf'\1"{value}"', text)
        assert count == 1, f"{config}: no parameter {key!r} to change"
    config.write_text(text)
    return repository


def _wait_until_ready(process: subprocess.Popen, http_port: int, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"whisper-triton serve exited with {process.returncode}:\n{_log_tail(log)}")
        try:
            with urllib.request.urlopen(f"http://localhost:{http_port}/v2/health/ready", timeout=1) as reply:
                # Triton is ready a moment before the launcher, which then prints its banner.
                if reply.status == 200 and READY_LINE in log.read_text(errors="replace"):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    pytest.fail(f"whisper-triton serve was not ready after {STARTUP_TIMEOUT_S} s:\n{_log_tail(log)}")


# The gateway's upload limit in the tests: above the three-minute recording
# (5.8 MB as 16-bit WAV), low enough to test the 413 cheaply.
GATEWAY_MAX_FILE_MB = 8
GATEWAY_MODEL_IDS = ("whisper-1", "tiny.en")


@pytest.fixture(scope="session")
def gateway(server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """`whisper-triton gateway` in front of the session server; yields its base URL
    (http://127.0.0.1:PORT/v1, as the openai client wants it)."""
    port = free_port()
    log = tmp_path_factory.mktemp("gateway") / "whisper-triton-gateway.log"
    command = whisper_triton_command() + [
        "gateway", f"--triton-url={server.grpc_url}", f"--port={port}", f"--max-file-mb={GATEWAY_MAX_FILE_MB}",
        *[f"--model-id={model_id}" for model_id in GATEWAY_MODEL_IDS],
    ]
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"whisper-triton gateway exited with {process.returncode}:\n{_log_tail(log)}")
            try:
                with urllib.request.urlopen(f"{base_url}/models", timeout=1):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"whisper-triton gateway did not answer in 60 s:\n{_log_tail(log)}")
                time.sleep(0.2)
        yield base_url
    finally:
        _stop(process, "whisper-triton gateway", log)


def _stop(process: subprocess.Popen, command: str, log) -> None:
    """SIGTERM `process` and check that it exits 0 within SHUTDOWN_TIMEOUT_S."""
    process.send_signal(signal.SIGTERM)
    try:
        status = process.wait(timeout=SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"{command} ignored SIGTERM for {SHUTDOWN_TIMEOUT_S} s:\n{_log_tail(log)}")
    assert status == 0, f"{command} exited with {status} after SIGTERM:\n{_log_tail(log)}"
