"""tritonserver's process group tied to the launcher's life: the child dies with its parent,
and what an exited tritonserver leaves in its group (model stubs past Triton's exit
timeout, after a crash) is ended, so that no process keeps its memory, a GPU's included."""

from __future__ import annotations

import ctypes
import os
import signal

from python_backend_lib.serving.parent_watch import parent_of


def die_with_parent() -> None:
    """In the child: receive SIGTERM when the starting thread ends, so no server is orphaned."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        pass


def end_leftovers(group: int) -> None:
    """Kill what is left of an exited tritonserver's process group: model stubs that
    did not exit with it (Triton's exit timeout, a crash), which would otherwise keep
    their memory, a GPU's included. tritonserver leads its own group (start_new_session)."""
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left
        pass


def kill_child(pid: int, parent: int) -> bool:
    """SIGKILL `pid` if it is still a child of `parent` (a recycled pid is left alone);
    whether it was killed."""
    try:
        if parent_of(pid) != parent:
            return False
        os.kill(pid, signal.SIGKILL)
        return True
    except (OSError, ValueError, StopIteration):  # gone already, or not Linux
        return False
