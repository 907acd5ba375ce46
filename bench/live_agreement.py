"""How sure must two hypotheses be before a live session commits a word?

A live turn is transcribed again as it grows (gateway.realtime), and LocalAgreement
(gateway.local_agreement) commits the words two hypotheses in a row agree on and
give at least `min_probability`. This replays real hypotheses through it:

1. hypotheses: the packaged tiny.en, on the CPU, transcribes growing prefixes of
   recordings of tests/data/audio (from 1 s, every 0.25 s, with word timestamps),
   as the session asks Triton for them; written to `<out>/hypotheses.json`.
2. replay: for each cadence (a hypothesis every 0.25 to 2.5 s of audio, from each
   starting offset the grid allows) and each threshold, the session's policy is
   run over them, and the turn finished with the whole recording's transcript.

Reported per cadence and threshold: committed words, how many of them the whole
recording's transcript reads otherwise (`difflib` alignment), the delay from a
word's end (as the whole transcript times it) to the audio position of the
hypothesis that committed it (the decoding time comes on top), and on how many
turns the deltas joined are exactly the completed transcript.

    python -m bench.live_agreement --out docs/benchmarks/live-agreement
    python -m bench.live_agreement --out DIR --hypotheses DIR/hypotheses.json  # replay only
"""

from __future__ import annotations

import argparse
import difflib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.clips import AUDIO_DIR
from gateway.local_agreement import DOUBTFUL_AGREEMENT, MIN_PROBABILITY, LocalAgreement, comparison_key
from loadtest.provenance import commit_info, machine_info
from python_backend_lib.core.segments import Word

CLIPS = (
    "jfk.wav",
    "sense_and_sensibility_01_austen_64kb-0870.wav",
    "sense_and_sensibility_01_austen_64kb-0920.wav",
    "sense_and_sensibility_01_austen_64kb-0890.wav",
    "input_2_16k.wav",
    "cards_005.wav",
    "sense_and_sensibility_01_austen_64kb-0930.wav",
)
FIRST_S = 1.0  # as gateway.realtime's FIRST_HYPOTHESIS_S
GRID_S = 0.25
CADENCES_S = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5)
THRESHOLDS = (0.0, 0.3, 0.5, 0.55, 0.6, 0.7)


@dataclass(frozen=True)
class Hypothesis:
    audio_s: float
    words: tuple[Word, ...]


def record_hypotheses(clips: tuple[str, ...]) -> dict[str, list[Hypothesis]]:
    import soundfile

    from python_backend_lib.core.options import DecodingOptions, TranscribeOptions
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load()
    options = TranscribeOptions(decoding=DecodingOptions(language="en"), word_timestamps=True)
    recorded = {}
    try:
        for index, clip in enumerate(clips, 1):
            audio, rate = soundfile.read(AUDIO_DIR / clip, dtype="float32")
            hypotheses, length = [], FIRST_S
            while True:
                samples = min(round(length * rate), len(audio))
                transcript = pipeline.transcribe(audio[:samples], options)
                words = tuple(w for s in transcript.segments for w in s.words)
                hypotheses.append(Hypothesis(samples / rate, words))
                if samples == len(audio):
                    break
                length += GRID_S
            recorded[clip] = hypotheses
            print(f"[{index}/{len(clips)}] {clip}: {len(hypotheses)} hypotheses", flush=True)
    finally:
        pipeline.close()
    return recorded


def load_hypotheses(path: Path) -> dict[str, list[Hypothesis]]:
    data = json.loads(path.read_text())["hypotheses"]
    return {clip: [Hypothesis(h["audio_s"], tuple(Word(**w) for w in h["words"])) for h in hypotheses]
            for clip, hypotheses in data.items()}


def cadence_runs(hypotheses: list[Hypothesis], cadence_s: float) -> list[list[Hypothesis]]:
    """The hypotheses a session would make every `cadence_s`, from each offset on the grid;
    each run ends with the whole recording's."""
    *growing, whole = hypotheses
    runs = []
    for offset in range(round(cadence_s / GRID_S)):
        steps = round(cadence_s / GRID_S)
        runs.append([h for i, h in enumerate(growing) if i >= offset and (i - offset) % steps == 0] + [whole])
    return runs


@dataclass(frozen=True)
class Replay:
    committed: int  # words committed before the turn's end
    misread: int  # of them, words the whole transcript reads otherwise
    delays_s: tuple[float, ...]  # for each committed word the whole transcript has
    consistent: bool  # the deltas joined are the whole transcript, word for word


def replay(run: list[Hypothesis], min_probability: float) -> Replay:
    agreement = LocalAgreement(min_probability=min_probability)
    committed_at = []
    *growing, whole = run
    for hypothesis in growing:
        committed_at += [hypothesis.audio_s] * len(agreement.insert(hypothesis.words))
    early = list(agreement.committed)
    agreement.finish(whole.words)
    said, heard = [comparison_key(w) for w in early], [comparison_key(w) for w in whole.words]
    matcher = difflib.SequenceMatcher(a=said, b=heard, autojunk=False)
    blocks = matcher.get_matching_blocks()
    delays = tuple(committed_at[b.a + k] - whole.words[b.b + k].end for b in blocks for k in range(b.size))
    return Replay(committed=len(early), misread=len(early) - sum(b.size for b in blocks), delays_s=delays,
                  consistent=[comparison_key(w) for w in agreement.committed] == heard)


@dataclass(frozen=True)
class Row:
    cadence_s: float
    min_probability: float
    turns: int
    committed: int
    misread: int
    delay_p50_s: float | None
    consistent: int


def summarize(recorded: dict[str, list[Hypothesis]]) -> list[Row]:
    rows = []
    for cadence in CADENCES_S:
        for threshold in THRESHOLDS:
            replays = [replay(run, threshold) for hypotheses in recorded.values()
                       for run in cadence_runs(hypotheses, cadence)]
            delays = [d for r in replays for d in r.delays_s]
            rows.append(Row(cadence, threshold, len(replays), sum(r.committed for r in replays),
                            sum(r.misread for r in replays), round(statistics.median(delays), 2) if delays else None,
                            sum(r.consistent for r in replays)))
    return rows


def markdown(rows: list[Row], header: str) -> str:
    lines = [header, "",
             "| hypothesis every | min probability | turns | words committed early | misread | "
             "delay p50 (s of audio) | deltas = completed |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "**" if r.min_probability == MIN_PROBABILITY else ""
        delay = "–" if r.delay_p50_s is None else f"{r.delay_p50_s:.2f}"
        share = f"{r.misread / r.committed:.1%}" if r.committed else "–"
        lines.append(f"| {r.cadence_s:g} s | {mark}{r.min_probability:g}{mark} | {r.turns} | {r.committed} | "
                     f"{r.misread} ({share}) | {delay} | {r.consistent}/{r.turns} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for cadence in (0.25, 0.5, 1.0, 2.0):
        mine = [r for r in rows if r.cadence_s == cadence and r.delay_p50_s is not None]
        axes[0].plot([r.min_probability for r in mine], [r.misread / max(r.committed, 1) * 100 for r in mine],
                     marker="o", label=f"every {cadence:g} s")
        axes[1].plot([r.min_probability for r in mine], [r.delay_p50_s for r in mine], marker="o")
    axes[0].set(xlabel="min probability", ylabel="committed words misread (%)")
    axes[1].set(xlabel="min probability", ylabel="word end to commit, p50 (s of audio)")
    for axis in axes:
        axis.axvline(MIN_PROBABILITY, color="grey", linestyle=":")
    axes[0].legend()
    figure.suptitle("LocalAgreement on real tiny.en hypotheses")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hypotheses", type=Path, help="replay these instead of recording new ones")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.hypotheses:
        recorded, source = load_hypotheses(args.hypotheses), json.loads(args.hypotheses.read_text())["source"]
    else:
        started = time.perf_counter()
        recorded = record_hypotheses(CLIPS)
        commit, machine = commit_info(), machine_info()
        source = {"commit": commit.commit, "dirty": commit.dirty, "machine": f"{machine['cpu']}, {machine['cpu_count']} cores",
                  "recorded": time.strftime("%Y-%m-%d %H:%M"), "seconds": round(time.perf_counter() - started, 1),
                  "model": "packaged tiny.en, float32 on the CPU, language en, word timestamps"}
        (args.out / "hypotheses.json").write_text(json.dumps({"source": source, "hypotheses": {
            clip: [{"audio_s": h.audio_s, "words": [asdict(w) for w in h.words]} for h in hypotheses]
            for clip, hypotheses in recorded.items()}}, indent=None))
    rows = summarize(recorded)
    (args.out / "agreement.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    header = (f"# LocalAgreement on real hypotheses\n\nHypotheses: {source['model']}, commit `{source['commit']}`, "
              f"{source['recorded']}, {source['machine']}; {len(recorded)} recordings, every {GRID_S:g} s from {FIRST_S:g} s. "
              f"Command: `python -m bench.live_agreement --out {args.out}`. "
              f"The shipped threshold (gateway.local_agreement.MIN_PROBABILITY) is in bold; a word under it is "
              f"committed once {DOUBTFUL_AGREEMENT} hypotheses in a row read it the same way (DOUBTFUL_AGREEMENT).")
    (args.out / "README.md").write_text(markdown(rows, header) + "\n![misread share and delay](agreement.png)\n")
    plot(rows, args.out / "agreement.png")
    print(markdown(rows, header))


if __name__ == "__main__":
    main()
