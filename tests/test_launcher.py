"""The pieces of `whisper-triton serve` that can be checked without loading Whisper."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, whisper_triton_command

from python_backend_lib.apps import server
from python_backend_lib.apps.server import ServerError, ServerSettings, TritonServer
from python_backend_lib.serving.settings import CHECKPOINT_ENV


def test_packaged_model_repository_is_found_beside_the_package():
    repository = server.packaged_model_repository()
    assert (repository / "transcribe" / "config.pbtxt").is_file()


def test_triton_and_a_python_backend_for_this_interpreter_are_found(tmp_path):
    installation = server.find_triton(cache_dir=tmp_path)
    assert installation.binary.is_file() and os.access(installation.binary, os.X_OK)
    backend = installation.backend_directory / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py", server.STUB_NAME):
        assert (backend / name).is_file(), name
    again = server.find_triton(cache_dir=tmp_path)  # reused, not rebuilt
    assert again == installation


def test_environment_puts_this_python_first_and_passes_the_checkpoint(tmp_path):
    installation = server.TritonInstallation(
        binary=Path("/bin/true"), backend_directory=tmp_path, library_path=(tmp_path / "libs",)
    )
    env = server.server_environment(installation, checkpoint="/models/small")
    first = Path(env["PATH"].split(os.pathsep)[0])
    assert (first / "python3").samefile(sys.executable)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(tmp_path / "libs")
    assert env[CHECKPOINT_ENV] == "/models/small"


def test_numpy_2_is_refused(monkeypatch):
    server.check_numpy()  # the installed numpy is < 2
    monkeypatch.setattr(server.importlib.metadata, "version", lambda name: "2.1.0")
    with pytest.raises(ServerError, match="numpy < 2"):
        server.check_numpy()


def test_a_taken_port_is_refused_before_starting(tmp_path):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = ServerSettings(model_repository=tmp_path, http_port=port, grpc_port=0, metrics_port=0)
        with pytest.raises(ServerError, match=f"port {port} is not free"):
            TritonServer(settings).start()


@pytest.mark.server
def test_a_broken_repository_fails_with_tritons_log(tmp_path):
    model = tmp_path / "broken"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 1\n')
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise ValueError('checkpoint /nowhere is not a folder')\n"
    )
    ports = []
    for _ in range(3):
        with socket.socket() as probe:
            probe.bind(("", 0))
            ports.append(probe.getsockname()[1])
    settings = ServerSettings(model_repository=tmp_path, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2])
    triton = TritonServer(settings)
    with pytest.raises(ServerError, match="before it was ready") as caught:
        triton.start(timeout=120)
    assert "checkpoint /nowhere is not a folder" in str(caught.value)
    assert triton.stop() is not None  # exited, and stopping again is harmless


@pytest.mark.server
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_serve_stops_cleanly_on_a_signal(tmp_path, stop_signal):
    model = tmp_path / "idle"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 1\n')
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
    )
    http_port = free_port()
    command = whisper_triton_command() + [
        "serve", f"--model-repository={tmp_path}", f"--http-port={http_port}",
        f"--grpc-port={free_port()}", f"--metrics-port={free_port()}",
    ]
    log = tmp_path / "serve.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,  # only the CLI's own messages; Triton's log goes to stderr
            stderr=log_file,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as for a script's background job
        )
    try:
        ready = process.stdout.readline()  # "" if serve exits instead
        assert ready.startswith("whisper-triton is ready"), log.read_text()
        process.send_signal(stop_signal)
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        process.kill()
        process.wait()
    with socket.socket() as probe:  # tritonserver is gone: its port is free again
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("", http_port))


def _non_loopback_ipv4() -> str | None:
    """This machine's address on its default route, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the outgoing interface
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_serve_listens_on_localhost_only_by_default(server):
    ports = [int(url.rsplit(":", 1)[1].split("/")[0]) for url in (server.http_url, server.grpc_url, server.metrics_url)]
    assert all(_accepts("127.0.0.1", port) for port in ports)
    outside = _non_loopback_ipv4()
    if outside is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    assert not any(_accepts(outside, port) for port in ports), f"Triton answers on {outside}"


def test_host_flag_binds_every_endpoint():
    from python_backend_lib.apps.cli import build_parser
    from python_backend_lib.apps.server import ServerSettings, TritonInstallation, TritonServer

    args = build_parser().parse_args(["serve", "--host", "0.0.0.0"])
    settings = ServerSettings(model_repository=Path("/models"), host=args.host)
    command = TritonServer(settings).command(TritonInstallation(Path("tritonserver"), Path("/backends")))
    for endpoint in ("http", "grpc", "metrics"):
        assert f"--{endpoint}-address=0.0.0.0" in command
