"""A progress line for one long file: what is being transcribed, how far along it
likely is, and how long is likely left.

The server answers a request whole, when its last window is decoded, and tells
nothing before: the fraction done is an estimate. It comes from the speed this
server showed on earlier files (seconds taken per second of audio, remembered
per server URL in the cache folder, `SpeedRecord`) and the file's length from
its header: "~40%, about 0:12 left". A first file on a server, or audio whose
length the header does not tell, shows the time taken so far only; a file that
runs past its estimate says so rather than stop at 99%. The line is redrawn
each second on a terminal's stderr and erased when the answer comes. Short
files finish before it appears; a pipe or a log file never gets it.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from python_backend_lib.core.cache import cache_root

FIRST_DRAW_S = 1.0  # a file answered sooner shows no line at all
REDRAW_S = 1.0
ERASE_LINE = "\r\x1b[K"
# Files shorter than this say little of the speed on long ones (the fixed costs weigh most).
MIN_MEASURED_AUDIO_S = 20.0
# A new measurement counts this much against the remembered speed (the server's load varies).
NEW_MEASUREMENT_WEIGHT = 0.5
SPEED_FILE = "transcribe-speed.json"


class SpeedRecord:
    """Seconds this server took per second of audio, remembered between runs (a JSON
    file of server URL -> seconds). Losing it loses only the estimate."""

    def __init__(self, server: str, path: Path | None = None) -> None:
        self.server = server
        self.path = path or cache_root() / SPEED_FILE

    def _read(self) -> dict[str, float]:
        try:
            values = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return values if isinstance(values, dict) else {}

    def seconds_per_audio_second(self) -> float | None:
        value = self._read().get(self.server)
        return float(value) if isinstance(value, (int, float)) and value > 0 else None

    def measured(self, seconds_of_audio: float | None, seconds_taken: float) -> None:
        """Remember how fast a transcription went (files under MIN_MEASURED_AUDIO_S are not telling)."""
        if seconds_of_audio is None or seconds_of_audio < MIN_MEASURED_AUDIO_S:
            return
        speed = seconds_taken / seconds_of_audio
        values = self._read()
        known = self.seconds_per_audio_second()
        values[self.server] = speed if known is None else known + NEW_MEASUREMENT_WEIGHT * (speed - known)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(values))
        except OSError:  # a read-only home: no estimate next time, nothing worse
            pass


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
    """`with ProgressLine("talk.mp3", 182.0, 0.05):` around the request; draws only on a terminal.

    seconds_per_audio_second: the speed expected (`SpeedRecord`); None: no estimate."""

    def __init__(
        self,
        name: str,
        seconds_of_audio: float | None,
        seconds_per_audio_second: float | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream or sys.stderr
        self.name, self.seconds_of_audio = name, seconds_of_audio
        self.expected_s = None if seconds_of_audio is None or seconds_per_audio_second is None else (
            seconds_of_audio * seconds_per_audio_second
        )
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = False

    def text(self, elapsed: float) -> str:
        length = "" if self.seconds_of_audio is None else f" {clock(self.seconds_of_audio)} of audio"
        line = f"{self.name}: transcribing{length} on the server, {clock(elapsed)} so far"
        if self.expected_s is None or self.expected_s <= 0:
            return line
        if elapsed >= self.expected_s:
            return f"{line}, longer than this server's earlier speed suggested"
        percent = int(100 * elapsed / self.expected_s)
        return f"{line}, ~{percent}% (estimated), about {clock(self.expected_s - elapsed + 0.5)} left"

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
