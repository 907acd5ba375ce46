"""How a process's threads wait for its GPU: on a core, or asleep (`sleep_on_gpu_waits`).

CUDA's default ("auto") keeps a waiting thread on its core, polling, whenever the
process has fewer CUDA contexts than the host has cores: every synchronize, every
blocking copy. That is right for an engine, which waits for each decoder step and
must see it end at once; wrong for a process that mostly waits, such as
preprocessing beside the engines. Our own waits there sleep already
(`transfers.wait_idle`), but Triton's stub does its own: each GPU output it sends
is copied with `cudaMemcpy` and a synchronize of the default stream, which also
waits for the log-mels that the process's other threads queued there. At
saturation that `send` was a third of preprocessing's decoding threads' time on a
core (docs/benchmarks/latency/lone-clip-tiny/lone-clip-runs.json, `stub_profile`).

The wait mode belongs to the device's primary context, which every CUDA runtime
in the process shares (the stub's and torch's), so it is set through the driver:
before the context exists, or on it while it lives (`cuCtxSetFlags`, CUDA 12.1 on).
"""

from __future__ import annotations

import ctypes
import logging
from enum import IntEnum
from functools import cache

import torch

log = logging.getLogger(__name__)

_SCHED_MASK = 0x07


class WaitMode(IntEnum):
    """The driver's scheduling flags (CU_CTX_SCHED_*): how a thread waits for the GPU."""

    AUTO = 0x00  # poll while the process has fewer contexts than the host has cores, else yield
    SPIN = 0x01  # poll
    YIELD = 0x02  # poll, giving the core up between polls
    BLOCKING = 0x04  # sleep until the driver wakes the thread


class DriverError(RuntimeError):
    """A CUDA driver call failed."""


@cache
def _driver() -> ctypes.CDLL:
    driver = ctypes.CDLL("libcuda.so.1")
    _check(driver.cuInit(0), "cuInit")
    return driver


def _check(status: int, call: str) -> None:
    if status != 0:
        raise DriverError(f"{call} failed with CUDA driver error {status}")


def _device_handle(device: torch.device) -> ctypes.c_int:
    handle = ctypes.c_int()
    index = device.index if device.index is not None else torch.cuda.current_device()
    _check(_driver().cuDeviceGet(ctypes.byref(handle), index), "cuDeviceGet")
    return handle


def primary_context_mode(device: torch.device) -> tuple[WaitMode, bool]:
    """The wait mode of `device`'s primary context, and whether the context exists yet."""
    flags, active = ctypes.c_uint(), ctypes.c_int()
    _check(_driver().cuDevicePrimaryCtxGetState(_device_handle(device), ctypes.byref(flags), ctypes.byref(active)),
           "cuDevicePrimaryCtxGetState")
    return WaitMode(flags.value & _SCHED_MASK), bool(active.value)


def set_wait_mode(device: torch.device, mode: WaitMode) -> None:
    """Every thread of this process waits for `device` in `mode` from now on."""
    driver, handle = _driver(), _device_handle(device)
    flags, active = ctypes.c_uint(), ctypes.c_int()
    _check(driver.cuDevicePrimaryCtxGetState(handle, ctypes.byref(flags), ctypes.byref(active)),
           "cuDevicePrimaryCtxGetState")
    new_flags = (flags.value & ~_SCHED_MASK) | int(mode)
    # Kept for the context made later, or made again after a reset.
    _check(driver.cuDevicePrimaryCtxSetFlags_v2(handle, new_flags), "cuDevicePrimaryCtxSetFlags_v2")
    if not active.value:
        return
    # The context lives already (the stub, or torch, made it): set it on the context itself.
    context = ctypes.c_void_p()
    _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
    try:
        _check(driver.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            _check(driver.cuCtxSetFlags(ctypes.c_uint(new_flags)), "cuCtxSetFlags")
        finally:
            _check(driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")
    finally:
        _check(driver.cuDevicePrimaryCtxRelease_v2(handle), "cuDevicePrimaryCtxRelease")


def sleep_on_gpu_waits(device: torch.device) -> None:
    """This process's threads sleep while they wait for `device` (`WaitMode.BLOCKING`):
    for a process whose threads mostly wait for a GPU that others keep busy. Logs a
    warning, and leaves CUDA's default, where the driver refuses."""
    try:
        set_wait_mode(device, WaitMode.BLOCKING)
    except (OSError, AttributeError, DriverError) as error:  # no libcuda, an old driver
        log.warning("threads keep polling while they wait for %s: %s", device, error)
