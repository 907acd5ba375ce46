"""On a GPU, PyTorch's own cuDNN loads in the process the tests run in, as it must in the
server's whisper processes, which inherit the same library path. Under the GPU bundle's
env.sh before a30ddec (a system cuDNN shadowing torch's) this fails: attention had quietly
left cuDNN's kernels."""

from __future__ import annotations

import pytest
import torch

from python_backend_lib.devices.cudnn import cudnn_problem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_pytorchs_cudnn_loads_under_this_library_path():
    assert cudnn_problem() is None
