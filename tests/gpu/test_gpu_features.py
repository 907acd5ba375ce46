"""The log-mel on a GPU is queued behind the engine's work, never waits for it.

The whisper model computes the log-mel of a whole `execute` call on the device
where the engine thread has decoder steps queued. A copy from pageable memory
(a waveform, or a small tensor of lengths) waits for all of them, which costs
`execute` milliseconds per call and serialises it behind the engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from python_backend_lib.audio.features import features_for, features_for_many
from python_backend_lib.core.geometry import SAMPLE_RATE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
QUEUED_CYCLES = 2_000_000_000  # about a second of one kernel's spinning: far longer than the call


def _waveforms() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(int(seconds * SAMPLE_RATE)).astype(np.float32) * 0.1 for seconds in (1.5, 7, 30, 41)]


def test_the_log_mel_of_a_batch_does_not_wait_for_queued_device_work():
    waveforms = _waveforms()
    expected = features_for_many(waveforms, 80, CUDA)  # first use: filters and FFT plans are made here
    torch.cuda.synchronize()
    torch.cuda._sleep(QUEUED_CYCLES)
    queued_work = torch.cuda.Event()
    queued_work.record()
    got = features_for_many(waveforms, 80, CUDA)
    assert not queued_work.query(), "features_for_many waited for the device work queued before it"
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    # The batched pass equals each recording's own, here on the GPU as on the CPU.
    for waveform, item in zip(waveforms, got):
        assert torch.equal(item, features_for(waveform, 80, CUDA))


def test_the_captured_log_mel_equals_each_recordings_own_and_does_not_wait():
    """`FeatureGraphs`: calls of 1, 3 and 19 clips (a partly padded bucket, and more
    clips than the largest bucket), short and long, give `features_for`'s bits."""
    from python_backend_lib.audio.feature_graphs import FeatureGraphs

    graphs = FeatureGraphs(80, CUDA)
    graphs.capture()
    rng = np.random.default_rng(1)
    many = [rng.standard_normal(int(rng.uniform(0.3, 30) * SAMPLE_RATE)).astype(np.float32) * 0.1 for _ in range(19)]
    for waveforms in (_waveforms()[:1], _waveforms(), many):
        expected = [features_for(w, 80, CUDA) for w in waveforms]
        torch.cuda.synchronize()
        torch.cuda._sleep(QUEUED_CYCLES)
        queued_work = torch.cuda.Event()
        queued_work.record()
        got = graphs.features(waveforms)
        assert not queued_work.query(), "the captured log-mel waited for the device work queued before it"
        assert len(got) == len(waveforms)
        for a, b in zip(got, expected):
            assert a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("output", ["host", "device"])
def test_preprocessing_hands_on_each_recordings_log_mel_without_its_padding(output):
    """`LogMels` on a GPU, as a GPU instance of preprocessing runs it: each recording's
    `features_for` cut to the frames that travel, bit for bit, on the host or on the GPU."""
    from python_backend_lib.audio.features import without_padding
    from python_backend_lib.serving.preprocessing_service import LogMels
    from python_backend_lib.serving.settings import LogMelOutput

    log_mels = LogMels(80, "cuda:0", LogMelOutput(output))
    waveforms = _waveforms()
    got = log_mels(waveforms)
    for waveform, item in zip(waveforms, got):
        expected = without_padding(features_for(waveform, 80, CUDA), len(waveform))
        if output == "host":
            assert isinstance(item, np.ndarray) and np.array_equal(item, expected.cpu().numpy())
        else:
            assert item.is_cuda and item.is_contiguous() and torch.equal(item, expected)


class _GpuInput:
    """A `pb_utils.Tensor` in GPU memory, as Triton hands one to whisper."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def to_dlpack(self):
        return torch.utils.dlpack.to_dlpack(self.tensor)


def test_whisper_copies_its_inputs_before_execute_returns_and_does_not_wait_for_the_engine():
    """Host inputs end to end through one copy, GPU inputs on a stream of their own:
    the copies equal what was sent, and nothing waits for the engine's queued steps."""
    import types

    from python_backend_lib.serving.inputs import LogMelInput
    from python_backend_lib.serving.whisper_service import WhisperService

    rng = np.random.default_rng(2)
    sent = [rng.standard_normal((80, n)).astype(np.float32) for n in (103, 2, 3000)]
    on_gpu = torch.from_numpy(sent[1]).to(CUDA)[None]  # [1, 80, 2], as Triton's buffer holds it
    inputs = [LogMelInput(16000, host=sent[0]), LogMelInput(320, gpu=_GpuInput(on_gpu)),
              LogMelInput(480000, host=sent[2])]
    service = types.SimpleNamespace(pipeline=types.SimpleNamespace(device=CUDA), _copies=torch.cuda.Stream(CUDA))
    torch.cuda.synchronize()
    torch.cuda._sleep(QUEUED_CYCLES)  # the engine's steps, queued on the default stream
    queued_work = torch.cuda.Event()
    queued_work.record()
    got = WhisperService._on_device(service, inputs)
    assert not queued_work.query(), "copying the inputs waited for the engine's queued work"
    for array, tensor in zip(sent, got):
        assert tensor.is_cuda and torch.equal(tensor.cpu(), torch.from_numpy(array))
