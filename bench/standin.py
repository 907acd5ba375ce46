"""The ceiling's model repository: the packaged one with only `whisper` replaced by a stand-in.

    python -m bench.standin DIR                  # write the repository to DIR
    python -m bench.standin --write-canned       # remake bench/data/canned_decoded.json (tiny.en, CPU)

`preprocessing`, `postprocessing`, the `transcribe` ensemble and every
config.pbtxt are copied as they are; whisper/1/model.py becomes
`bench/standin_whisper.py`, with the canned decoded recording beside it, which
it sends as each answer's outputs as the real model does.
Served through `whisper-triton serve --model-repository DIR`, this measures
what the plumbing carries when the engine costs nothing.

The canned recording is real: what tiny.en decoded for the clip nearest the
clip set's mean length, with the benchmark's request parameters.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from bench.repository_copy import copy_repository

BENCH_DIR = Path(__file__).resolve().parent
STANDIN_SOURCE = BENCH_DIR / "standin_whisper.py"
CANNED_PATH = BENCH_DIR / "data" / "canned_decoded.json"
CANNED_NAME = "canned_decoded.json"  # the stand-in reads it beside its model.py
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


def canned_verbose_json() -> dict:
    """The transcript every answer through the stand-in must be: the canned recording,
    assembled and written as verbose_json as postprocessing writes it."""
    import json

    from bench.transcripts import REQUEST_PARAMETERS
    from python_backend_lib.checkpoints.configs import load_config
    from python_backend_lib.contract.parameters import parse_request_parameters
    from python_backend_lib.core.decoded import DecodedRecording
    from python_backend_lib.text.formats import Document, ResponseFormat
    from python_backend_lib.text.tokenizer import load_tokenizer
    from python_backend_lib.text.transcript import assemble

    recording = DecodedRecording.from_json(CANNED_PATH.read_text())
    options = parse_request_parameters(REQUEST_PARAMETERS).transcription
    transcript = assemble(recording, load_tokenizer(load_config("default")))
    return json.loads(Document.from_transcript(transcript, options).render(ResponseFormat.VERBOSE_JSON))


def canned_check(eot: int):
    """What every answer through the stand-in must be: the canned transcript, to the token."""
    from bench.transcripts import TranscriptCheck, text_tokens

    record = canned_verbose_json()
    return TranscriptCheck(eot, float(record["duration"]), expected_tokens=text_tokens(record, eot))


def canned_recording() -> str:
    """What tiny.en decodes for the clip nearest the mean clip length, on the CPU, as JSON."""
    import numpy as np

    from bench.clips import load_clips, nearest
    from bench.transcripts import REQUEST_PARAMETERS
    from python_backend_lib.contract.parameters import parse_request_parameters
    from python_backend_lib.transcription.pipeline import Pipeline

    clips = load_clips()
    clip = nearest(clips, float(np.mean([c.clip.duration_s for c in clips])))
    options = parse_request_parameters(REQUEST_PARAMETERS).transcription
    pipeline = Pipeline.load("default", device="cpu")
    try:
        (features,) = pipeline.features([clip.waveform])
        recording = pipeline.submit_decoded(features, len(clip.waveform), options).result()
        print(f"canned recording: {clip.clip.name} ({clip.clip.duration_s} s): {pipeline.assemble(recording).text!r}")
    finally:
        pipeline.close()
    return recording.to_json()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.standin", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, nargs="?", help="where to write the repository")
    parser.add_argument("--write-canned", action="store_true", help=f"remake {CANNED_PATH.relative_to(BENCH_DIR.parent)}")
    args = parser.parse_args(argv)
    if args.write_canned:
        CANNED_PATH.parent.mkdir(parents=True, exist_ok=True)
        CANNED_PATH.write_text(canned_recording())
    if args.directory:
        print(write_standin_repository(args.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
