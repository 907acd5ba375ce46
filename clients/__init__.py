"""Clients for a whisper-triton server: a Python API (`WhisperClient`) and the `transcribe` command."""

from clients.api import ServerUnreachable, TimedOut, TranscriptionError, TranscriptionResult, WhisperClient

__all__ = ["ServerUnreachable", "TimedOut", "TranscriptionError", "TranscriptionResult", "WhisperClient"]
