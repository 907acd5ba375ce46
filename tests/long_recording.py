"""A three-minute recording made of the test clips, with every clip's place in it known.

The clips follow one another with `GAP_S` of silence between them, so where
each one starts is known exactly: a forced alignment that needs no other tool
to verify. `tests/served/test_long_audio.py` transcribes the recording through the
server; `python tests/long_recording.py` measures both long-form modes on it
for docs/long-audio.md.
"""

from __future__ import annotations

import io
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # run as a script too

from reference import Clip, clips, normalize, word_error_rate

SAMPLE_RATE = 16_000
GAP_S = 2.5
# Every clip once in the manifest's order (the 53 s sonnet included), then four
# again, to reach three minutes.
REPEATED = (
    "jfk.wav",
    "sense_and_sensibility_01_austen_64kb-0870.wav",
    "sense_and_sensibility_01_austen_64kb-0890.wav",
    "sense_and_sensibility_01_austen_64kb-0920.wav",
)
# How close a clip's first segment (or word) must start to where the clip was put.
START_TOLERANCE_S = 1.5


@dataclass(frozen=True)
class Placed:
    clip: Clip
    start: float  # seconds into the recording
    end: float

    @property
    def words(self) -> list[str]:
        return normalize(self.clip.transcript)


@dataclass(frozen=True)
class Recording:
    waveform: np.ndarray  # float32, 16 kHz mono
    placed: tuple[Placed, ...]

    @property
    def duration(self) -> float:
        return len(self.waveform) / SAMPLE_RATE

    @property
    def reference_words(self) -> list[str]:
        return [w for p in self.placed for w in p.words]

    def wav_bytes(self) -> bytes:
        import soundfile

        buffer = io.BytesIO()
        soundfile.write(buffer, self.waveform, SAMPLE_RATE, format="WAV", subtype="PCM_16")
        return buffer.getvalue()


def build(gap_s: float = GAP_S) -> Recording:
    import soundfile

    by_name = {c.file: c for c in clips()}
    order = [c.file for c in clips()] + list(REPEATED)
    gap = np.zeros(round(gap_s * SAMPLE_RATE), dtype=np.float32)
    parts: list[np.ndarray] = []
    placed: list[Placed] = []
    samples = 0
    for index, name in enumerate(order):
        if index:
            parts.append(gap)
            samples += len(gap)
        waveform, rate = soundfile.read(by_name[name].path, dtype="float32")
        assert rate == SAMPLE_RATE and waveform.ndim == 1, name
        placed.append(Placed(by_name[name], samples / SAMPLE_RATE, (samples + len(waveform)) / SAMPLE_RATE))
        parts.append(waveform)
        samples += len(waveform)
    return Recording(np.concatenate(parts), tuple(placed))


# ------------------------------------------------------------- checking a transcript


@dataclass(frozen=True)
class TimedWord:
    word: str  # normalised
    start: float  # of the word, or of the segment that holds it
    end: float


def segment_words(segments: Sequence) -> list[TimedWord]:
    """Each normalised word of each segment, with its segment's times."""
    return [TimedWord(w, s.start, s.end) for s in segments for w in normalize(s.text)]


def word_timings(words: Sequence) -> list[TimedWord]:
    """Word timestamps (objects with word, start, end), normalised; punctuation-only words dropped."""
    timed = []
    for w in words:
        for part in normalize(w.word):
            timed.append(TimedWord(part, w.start, w.end))
    return timed


def align(hypothesis: Sequence[str], reference: Sequence[str]) -> dict[int, int]:
    """Reference index -> hypothesis index of the words that a minimum-edit
    alignment pairs exactly; the pairs are in order in both."""
    # Rows of Python ints: a NumPy array indexed element by element made this the
    # slowest part of the long-audio tests' checks.
    n, m = len(hypothesis), len(reference)
    cost = [list(range(m + 1))]
    for i in range(1, n + 1):
        above, row, word = cost[-1], [i], hypothesis[i - 1]
        for j in range(1, m + 1):
            row.append(min(above[j] + 1, row[j - 1] + 1, above[j - 1] + (word != reference[j - 1])))
        cost.append(row)
    pairs: dict[int, int] = {}
    i, j = n, m
    while i > 0 and j > 0:
        same = hypothesis[i - 1] == reference[j - 1]
        if cost[i][j] == cost[i - 1][j - 1] + (0 if same else 1):
            if same:
                pairs[j - 1] = i - 1
            i, j = i - 1, j - 1
        elif cost[i][j] == cost[i - 1][j] + 1:
            i -= 1
        else:
            j -= 1
    return pairs



@dataclass(frozen=True)
class ClipFinding:
    placed: Placed
    found: list[TimedWord]  # the clip's words that the transcript has, in order

    @property
    def share(self) -> float:
        return len(self.found) / len(self.placed.words)


def find_clips(recording: Recording, timed: Sequence[TimedWord]) -> list[ClipFinding]:
    """Where the transcript has each clip's words (aligned to the reference)."""
    pairs = align([t.word for t in timed], recording.reference_words)
    findings, offset = [], 0
    for placed in recording.placed:
        count = len(placed.words)
        found = [timed[pairs[j]] for j in range(offset, offset + count) if j in pairs]
        findings.append(ClipFinding(placed, found))
        offset += count
    return findings


def problems(findings: Sequence[ClipFinding], min_share: float, tolerance_s: float = START_TOLERANCE_S) -> list[str]:
    """What is wrong with the clips' words and times; empty when all is well.

    Every clip must have at least `min_share` of its words, the first of them
    (or the segment holding it) starting within `tolerance_s` of where the clip
    was put, and all of them inside the clip's span widened by `tolerance_s`.
    """
    found_problems = []
    for f in findings:
        name, start, end = f.placed.clip.file, f.placed.start, f.placed.end
        if f.share < min_share or not f.found:
            found_problems.append(f"{name} at {start:.2f} s: only {f.share:.0%} of its words")
            continue
        first = min(abs(t.start - start) for t in f.found)
        if first > tolerance_s:
            found_problems.append(f"{name} at {start:.2f} s: nearest start {first:.2f} s away")
        outside = [t for t in f.found if t.end < start - tolerance_s or t.start > end + tolerance_s]
        if outside:
            found_problems.append(f"{name} at {start:.2f}-{end:.2f} s: {outside[:3]} lie outside")
    return found_problems


# ------------------------------------------------------------- is all speech covered?

# Speech, defined from the audio itself: 10 ms frames whose RMS level is within
# SPEECH_RANGE_DB of the recording's loudest frame (the clips' pauses and the
# silence between them fall far below it).
SPEECH_FRAME_SAMPLES = SAMPLE_RATE // 100
SPEECH_RANGE_DB = 35.0
# A second holds speech when at least this share of its frames do.
SPEECH_SHARE = 0.25
# Whisper's segment times are off by up to about a second at either end
# (tiny.en starts segments early, in the silence before speech, and ends some
# short of the last word); a speech second that no segment comes this close to
# was left out of the transcript.
COVERAGE_TOLERANCE_S = 1.0


def speech_seconds(waveform: np.ndarray) -> list[int]:
    """The whole seconds [t, t + 1) of a 16 kHz recording that hold speech."""
    n_frames = len(waveform) // SPEECH_FRAME_SAMPLES
    frames = waveform[: n_frames * SPEECH_FRAME_SAMPLES].reshape(n_frames, SPEECH_FRAME_SAMPLES)
    level_db = 10 * np.log10(np.mean(frames.astype(np.float64) ** 2, axis=1) + 1e-20)
    speech = level_db >= level_db.max() - SPEECH_RANGE_DB
    per_second = SAMPLE_RATE // SPEECH_FRAME_SAMPLES
    n_seconds = n_frames // per_second
    share = speech[: n_seconds * per_second].reshape(n_seconds, per_second).mean(axis=1)
    return [int(t) for t in np.flatnonzero(share >= SPEECH_SHARE)]


def uncovered_seconds(
    speech: Sequence[int], segments: Sequence, tolerance_s: float = COVERAGE_TOLERANCE_S
) -> list[int]:
    """The speech seconds that no segment (anything with start and end) overlaps,
    each segment widened by `tolerance_s` on both sides."""
    spans = [(s.start - tolerance_s, s.end + tolerance_s) for s in segments if s.text.strip()]
    return [t for t in speech if not any(start < t + 1 and end > t for start, end in spans)]


_CUE_TIME = r"(\d\d):(\d\d):(\d\d)[,.](\d\d\d)"
_CUE = re.compile(_CUE_TIME + r" --> " + _CUE_TIME + r"\n(.*?)(?:\n\n|\n?$)", re.S)


@dataclass(frozen=True)
class Cue:
    start: float
    end: float
    text: str


def parse_subtitles(text: str) -> list[Cue]:
    """The cues of SRT or WebVTT text."""
    def seconds(h: str, m: str, s: str, ms: str) -> float:
        return int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000

    return [Cue(seconds(*m.groups()[:4]), seconds(*m.groups()[4:8]), m.group(9).strip()) for m in _CUE.finditer(text)]


# ----------------------------------------------------------------- the figures


def measure(repeats: int = 3) -> None:
    """Each long-form mode on this machine: the library, one recording at a time.
    Wall and CPU time are the best of `repeats` (CPU time counts every thread
    of this process, so other jobs on the machine disturb it less); windows
    are those decoded and kept; missed seconds are `uncovered_seconds`."""
    from python_backend_lib.audio.decode import decode_audio
    from python_backend_lib.core.options import DecodingOptions, LongFormMode, TranscribeOptions
    from python_backend_lib.transcription.pipeline import Pipeline

    recording = build()
    sonnet = next(c for c in clips() if c.file == "sonnet1_longform.wav")
    cases = [
        (f"{sonnet.duration:.0f} s sonnet", decode_audio(sonnet.read()), normalize(sonnet.transcript)),
        (f"{recording.duration:.0f} s recording", recording.waveform, recording.reference_words),
    ]
    settings = [
        (LongFormMode.SEQUENTIAL, True, False),
        (LongFormMode.SEQUENTIAL, True, True),
        (LongFormMode.SEQUENTIAL, False, False),
        (LongFormMode.BATCHED, True, False),
        (LongFormMode.BATCHED, True, True),
        (LongFormMode.BATCHED, False, False),
    ]
    pipeline = Pipeline.load("default", device="cpu")
    try:
        pipeline.transcribe(recording.waveform[: 5 * SAMPLE_RATE], TranscribeOptions())  # warm up
        print("| audio | mode | timestamps | words | windows | wall time (s) | CPU time (s) | WER | speech seconds missed |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, waveform, reference in cases:
            speech = speech_seconds(waveform)
            for mode, timestamps, words in settings:
                options = TranscribeOptions(
                    decoding=DecodingOptions(timestamps=timestamps), mode=mode, word_timestamps=words
                )
                wall, cpu = [], []
                for _ in range(repeats):
                    began, began_cpu = time.perf_counter(), time.process_time()
                    transcript = pipeline.transcribe(waveform, options)
                    wall.append(time.perf_counter() - began)
                    cpu.append(time.process_time() - began_cpu)
                wer = word_error_rate(normalize(transcript.text), reference)
                missed = len(uncovered_seconds(speech, transcript.segments))
                flags = ("yes" if timestamps else "no", "yes" if words else "no")
                print(
                    f"| {name} | {mode.value} | {flags[0]} | {flags[1]} | {len(transcript.windows)} "
                    f"| {min(wall):.1f} | {min(cpu):.1f} | {wer:.3f} | {missed} of {len(speech)} |",
                    flush=True,
                )
    finally:
        pipeline.close()


if __name__ == "__main__":
    measure()
