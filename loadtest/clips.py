"""The load test's clips and its summary, free of locust.

Importing locust patches the standard library for gevent, so what tests and the
runner need (which clips, how a request is named, what a run measured) lives
here, importable without it.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_AUDIO_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"
MANIFEST_NAME = "manifest.tsv"

# Requests are grouped by clip length, so the report shows how latency grows
# with audio: one Whisper window is 30 s.
SHORT_CLIP_S = 5.0
WINDOW_S = 30.0

# The name of the row for all requests together, as in locust's own reports.
AGGREGATED = "Aggregated"


@dataclass(frozen=True)
class Clip:
    """One audio file of the manifest, read into memory."""

    name: str
    audio: bytes
    duration_s: float
    transcript: str

    @property
    def is_speech(self) -> bool:
        """The manifest has a transcript for it, so the server must return text."""
        return bool(self.transcript.strip())

    @property
    def length_class(self) -> str:
        if self.duration_s < SHORT_CLIP_S:
            return f"<{SHORT_CLIP_S:g}s"
        if self.duration_s <= WINDOW_S:
            return f"{SHORT_CLIP_S:g}-{WINDOW_S:g}s"
        return f">{WINDOW_S:g}s"


def request_name(clip: Clip) -> str:
    """The name a request is reported under: the model and the clip's length class."""
    return f"transcribe {clip.length_class}"


def read_manifest(audio_dir: Path = DEFAULT_AUDIO_DIR) -> tuple[Clip, ...]:
    """Every recording that the folder's `manifest.tsv` lists (file, duration_s, ...,
    transcript), in its order: the one reader of it that the load test and the
    benchmarks share. ValueError if there is no manifest or a listed file is missing."""
    manifest = audio_dir / MANIFEST_NAME
    if not manifest.is_file():
        raise ValueError(f"no {MANIFEST_NAME} in {audio_dir}")
    clips = []
    with manifest.open(newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle, delimiter="\t"):
            path = audio_dir / row["file"]
            if not path.is_file():
                raise ValueError(f"{manifest} lists {row['file']}, which is not in {audio_dir}")
            clips.append(
                Clip(name=row["file"], audio=path.read_bytes(), duration_s=float(row["duration_s"]),
                     transcript=row["transcript"])
            )
    return tuple(clips)


def load_clips(audio_dir: Path = DEFAULT_AUDIO_DIR, max_duration_s: float | None = None) -> tuple[Clip, ...]:
    """The manifest's clips (`read_manifest`), shortest first; those longer than
    `max_duration_s` are left out. ValueError if none remain."""
    clips = [c for c in read_manifest(audio_dir) if max_duration_s is None or c.duration_s <= max_duration_s]
    if not clips:
        raise ValueError(f"no clip in {audio_dir / MANIFEST_NAME} is at most {max_duration_s} s long")
    return tuple(sorted(clips, key=lambda clip: clip.duration_s))


@dataclass(frozen=True)
class RequestStats:
    """What locust measured for one request type and name, or for all together."""

    request_type: str
    name: str
    requests: int
    failures: int
    median_ms: float
    p95_ms: float
    requests_per_s: float


@dataclass(frozen=True)
class Summary:
    """The final numbers of a run: one row per (type, name), the total, and each error seen."""

    rows: tuple[RequestStats, ...]
    total: RequestStats
    errors: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Summary:
        data = json.loads(text)
        return cls(
            rows=tuple(RequestStats(**row) for row in data["rows"]),
            total=RequestStats(**data["total"]),
            errors=tuple(data["errors"]),
        )

    def table(self) -> list[str]:
        """The summary as aligned text lines."""
        lines = [f"{'type':<6} {'name':<18} {'requests':>8} {'failures':>8} {'median ms':>10} {'p95 ms':>8} {'req/s':>6}"]
        for row in (*self.rows, self.total):
            lines.append(
                f"{row.request_type:<6} {row.name:<18} {row.requests:>8} {row.failures:>8} "
                f"{row.median_ms:>10.0f} {row.p95_ms:>8.0f} {row.requests_per_s:>6.2f}"
            )
        return lines
