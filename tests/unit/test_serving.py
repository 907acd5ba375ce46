"""The helpers that the Triton adapters share, checked without a server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest

from python_backend_lib.audio.decode import MAX_CHANNELS, AudioError, decode_audio, pcm_to_waveform
from python_backend_lib.contract.decoded_tensors import DecodedTensors, from_tensors
from python_backend_lib.contract.faults import Fault, fault_of_message
from python_backend_lib.contract.parameters import parse_request_parameters
from python_backend_lib.core.encoder_kernel import EncoderKernel
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import DecodingOptions, TranscribeOptions
from python_backend_lib.engine.faults import FaultPlan, InjectedFault
from python_backend_lib.engine.scheduler import EngineUnavailable
from python_backend_lib.serving.admission import AdmissionPolicy, Overloaded
from python_backend_lib.serving.cancellation import POSTED_FOR_S, STOPPING, CancelBoard, CancellationWatcher
from python_backend_lib.serving.inputs import check_log_mel, nonfinite, single_row
from python_backend_lib.serving.responses import describe_failure
from python_backend_lib.serving.settings import (
    CHECKPOINT_ENV,
    DEFAULT_MAX_AUDIO_SECONDS,
    ENGINE_FAULT_PROMPT_ENV,
    FAULT_PROMPT_ENV,
    SHARED_ADMISSION_WAIT_S,
    LogMelOutput,
    ModelSettings,
    instance_device,
    log_mel_handover,
)
from python_backend_lib.serving.whisper_pipeline import load_pipeline
from python_backend_lib.text.formats import Document


def triton_config(**fields) -> str:
    return json.dumps({"name": "whisper", "max_batch_size": 64, **fields})


def test_model_settings_default_to_the_packaged_checkpoint():
    settings = ModelSettings.from_triton(triton_config(), environ={})
    assert settings == ModelSettings(name="whisper", max_batch_size=64, checkpoint="default")


def test_model_settings_take_the_config_then_the_environment():
    config = triton_config(parameters={"checkpoint": {"string_value": "/models/base"}})
    assert ModelSettings.from_triton(config, environ={}).checkpoint == "/models/base"
    overridden = ModelSettings.from_triton(config, environ={CHECKPOINT_ENV: "/models/small"})
    assert overridden.checkpoint == "/models/small"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (triton_config(max_batch_size=0), "max_batch_size must be at least 1"),
        (triton_config(parameters={"beam": {"string_value": "5"}}), "unknown config parameter"),
    ],
)
def test_model_settings_reject_a_config_they_cannot_serve(config, message):
    with pytest.raises(ValueError, match=message):
        ModelSettings.from_triton(config, environ={})


def test_single_row_takes_one_clip_and_names_the_tensor():
    assert single_row(np.zeros((1, 80, 100)), "LOG_MEL").shape == (80, 100)
    with pytest.raises(RequestError, match=r"LOG_MEL must hold exactly one clip .* \[2, 80, 100\]"):
        single_row(np.zeros((2, 80, 100)), "LOG_MEL")


def test_the_preprocessing_and_whisper_choices_parse():
    config = triton_config(parameters={"log_mel_output": {"string_value": "device"},
                                       "FORCE_CPU_ONLY_INPUT_TENSORS": {"string_value": "no"}})
    settings = ModelSettings.from_triton(config, environ={})
    assert settings.log_mel_output is LogMelOutput.DEVICE and not settings.cpu_only_inputs
    shipped = ModelSettings.from_triton(triton_config(), environ={})
    assert shipped.cpu_only_inputs and shipped.log_mel_output is None  # "auto"
    assert log_mel_handover(None, gpus=1) is LogMelOutput.DEVICE
    assert log_mel_handover(None, gpus=2) is LogMelOutput.HOST  # never across GPUs (the two-GPU stall)
    assert log_mel_handover(LogMelOutput.DEVICE, gpus=2) is LogMelOutput.DEVICE
    assert shipped.stall_timeout_s is None  # auto: the device's bound
    stall = triton_config(parameters={"stall_timeout_s": {"string_value": "90"}})
    assert ModelSettings.from_triton(stall, environ={}).stall_timeout_s == 90.0
    assert ModelSettings.from_triton(stall, environ={"WHISPER_TRITON_STALL_TIMEOUT_S": "5"}).stall_timeout_s == 5.0
    bad = triton_config(parameters={"log_mel_output": {"string_value": "pcie"}})
    with pytest.raises(ValueError, match=r"'log_mel_output' must be 'auto' or one of \['device', 'host'\], got 'pcie'"):
        ModelSettings.from_triton(bad, environ={})


def test_the_encoder_attention_kernel_parses():
    def kernel(value: str) -> EncoderKernel | None:
        config = triton_config(parameters={"encoder_attention": {"string_value": value}})
        return ModelSettings.from_triton(config, environ={}).encoder_kernel

    assert ModelSettings.from_triton(triton_config(), environ={}).encoder_kernel is None
    assert kernel("auto") is None
    assert kernel("sdpa") is EncoderKernel.SDPA
    assert kernel("flashinfer") is EncoderKernel.FLASHINFER
    with pytest.raises(ValueError, match=r"'encoder_attention' must be 'auto' or one of \['flashinfer', 'sdpa'\], got 'fa3'"):
        kernel("fa3")


def test_failures_are_the_clients_only_when_they_are_request_errors():
    assert describe_failure(RequestError("unknown request parameter 'beam'")) == (
        "unknown request parameter 'beam'", Fault.CLIENT
    )
    assert describe_failure(AudioError("audio is empty")) == ("audio is empty", Fault.CLIENT)
    assert describe_failure(CancelledError("request cancelled")) == ("cancelled: request cancelled", Fault.CANCELLED)
    gave_up = describe_failure(EngineUnavailable("the engine is unhealthy and refuses new work: CUDA error"))
    assert gave_up.fault is Fault.UNAVAILABLE and "retry on another server" in gave_up.message
    failure = describe_failure(RuntimeError("CUDA out of memory"))
    assert failure.message == "internal error: RuntimeError: CUDA out of memory" and failure.fault is Fault.SERVER
    # A ValueError that is not a RequestError is a bug of ours, such as a broken invariant in the KV pool.
    failure = describe_failure(ValueError("slot 3 is already free"))
    assert failure == ("internal error: ValueError: slot 3 is already free", Fault.SERVER)
    # The engine's test fault hook raises one, so the served tests show the same through the server.
    assert issubclass(InjectedFault, ValueError) and not issubclass(InjectedFault, RequestError)
    assert describe_failure(InjectedFault("injected")).fault is Fault.SERVER


@pytest.mark.parametrize(
    "error",
    [
        RequestError("unknown request parameter 'beam'"),
        AudioError("not a decodable audio file"),
        CancelledError("request cancelled"),
        Overloaded("server overloaded: 80 requests in flight, the limit is 80; retry later"),
        EngineUnavailable("the engine is unhealthy"),
        RuntimeError("CUDA out of memory"),
        ValueError("slot 3 is already free"),
    ],
)
def test_a_streamed_errors_fault_is_read_back_from_its_message(error):
    """A gRPC stream's error carries no code: its message alone must say whose fault it was."""
    message, fault = describe_failure(error)
    assert fault_of_message(message) is fault


def test_tritons_own_stream_errors_are_not_the_clients():
    assert fault_of_message("Exceeds maximum queue size") is Fault.OVERLOADED
    assert fault_of_message("Failed to process the request(s) for model 'whisper_stream_0_0', message: Stub "
                            "process 'whisper_stream_0_0' is not healthy.") is Fault.SERVER


@pytest.mark.parametrize(
    ("make", "client_fault"),
    [
        (lambda: parse_request_parameters({"beam": 5}), True),
        (lambda: parse_request_parameters("not json"), True),
        (lambda: DecodingOptions(temperature=3.0), True),
        (lambda: TranscribeOptions(mode="parallel"), True),
        (lambda: decode_audio(b"not audio"), True),
        (lambda: pcm_to_waveform(b"\0" * 8, 16_000, channels=MAX_CHANNELS + 1), True),
        (lambda: check_log_mel(_PbUtils, whisper_request(np.zeros((80, 9), np.float32), 0), 80, 60.0), True),
        (lambda: from_tensors(DecodedTensors(*(np.zeros(0),) * 5), 16000), True),
        (lambda: Document.from_verbose_json("{}"), True),
        # The server's own setup: a bad limit, a bad config.pbtxt.
        (lambda: decode_audio(b"RIFF", max_seconds=0), False),
        (lambda: ModelSettings.from_triton(triton_config(max_batch_size=0), environ={}), False),
    ],
    ids=["parameter", "json", "options", "long-form mode", "audio", "channels", "log-mel", "decoded", "transcript",
         "max-seconds", "config"],
)
def test_whose_fault_each_refusal_is(make, client_fault):
    with pytest.raises(ValueError) as caught:
        make()
    assert isinstance(caught.value, RequestError) == client_fault, caught.value
    assert (describe_failure(caught.value).fault is Fault.CLIENT) == client_fault


def test_the_cancellation_watcher_asks_in_bulk_off_the_callers_thread():
    """The engine only reads a flag; the watcher's thread asks each request, and a
    cancelled request stays cancelled without being asked again."""
    asked = {"a": 0, "b": 0}
    caller = threading.get_ident()
    askers = set()

    def asker(name, cancel_after):
        def is_cancelled():
            askers.add(threading.get_ident())
            asked[name] += 1
            return asked[name] >= cancel_after

        return is_cancelled

    watcher = CancellationWatcher(interval_s=0.01)
    try:
        a, b = watcher.watch(asker("a", 3)), watcher.watch(asker("b", 10**9))
        assert not a.cancelled() and not b.cancelled()
        deadline = time.monotonic() + 10
        while not a.cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.cancelled() and not b.cancelled()
        watcher.forget(b)
        frozen = dict(asked)
        time.sleep(0.1)
        assert asked["a"] == frozen["a"] == 3  # cancelled: never asked again
        assert asked["b"] == frozen["b"]  # forgotten: never asked again
        assert caller not in askers and watcher.watched == 1
    finally:
        watcher.close()


def test_a_forgotten_watch_is_never_asked_again_even_mid_poll():
    """forget() waits for a question in progress: after it returns the request is
    answered, and asking Triton about it then would crash the server."""
    asking, release = threading.Event(), threading.Event()
    asked_after_forget = []
    forgotten = threading.Event()

    def slow_question():
        if forgotten.is_set():
            asked_after_forget.append(True)
        asking.set()
        release.wait(10)
        return False

    watcher = CancellationWatcher(interval_s=0.001)
    try:
        watch = watcher.watch(slow_question)
        assert asking.wait(10)
        forgetter = threading.Thread(target=lambda: (watcher.forget(watch), forgotten.set()))
        forgetter.start()
        forgetter.join(0.2)
        assert forgetter.is_alive()  # waits for the question in progress
        release.set()
        forgetter.join(10)
        time.sleep(0.05)
        assert forgotten.is_set() and not asked_after_forget
    finally:
        release.set()
        watcher.close()


def test_a_watch_that_cannot_be_asked_does_not_stop_the_watcher():
    def broken():
        raise RuntimeError("request already answered")

    watcher = CancellationWatcher(interval_s=0.01)
    try:
        broken_watch = watcher.watch(broken)
        fine = watcher.watch(lambda: True)
        deadline = time.monotonic() + 10
        while not fine.cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fine.cancelled() and not broken_watch.cancelled()
    finally:
        watcher.close()


def test_model_settings_parse_the_operating_limits():
    config = triton_config(
        parameters={
            "max_audio_seconds": {"string_value": "600"},
            "max_queued_requests": {"string_value": "0"},
            "kv_slots": {"string_value": "8"},
            "kv_memory_fraction": {"string_value": "auto"},
        }
    )
    settings = ModelSettings.from_triton(config, environ={})
    assert (settings.max_audio_seconds, settings.max_queued_requests, settings.kv_slots) == (600.0, 0, 8)
    assert settings.kv_memory_fraction is None
    assert settings.admission(slots=8, on_gpu=True) == AdmissionPolicy(limit=8)  # no queue: only the slots
    assert settings.admission(slots=8, on_gpu=True, engines=3) == AdmissionPolicy(limit=8, wait_s=SHARED_ADMISSION_WAIT_S)
    default = ModelSettings.from_triton(triton_config(), environ={})
    assert default.max_audio_seconds == DEFAULT_MAX_AUDIO_SECONDS
    assert default.admission(slots=16, on_gpu=False) == AdmissionPolicy(limit=32)  # one batch waits, refused at once
    assert default.admission(slots=256, on_gpu=True) == AdmissionPolicy(limit=2048)  # a GPU engine turns over faster
    # Engines that share Triton's queue keep one batch each, and wait for room: Triton's queue holds the rest.
    assert default.admission(slots=256, on_gpu=True, engines=3) == AdmissionPolicy(512, SHARED_ADMISSION_WAIT_S)


@pytest.mark.parametrize(
    ("key", "value"),
    [("kv_slots", "0"), ("kv_slots", "1.5"), ("kv_memory_fraction", "1.2"), ("max_audio_seconds", "ten"),
     ("max_queued_requests", "-1")],
)
def test_model_settings_refuse_a_bad_limit_naming_it(key, value):
    config = triton_config(parameters={key: {"string_value": value}})
    with pytest.raises(ValueError, match=f"config parameter {key!r} must be 'auto' or .* got {value!r}"):
        ModelSettings.from_triton(config, environ={})


class _Tensor:
    """What `pb_utils.get_input_tensor_by_name` gives for a tensor in host memory."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def is_cpu(self) -> bool:
        return True

    def as_numpy(self) -> np.ndarray:
        return self.array


class _PbUtils:
    @staticmethod
    def get_input_tensor_by_name(request: dict, name: str) -> _Tensor:
        return _Tensor(request[name])


def whisper_request(log_mel: np.ndarray, samples) -> dict:
    return {"LOG_MEL": log_mel[None], "SAMPLES": np.array([samples], dtype=np.int64).reshape(1, -1)}


@pytest.mark.parametrize(
    ("log_mel", "samples", "message"),
    [
        (np.zeros((128, 100), np.float32), 16000, r"LOG_MEL must be float32 \[80, frames\] with 1 to 3000 frames for SAMPLES 16000 .* got float32 \[128, 100\]"),
        (np.zeros((80, 100), np.float64), 16000, r"got float64 \[80, 100\]"),
        (np.zeros((80, 3001), np.float32), 16000, r"with 1 to 3000 frames .* got float32 \[80, 3001\]"),
        (np.zeros((80, 0), np.float32), 16000, r"with 1 to 3000 frames .* got float32 \[80, 0\]"),
        (np.zeros((80, 100), np.float32), 0, "SAMPLES must be at least 1, got 0"),
        (np.zeros((80, 100), np.float32), [1, 2], r"SAMPLES must have the shape \[1, 1\], got \[1, 2\]"),
        (np.zeros((80, 100), np.float32), 16000 * 601, "audio is 601.0 s long; the limit is 600 s"),
    ],
    ids=["bins", "dtype", "frames", "no-frames", "no-samples", "samples-shape", "too-long"],
)
def test_what_the_whisper_model_is_sent_is_checked(log_mel, samples, message):
    with pytest.raises(RequestError, match=message):
        check_log_mel(_PbUtils, whisper_request(log_mel, samples), n_mels=80, max_audio_seconds=600)


def test_a_log_mel_as_preprocessing_writes_it_passes():
    checked = check_log_mel(_PbUtils, whisper_request(np.zeros((80, 1103), np.float32), 176000), 80, 600)
    assert checked.samples == 176000 and checked.host.shape == (80, 1103) and checked.gpu is None
    long = check_log_mel(_PbUtils, whisper_request(np.zeros((80, 6000), np.float32), 480001), 80, 600)
    assert long.host.shape == (80, 6000)  # a long recording's frames and its window of padding, at most


def test_the_log_mels_holding_nan_or_infinity_are_found_among_many():
    rng = np.random.default_rng(0)
    log_mels = [rng.uniform(-1, 1, (80, n)).astype(np.float32) for n in (100, 4, 800, 1, 100)]
    assert nonfinite(log_mels) == set() and nonfinite([]) == set()
    log_mels[1][3, 3] = np.nan
    log_mels[3][0, 0] = -np.inf
    log_mels[4][0, :2] = np.finfo(np.float32).max  # finite values whose sum of squares is not
    assert nonfinite([*log_mels, None]) == {1, 3}  # None: one in GPU memory, not checked here


def test_the_instance_device_is_the_one_triton_names():
    assert instance_device({"model_instance_kind": "GPU", "model_instance_device_id": "1"}) == "cuda:1"
    assert instance_device({"model_instance_kind": "CPU", "model_instance_device_id": "0"}) == "cpu"


def test_the_fault_hooks_are_off_unless_their_variables_are_set():
    settings = ModelSettings.from_triton(triton_config(parameters={"checkpoint": {"string_value": "random:tiny"}}), environ={})
    plain = load_pipeline(settings, device="cpu", environ={})
    assert type(plain.engine.batch).__name__ == "DecodeBatch"
    hooked = load_pipeline(settings, device="cpu", environ={FAULT_PROMPT_ENV: "boom", ENGINE_FAULT_PROMPT_ENV: "crash"})
    assert hooked.engine.batch.plan == FaultPlan(step_prompt="boom", engine_prompt="crash")
    for pipeline in (plain, hooked):
        pipeline.close()


# A model's process: starts its parent watch, says so, then blocks in C holding the interpreter
# lock (PyDLL keeps it), as a stub thread waiting on a dead tritonserver does.
STUCK_MODEL = """
import ctypes, sys
from python_backend_lib.serving.parent_watch import ParentWatch
watch = ParentWatch(interval_s=0.1)
print(watch.watcher.pid, flush=True)
ctypes.PyDLL(None).sleep(120)
"""
# Its tritonserver: starts it with its output on pipes that end with the server (as Triton
# does: a watcher that wrote there would die of SIGPIPE), passes on what it prints, and
# waits to be killed.
SERVER = """
import subprocess, sys, time
model = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
print(model.pid, model.stdout.readline().strip(), flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    """Ended: no process, or a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _gone(pid)


def test_the_parent_watch_ends_an_orphan_whose_threads_are_all_stuck():
    server = subprocess.Popen([sys.executable, "-c", SERVER, STUCK_MODEL], stdout=subprocess.PIPE, text=True)
    try:
        model, watcher = (int(pid) for pid in server.stdout.readline().split())
        time.sleep(0.5)
        assert not _gone(model), "the watch ended a model whose server is there"
        server.kill()
        server.wait()
        assert _wait_gone(model, 5.0), "the orphaned model process still runs"
        assert _wait_gone(watcher, 5.0), "the watcher outlived the process it watched"
    finally:
        server.kill()


def test_a_closed_parent_watch_leaves_no_process_behind():
    from python_backend_lib.serving.parent_watch import ParentWatch

    watch = ParentWatch(interval_s=0.1)
    assert not _gone(watch.watcher.pid)
    watch.close()
    assert watch.watcher.poll() is not None
    assert not _gone(os.getpid())


def test_a_cancel_posted_on_the_board_reaches_the_watch_of_that_id(tmp_path):
    """Two watchers stand for two whisper instances (processes) of one server: a
    cancel posted by one reaches the request the other holds; an id posted for no
    request is kept (its request may arrive later) until POSTED_FOR_S, and a
    cancelled request's id leaves the board once it is answered."""
    folder = tmp_path / "board"
    here, there = CancelBoard(folder), CancelBoard(folder)
    watcher = CancellationWatcher(there, interval_s=0.01)
    try:
        held = watcher.watch(lambda: False, "id-held-there")
        other = watcher.watch(lambda: False, "id-of-another")
        anonymous = watcher.watch(lambda: False)
        here.post("id-held-there")
        here.post("id-of-nobody")
        deadline = time.monotonic() + 10
        while not held.cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held.cancelled() and not other.cancelled() and not anonymous.cancelled()
        watcher.forget(held)
        assert here.posted() == {"id-of-nobody"}
        stale = folder / "id-of-nobody"
        os.utime(stale, (time.time() - POSTED_FOR_S - 1,) * 2)
        deadline = time.monotonic() + 10
        while stale.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not stale.exists()
    finally:
        watcher.close()
    assert not folder.exists()  # the server stopped: nothing left to cancel


def test_a_cancel_sent_to_the_instance_holding_the_request_flags_it_at_once(tmp_path):
    """The instance a cancel reaches flags its own request without waiting for the next
    poll (a quarter of the second within which Ctrl-C must be answered), and posts the
    id on the board for the other instances all the same."""
    board = CancelBoard(tmp_path / "board")
    watcher = CancellationWatcher(board, interval_s=3600.0)  # no poll during the test
    try:
        held = watcher.watch(lambda: False, "id-held-here")
        other = watcher.watch(lambda: False, "id-of-another")
        watcher.post("id-held-here")
        assert held.cancelled() and not other.cancelled()
        assert board.posted() == {"id-held-here"}
    finally:
        watcher.close()


def test_a_stopping_server_tells_every_watcher_once_and_keeps_the_mark(tmp_path):
    """The launcher's STOPPING mark (its drain ran out) reaches every instance's watcher,
    which calls back once; the mark is never swept away as a stale id."""
    folder = tmp_path / "board"
    launcher = CancelBoard(folder)
    calls: list[str] = []
    watchers = [CancellationWatcher(CancelBoard(folder), interval_s=0.01, on_stopping=lambda i=i: calls.append(i))
                for i in ("a", "b")]
    try:
        launcher.post("id-of-nobody")
        launcher.post_stopping()
        os.utime(folder / STOPPING, (time.time() - POSTED_FOR_S - 1,) * 2)
        deadline = time.monotonic() + 10
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # more polls: no second call
        assert sorted(calls) == ["a", "b"] and all(w.stopping for w in watchers)
        assert STOPPING in launcher.posted()
    finally:
        for watcher in watchers:
            watcher.close()
