"""`devices.cudnn`: a process whose PyTorch cuDNN fails to load says why, naming the
library path; one whose cuDNN loads, or that has no GPU, says nothing. The queries
torch answers are replaced here: a CI machine has no GPU, and tests/gpu/test_gpu_cudnn.py
asks the real ones on a GPU."""

from __future__ import annotations

import pytest
import torch

from python_backend_lib.devices import cudnn

MISMATCH = "cuDNN version incompatibility: PyTorch was compiled  against (9, 19, 0) but found runtime version (9, 14, 0)."


@pytest.fixture
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/whisper-triton/lib:/usr/lib/x86_64-linux-gnu")


def test_a_cudnn_that_fails_its_version_check_is_reported_with_the_library_path(on_a_gpu, monkeypatch):
    def mismatched() -> int:
        raise RuntimeError(MISMATCH + "\nPyTorch already comes bundled with cuDNN.")

    monkeypatch.setattr(torch.backends.cudnn, "version", mismatched)
    problem = cudnn.cudnn_problem()
    assert problem is not None
    assert MISMATCH in problem and "\n" not in problem
    assert "LD_LIBRARY_PATH (/opt/whisper-triton/lib:/usr/lib/x86_64-linux-gnu)" in problem


def test_a_missing_cudnn_is_reported(on_a_gpu, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: None)
    assert "finds no cuDNN" in cudnn.cudnn_problem()


def test_a_cudnn_that_loads_or_no_gpu_says_nothing(on_a_gpu, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    assert cudnn.cudnn_problem() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: None)
    assert cudnn.cudnn_problem() is None
