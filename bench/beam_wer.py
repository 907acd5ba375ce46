"""Beam search's error rates against faster-whisper's, same weights, same options, side by side.

    python -m bench.beam_wer --out docs/benchmarks/beam-wer

Two sets, each decoded by every system in one run:
- english: the packaged tiny.en on every recording of tests/data/audio
  (manifest.tsv: 14 clips of 1 to 11 s and the 53 s sonnet, decoded long-form),
  language "en";
- multilingual: the packaged base (`--checkpoint base`) on tests/data/multilingual
  and ../shared/audio/multilingual, the language detected.
Systems: our library (`Pipeline.transcribe`, float32) with beam_size=5, best_of=5
(faster-whisper's defaults), once with each `window_padding` (openai-whisper's, the
default, which faster-whisper's windows have too, and transformers'), and
greedily (the server's default), and faster-whisper
`WhisperModel.transcribe` on the same CTranslate2 folder with beam_size=5,
best_of=5 in float32 (`--compute-type` to change). Everything else is each
library's default, which are the same: timestamps on, temperature fallback
(0.0, 0.2, ..., 1.0) with thresholds 2.4 / -1.0 / 0.6, conditioning on the
previous text, patience 1, and candidates ranked by log-probability over length
(faster-whisper's length_penalty=1, CTranslate2's length ** 1; ours unset, openai-whisper's).

Each system's detected languages are kept, and counted right against the
recordings' own (the English set names its language, so there they are given).

Errors are corpus rates: edits summed over the clips over the reference's
length, in words (WER) and in characters without spaces (CER; the one that means
something for Japanese and Chinese), after lower-casing and dropping punctuation
(`bench.transcripts.words`; English also with numbers spelt out as the tests'
references read them, `tests.reference.normalize`). Writes `<out>/beam-wer.json`,
`<out>/beam-wer.md` and `<out>/beam-wer.png`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from bench.transcripts import words
from loadtest.clips import read_manifest
from loadtest.provenance import REPO_ROOT, provenance

# faster-whisper's defaults; its length_penalty=1 divides by the length, as ours does unset.
SEARCH = dict(beam_size=5, best_of=5, patience=1.0)
FASTER_WHISPER_SEARCH = dict(SEARCH, length_penalty=1.0)
ENGLISH = REPO_ROOT / "tests" / "data" / "audio"
MULTILINGUAL = (REPO_ROOT / "tests" / "data" / "multilingual", REPO_ROOT.parent / "shared" / "audio" / "multilingual")


@dataclass(frozen=True)
class Clip:
    path: Path
    language: str
    reference: str


@dataclass(frozen=True)
class Scored:
    system: str
    clips: int
    wer: float
    cer: float
    seconds: float
    transcripts: list[str]
    languages: list[str | None]  # as detected (given, where the set names it)
    languages_right: int


def english_clips() -> list[Clip]:
    return [Clip(ENGLISH / r.name, "en", r.transcript) for r in read_manifest(ENGLISH)]


def multilingual_clips(per_language: int, folders: tuple[Path, ...] = MULTILINGUAL) -> list[Clip]:
    clips: list[Clip] = []
    for folder in folders:
        if not (folder / "manifest.tsv").exists():
            continue
        with open(folder / "manifest.tsv", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
        for r in rows:
            seen = {c.path.name for c in clips}  # tests/data/multilingual holds copies of a few shared ones
            if Path(r["file"]).name not in seen and sum(c.language == r["language"] for c in clips) < per_language:
                clips.append(Clip(folder / r["file"], r["language"], r["reference_text"]))
    return clips


def edits(reference: list[str], hypothesis: list[str]) -> int:
    row = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, start=1):
        diagonal, row[0] = row[0], i
        for j, h in enumerate(hypothesis, start=1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (r != h))
    return row[-1]


def english_words(text: str) -> list[str]:
    from tests.reference import normalize

    return normalize(text)


def words_of(text: str, language: str) -> list[str]:
    """A transcript's words as a clip of `language` is scored: English normalized as the
    tests' reference is, other languages split plainly."""
    return english_words(text) if language == "en" else words(text)


def score(system: str, clips: list[Clip], transcribe: Callable[[Clip], tuple[str, str | None]], say) -> Scored:
    """transcribe: a clip's text and the language it was decoded in."""
    texts, languages, word_edits, n_words, char_edits, n_chars = [], [], 0, 0, 0, 0
    start = time.perf_counter()
    for clip in clips:
        text, language = transcribe(clip)
        texts.append(text)
        languages.append(language)
        ref, hyp = words_of(clip.reference, clip.language), words_of(text, clip.language)
        word_edits, n_words = word_edits + edits(ref, hyp), n_words + len(ref)
        ref_chars, hyp_chars = list("".join(ref)), list("".join(hyp))
        char_edits, n_chars = char_edits + edits(ref_chars, hyp_chars), n_chars + len(ref_chars)
        say(f"  {system} {clip.path.name}: {text[:70]!r}")
    seconds = time.perf_counter() - start
    right = sum(language == clip.language for language, clip in zip(languages, clips))
    return Scored(system, len(clips), word_edits / n_words, char_edits / n_chars, round(seconds, 1), texts,
                  languages, right)


def ours(source: str, search: dict | None, padding: str) -> tuple[Callable[[Clip], tuple[str, str | None]], Callable[[], None]]:
    from python_backend_lib.core.options import DecodingOptions, TranscribeOptions
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load(source, device="cpu")

    def transcribe(clip: Clip) -> str:
        language = clip.language if source == "default" else None
        decoding = DecodingOptions(timestamps=True, language=language, **(search or {}))
        options = TranscribeOptions(decoding=decoding, window_padding=padding)
        transcript = pipeline.transcribe(clip.path.read_bytes(), options)
        return transcript.text.strip(), transcript.language

    return transcribe, pipeline.close


def faster_whisper(source: str, compute_type: str, threads: int) -> Callable[[Clip], tuple[str, str | None]]:
    from faster_whisper import WhisperModel

    from python_backend_lib.checkpoints.packaged import packaged_folder

    model = WhisperModel(str(packaged_folder(source)), device="cpu", compute_type=compute_type, cpu_threads=threads)

    def transcribe(clip: Clip) -> str:
        language = clip.language if source == "default" else None
        segments, info = model.transcribe(io.BytesIO(clip.path.read_bytes()), language=language, **FASTER_WHISPER_SEARCH)
        return "".join(segment.text for segment in segments).strip(), info.language

    return transcribe


def run_set(name: str, source: str, clips: list[Clip], args, say) -> dict:
    say(f"{name}: {len(clips)} clips, checkpoint {source}")
    scored = []
    for label, search, padding in (
        ("ours beam_size=5 best_of=5 float32", SEARCH, "openai-whisper"),
        ("ours beam_size=5 best_of=5 window_padding=transformers float32", SEARCH, "transformers"),
        ("ours greedy float32", None, "openai-whisper"),
    ):
        transcribe, close = ours(source, search, padding)
        try:
            scored.append(score(label, clips, transcribe, say))
        finally:
            close()
    label = f"faster-whisper beam_size=5 best_of=5 {args.compute_type}"
    scored.append(score(label, clips, faster_whisper(source, args.compute_type, args.threads), say))
    return {"set": name, "checkpoint": source, "clips": [str(c.path.relative_to(REPO_ROOT.parent)) for c in clips],
            "references": [c.reference for c in clips], "systems": [asdict(s) for s in scored]}


def report(record: dict) -> str:
    lines = ["# Beam search: error rates beside faster-whisper's", "",
             f"Command: `{record['command']}`  ", f"Commit: {record['run']['commit']} (dirty: "
             f"{record['run']['dirty']}), {record['run']['date']}; CPU, {record['threads']} threads.", "",
             "| set | checkpoint | clips | system | WER | CER | languages right | seconds |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in record["sets"]:
        for s in result["systems"]:
            lines.append(f"| {result['set']} | {result['checkpoint']} | {s['clips']} | {s['system']} | "
                         f"{s['wer']:.3f} | {s['cer']:.3f} | {s.get('languages_right', '-')} | {s['seconds']} |")
    lines += ["", "Options beside the search: each library's defaults, which agree (timestamps, temperature "
              "fallback 0.0 to 1.0 by 0.2, thresholds 2.4 / -1.0 / 0.6, previous text), patience 1, and "
              "candidates ranked by log-probability over length (faster-whisper's length_penalty=1, "
              "ours unset). English words are normalised as the tests' references (numbers spelt out). "
              "Transcripts are in the JSON record.", ""]
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    """Each set's word and character error rates, a bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = record["sets"]
    figure, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.4), squeeze=False)
    for ax, result in zip(axes[0], sets):
        systems = result["systems"]
        width = 0.8 / len(systems)
        for i, s in enumerate(systems):
            bars = ax.bar([j + i * width for j in range(2)], [s["wer"], s["cer"]], width, label=s["system"])
            ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(2)], ["WER", "CER"])
        ax.set_title(f"{result['set']}: {result['checkpoint']}, {systems[0]['clips']} recordings")
        ax.legend(fontsize=7, loc="upper right")
    figure.suptitle(f"beam search beside faster-whisper, CPU, commit {record['run']['commit'][:7]} (lower is better)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compute-type", default="float32", help="faster-whisper's (float32 or int8)")
    parser.add_argument("--threads", type=int, default=2, help="faster-whisper's cpu_threads")
    parser.add_argument("--english", type=int, default=None, help="the first N English recordings (tiny.en; default all)")
    parser.add_argument("--per-language", type=int, default=1, help="multilingual clips per language (base; 0: no multilingual set)")
    args = parser.parse_args(argv)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    import ctranslate2
    import torch

    torch.set_num_threads(args.threads)
    ctranslate2.set_random_seed(0)  # faster-whisper's temperature fallback samples; ours is seeded per request
    record = {"command": "python -m bench.beam_wer " + " ".join(argv if argv is not None else sys.argv[1:]),
              "run": provenance(),
              "threads": args.threads, "search": {"ours": SEARCH, "faster-whisper": FASTER_WHISPER_SEARCH},
              "sets": []}
    record["sets"].append(run_set("english", "default", english_clips()[: args.english], args, say))
    if args.per_language:
        record["sets"].append(run_set("multilingual", "base", multilingual_clips(args.per_language), args, say))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "beam-wer.json").write_text(json.dumps(record, indent=1, ensure_ascii=False, default=str) + "\n")
    (args.out / "beam-wer.md").write_text(report(record))
    plot(record, args.out / "beam-wer.png")
    print(report(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
