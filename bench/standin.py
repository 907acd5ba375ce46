"""The ceiling's model repository: the packaged one with only `whisper` replaced by a stand-in.

    python -m bench.standin DIR                  # write the repository to DIR
    python -m bench.standin --write-canned       # remake bench/data/canned_verbose.json (tiny.en, CPU)

`preprocessing`, the `transcribe` ensemble and every config.pbtxt are copied
as they are; whisper/1/model.py becomes `bench/standin_whisper.py`, with the
canned verbose_json transcript beside it, from which it writes each answer's
outputs as the real model does.
Served through `whisper-triton serve --model-repository DIR`, this measures
what the plumbing carries when the engine costs nothing.

The canned transcript is real: tiny.en's verbose_json for the clip nearest the
clip set's mean length, made with the benchmark's request parameters.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from bench.repository_copy import copy_repository

BENCH_DIR = Path(__file__).resolve().parent
STANDIN_SOURCE = BENCH_DIR / "standin_whisper.py"
CANNED_PATH = BENCH_DIR / "data" / "canned_verbose.json"
CANNED_NAME = "canned_verbose.json"  # the stand-in reads it beside its model.py
WHISPER_MODEL_FILE = Path("whisper") / "1" / "model.py"


def write_standin_repository(directory: Path, source: Path | None = None) -> Path:
    """Copy the model repository `source` (default: the packaged one) to `directory`
    (emptied first) and put the stand-in in place of whisper/1/model.py."""
    copy_repository(directory, source)
    if not (directory / WHISPER_MODEL_FILE).is_file():
        raise ValueError(f"{source or 'the packaged repository'} has no {WHISPER_MODEL_FILE} to replace")
    model = directory / WHISPER_MODEL_FILE
    shutil.copyfile(STANDIN_SOURCE, model)
    shutil.copyfile(CANNED_PATH, model.parent / CANNED_NAME)
    return directory


def canned_check(eot: int):
    """What every answer through the stand-in must be: the canned transcript, to the token."""
    import json

    from bench.transcripts import TranscriptCheck, text_tokens

    record = json.loads(CANNED_PATH.read_text())
    return TranscriptCheck(eot, float(record["duration"]), expected_tokens=text_tokens(record, eot))


def canned_document() -> str:
    """tiny.en's verbose_json for the clip nearest the mean clip length, on the CPU."""
    import numpy as np

    from bench.clips import load_clips, nearest
    from bench.transcripts import REQUEST_PARAMETERS
    from python_backend_lib.serving.parameters import parse_request_parameters
    from python_backend_lib.text.formats import Document, ResponseFormat
    from python_backend_lib.transcription.pipeline import Pipeline

    clips = load_clips()
    clip = nearest(clips, float(np.mean([c.clip.duration_s for c in clips])))
    options = parse_request_parameters(REQUEST_PARAMETERS).transcription
    pipeline = Pipeline.load("default", device="cpu")
    try:
        transcript = pipeline.transcribe(clip.waveform, options)
    finally:
        pipeline.close()
    print(f"canned transcript: {clip.clip.name} ({clip.clip.duration_s} s): {transcript.text!r}")
    return Document.from_transcript(transcript, options).render(ResponseFormat.VERBOSE_JSON)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.standin", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, nargs="?", help="where to write the repository")
    parser.add_argument("--write-canned", action="store_true", help=f"remake {CANNED_PATH.relative_to(BENCH_DIR.parent)}")
    args = parser.parse_args(argv)
    if args.write_canned:
        CANNED_PATH.parent.mkdir(parents=True, exist_ok=True)
        CANNED_PATH.write_text(canned_document())
    if args.directory:
        print(write_standin_repository(args.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
