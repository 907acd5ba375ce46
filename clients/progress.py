"""A progress line for one long file: what is being transcribed, and for how long so far.

The server answers a request whole, when its last window is decoded, so there
is no fraction done to show; the line says how much audio is being
transcribed (when its header tells) and how long it has taken so far, redrawn
each second on a terminal's stderr and erased when the answer comes. Short
files finish before it appears; a pipe or a log file never gets it.
"""

from __future__ import annotations

import io
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

FIRST_DRAW_S = 1.0  # a file answered sooner shows no line at all
REDRAW_S = 1.0
ERASE_LINE = "\r\x1b[K"


def audio_seconds(source: Path | bytes) -> float | None:
    """The audio's length from its header, when libsndfile can read it (WAV, FLAC,
    OGG, MP3); None otherwise: the line then shows the time taken only."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(source) if isinstance(source, bytes) else source)
    except Exception:  # any format libsndfile does not know: the server may still decode it
        return None
    return float(info.duration)


def clock(seconds: float) -> str:
    """m:ss, e.g. 75.2 -> '1:15'."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}:{secs:02d}"


class ProgressLine:
    """`with ProgressLine("talk.mp3", 182.0):` around the request; draws only on a terminal."""

    def __init__(self, name: str, seconds_of_audio: float | None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.name, self.seconds_of_audio = name, seconds_of_audio
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = False

    def text(self, elapsed: float) -> str:
        length = "" if self.seconds_of_audio is None else f" {clock(self.seconds_of_audio)} of audio"
        return f"{self.name}: transcribing{length} on the server, {clock(elapsed)} so far"

    def __enter__(self) -> ProgressLine:
        if self.stream.isatty():
            self._thread = threading.Thread(target=self._draw, name="progress-line", daemon=True)
            self._thread.start()
        return self

    def _draw(self) -> None:
        started = time.monotonic()
        if self._done.wait(FIRST_DRAW_S):
            return
        while True:
            self.stream.write(ERASE_LINE + self.text(time.monotonic() - started))
            self.stream.flush()
            self._drawn = True
            if self._done.wait(REDRAW_S):
                return

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            if self._drawn:
                self.stream.write(ERASE_LINE)
                self.stream.flush()
