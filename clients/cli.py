"""`whisper-triton transcribe FILE...`: send files to a running server, print transcripts.

Files are sent `--concurrency` at a time (the server batches them) and printed
in the order given. With more than one file, a progress bar goes to stderr.
The server sends each transcript whole (verbose_json); it is written here in
the chosen format by the same code the server's FORMATTED output uses.
"""

from __future__ import annotations

import argparse
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from clients.api import Protocol, TranscriptionError, WhisperClient
from python_backend_lib.core.options import LongFormMode
from python_backend_lib.text import formats
from python_backend_lib.text.formats import Document

EXTENSIONS = {"text": "txt", "json": "json", "verbose_json": "json", "srt": "srt", "vtt": "vtt"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="audio files (wav, flac, ogg, mp3)")
    parser.add_argument("--url", help="server address (default: localhost:8000 for http, localhost:8001 for grpc)")
    parser.add_argument("--protocol", choices=[p.value for p in Protocol], default=Protocol.HTTP.value)
    parser.add_argument("--format", choices=formats.FORMATS, default="text", dest="output_format")
    parser.add_argument("--language", help="language code such as 'en' (multilingual checkpoints)")
    parser.add_argument("--task", choices=["transcribe", "translate"])
    parser.add_argument(
        "--timestamps",
        action=argparse.BooleanOptionalAction,
        help="decode with timestamp tokens (default: on, as openai-whisper; better text, and long audio is seeked by them)",
    )
    parser.add_argument("--word-timestamps", action="store_true", help="time every word (json and verbose_json show them)")
    parser.add_argument(
        "--long-form",
        choices=[m.value for m in LongFormMode],
        help="audio over 30 s: window after window (sequential, the default) or all windows at once (batched)",
    )
    parser.add_argument("--prompt", help="text to condition the decoding on (names, spelling)")
    parser.add_argument("--concurrency", type=_positive_int, default=4, help="requests in flight (default: 4)")
    parser.add_argument("--output-dir", type=Path, help="write FILE's stem + .txt/.json/.srt/.vtt here")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def request_options(args: argparse.Namespace) -> dict[str, object]:
    """The request parameters that the command-line flags ask for."""
    options: dict[str, object] = {}
    if args.timestamps is not None:  # else the server's default: on
        options["timestamps"] = args.timestamps
    if args.word_timestamps:
        options["word_timestamps"] = True
    for name in ("language", "task", "prompt", "long_form"):
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    return options


def render(output_format: str, path: Path, document: Document) -> str:
    """The file's transcript in `output_format`; the JSON formats name the file first."""
    return document.render(output_format, file=str(path))


def run(args: argparse.Namespace) -> int:
    """Transcribe every file; 0 if all succeeded, 1 otherwise (errors go to stderr)."""
    options = request_options(args)
    local = threading.local()

    def transcribe(path: Path) -> Document:
        if not hasattr(local, "client"):  # tritonclient clients are not shared between threads
            local.client = WhisperClient(args.url, args.protocol)
        return local.client.transcribe_document(path, **options)

    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    failures = 0
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool, tqdm(
        total=len(args.files), unit="file", file=sys.stderr, disable=True if len(args.files) < 2 else None
    ) as progress:
        futures: list[Future[Document]] = []
        for path in args.files:
            future = pool.submit(transcribe, path)
            future.add_done_callback(lambda _: progress.update())
            futures.append(future)
        for path, future in zip(args.files, futures):
            try:
                result = future.result()
            except (TranscriptionError, OSError) as error:
                failures += 1
                progress.write(f"whisper-triton: {path}: {error}", file=sys.stderr)
                continue
            _emit(args, path, render(args.output_format, path, result))
    return 1 if failures else 0


def _emit(args: argparse.Namespace, path: Path, rendered: str) -> None:
    if args.output_dir is not None:
        (args.output_dir / f"{path.stem}.{EXTENSIONS[args.output_format]}").write_text(rendered, encoding="utf-8")
    elif len(args.files) > 1 and args.output_format not in ("json", "verbose_json"):  # json lines name the file
        sys.stdout.write(f"==> {path} <==\n{rendered}\n")
    else:
        sys.stdout.write(rendered)
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="whisper-triton transcribe", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
