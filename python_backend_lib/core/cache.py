"""Where whisper-triton keeps what it builds once and reuses: converted
checkpoints (`checkpoints`) and the assembled Triton backend (`apps.server`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CACHE_ENV = "WHISPER_TRITON_CACHE"


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """`WHISPER_TRITON_CACHE`, or ~/.cache/whisper-triton when it is unset or empty.

    An empty value counts as unset, as it does for most tools: `VAR=` in a compose
    file or a shell usually means "no setting", and taken literally it would put
    the cache in whatever folder the process happens to start in.
    """
    value = environ.get(CACHE_ENV)
    return Path(value) if value else Path.home() / ".cache" / "whisper-triton"
