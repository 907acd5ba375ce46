"""Loading a checkpoint that does not fit on the GPU says what to change.

There is no GPU here: the real exception type, `torch.cuda.OutOfMemoryError`,
is raised from the allocation of the KV slots or of the weights.
"""

from __future__ import annotations

import pytest
import torch

from python_backend_lib.engine import loading
from python_backend_lib.engine.loading import EngineSetup, GpuMemoryError, out_of_memory_advice
from python_backend_lib.transcription.pipeline import Pipeline


def _out_of_memory(*args, **kwargs):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize(
    ("allocation", "slots", "stage"),
    [
        ("KVSlotPool", 64, "allocating 64 KV slots"),
        ("KVSlotPool", None, "allocating 16 KV slots"),
        ("Whisper.from_checkpoint", 8, "loading the weights"),
    ],
)
def test_out_of_gpu_memory_at_load_names_the_settings_to_change(monkeypatch, allocation, slots, stage):
    if allocation == "KVSlotPool":
        monkeypatch.setattr(loading, "KVSlotPool", _out_of_memory)
    else:
        monkeypatch.setattr(loading.Whisper, "from_checkpoint", _out_of_memory)
    with pytest.raises(GpuMemoryError) as caught:
        Pipeline.load("random:tiny", device="cpu", setup=EngineSetup(slots=slots))
    message = str(caught.value)
    assert stage in message and "'random:tiny'" in message
    for advice in ("`kv_slots` parameter in config.pbtxt", "`kv_memory_fraction`", "smaller checkpoint"):
        assert advice in message
    assert isinstance(caught.value.__cause__, torch.cuda.OutOfMemoryError)


def test_the_advice_says_how_the_slots_were_chosen():
    chosen = out_of_memory_advice("large-v3", torch.device("cuda:0"), "capturing CUDA graphs", None, 0.5)
    assert "on cuda:0 while capturing CUDA graphs" in chosen and "now auto, sized to 0.5 of free memory" in chosen
    assert "now 32 (set)" in out_of_memory_advice("large-v3", torch.device("cuda:0"), "x", 32, 0.5)
