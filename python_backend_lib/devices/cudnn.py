"""Whether PyTorch's own cuDNN loads: a GPU process whose cuDNN fails still runs, on
slower kernels, without saying so.

torch's wheels carry cuDNN and load its engine libraries by name at run time. A folder
on LD_LIBRARY_PATH that holds another cuDNN (a system folder such as
/usr/lib/x86_64-linux-gnu, put there for some other library) comes first, torch finds a
version it was not built against, and `torch.backends.cudnn` refuses to start: PyTorch's
attention then runs its own flash kernel instead of cuDNN's, and the encoder of a large
checkpoint takes longer for it. The engine reports it once, at load (`engine.loading`).
"""

from __future__ import annotations

import os

import torch


def cudnn_problem() -> str | None:
    """Why PyTorch's cuDNN does not load in this process, or None where it does (or
    where no GPU is there to use it)."""
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.backends.cudnn.version()
    except RuntimeError as error:  # a version mismatch: another cuDNN found first
        reason = str(error).strip().splitlines()[0]
    else:
        if version is not None:
            return None
        reason = "torch.backends.cudnn finds no cuDNN"
    path = os.environ.get("LD_LIBRARY_PATH", "")
    return (
        f"PyTorch's cuDNN does not load ({reason}): attention and convolutions run slower kernels. "
        f"A folder on LD_LIBRARY_PATH ({path or 'unset'}) holding another cuDNN comes before torch's own; "
        "take system folders such as /usr/lib/x86_64-linux-gnu off it"
    )
