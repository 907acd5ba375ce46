"""Clients for a whisper-triton server: a Python API (`WhisperClient`) and the `transcribe` command."""

from clients.api import TranscriptionError, TranscriptionResult, WhisperClient

__all__ = ["TranscriptionError", "TranscriptionResult", "WhisperClient"]
