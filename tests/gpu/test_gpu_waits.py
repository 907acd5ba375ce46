"""A process whose threads wait for the GPU asleep (`devices.gpu_waits`): set before the
CUDA context exists, or on it while it lives (as preprocessing does, once Triton's stub
and the log-mel graphs have made it), a thread waiting for a long kernel spends a small
share of that wait on its core; under CUDA's default it polls through all of it.

Each case runs in a process of its own: the mode belongs to the process's context.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# A kernel of about half a second, then a synchronize: the waiting thread's CPU time
# against the wait's wall time.
PROBE = textwrap.dedent("""
    import json, sys, time
    import torch
    from python_backend_lib.devices.gpu_waits import WaitMode, primary_context_mode, set_wait_mode

    when = sys.argv[1]
    device = torch.device("cuda:0")
    if when == "before":
        set_wait_mode(device, WaitMode.BLOCKING)
    torch.zeros(1, device=device)  # the context, as the stub and the log-mel graphs make it
    if when == "after":
        set_wait_mode(device, WaitMode.BLOCKING)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    wall, cpu = time.perf_counter(), time.thread_time()
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    mode, active = primary_context_mode(device)
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "mode": mode.name, "active": active}))
""")


ROOT = Path(__file__).resolve().parents[2]


def _probe(when: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", PROBE, when], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_thread_waits_for_the_gpu_asleep_once_the_mode_is_set(when):
    result = _probe(when)
    assert result["wall_s"] > 0.1, result  # the kernel was still running when the wait began
    assert result["cpu_s"] < 0.2 * result["wall_s"], result
    assert result["mode"] == "BLOCKING" and result["active"], result


def test_by_default_a_waiting_thread_polls_on_its_core():
    """The default the mode replaces: the measure above tells the two apart."""
    result = _probe("never")
    assert result["wall_s"] > 0.1, result
    assert result["cpu_s"] > 0.5 * result["wall_s"], result
    assert result["mode"] == "AUTO", result
