"""Where whisper-triton keeps what it builds once and reuses: converted
checkpoints (`checkpoints`) and the assembled Triton backend (`apps.server`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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


@contextmanager
def staged_folder(target: Path, complete_file: str) -> Iterator[Path]:
    """A temporary folder beside `target` for the block to fill, then renamed to `target`,
    so that processes writing the same cache entry at once never see half a folder. A
    process that loses the race keeps the winner's (its `complete_file` is there); any
    other failure is raised. The staging folder is removed in every case."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        try:
            staging.rename(target)
        except OSError:
            if not (target / complete_file).exists():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
