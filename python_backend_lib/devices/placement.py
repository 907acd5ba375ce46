"""Which GPU a thread's CUDA work goes to, and how many CPU threads a GPU process's torch uses.

CUDA keeps a current device per thread, and every new thread starts on the first
GPU. PyTorch's operations follow their tensors' device, but several things launch
on the current device's stream instead: Triton kernels (`engine.step_kernels`
refuses a pointer of another device), CUDA graph capture and replay, new streams
and FlashInfer's plans. So an engine on any GPU but the first makes its GPU the
current one on every thread that launches its work: the thread that loads it,
its engine thread, and whoever calls its entry points (Triton's `execute`).

One more process-wide default: `torch.cuda.graph` captures on a side stream it
creates once per process, on whichever GPU was current at the first capture.
A process with engines on two GPUs would capture the second one's graphs on the
first GPU's stream (an empty graph, and Triton kernels refusing its pointers),
so every capture here names a stream of its own GPU.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch


def on_device(device: torch.device | str) -> ContextManager[None]:
    """A context in which `device` is the calling thread's current CUDA device
    (the one before is restored on leaving); nothing for the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def single_threaded_host() -> None:
    """One thread for torch's CPU work in a model process that is one of many: a GPU
    engine, whose host tensors are small, or a preprocessing instance, one of several
    computing log-mels side by side (for the whole process: call it where the process is
    the model's own). Otherwise each would keep a thread per core spinning after every
    parallel operation, all of them together on the same cores."""
    torch.set_num_threads(1)
