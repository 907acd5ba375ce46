"""`whisper-triton transcribe FILE...`: send files to a running server, print or write transcripts.

Files are sent `--concurrency` at a time (the server batches them) and their
transcripts printed in the order given, or written to --output-dir. With more
than one file a progress bar goes to stderr; one long file gets a progress
line instead (`progress`). The server sends each transcript whole
(verbose_json); it is written here in the chosen format by the code the
server's FORMATTED output uses (`outputs`, `formats`, `subtitles`).

Every flag becomes a request parameter checked before anything is sent, by
the server's own parser: a bad value is one line and exit status 2. A file
the server refuses is reported on stderr and the others go on (exit status
1); a server that cannot be reached stops the command at once, with the cause.

With --verbose, each file's segments are printed as the server decodes them,
as openai-whisper prints them (`[00:00.000 --> 00:04.000]  text`): the files
go one at a time over the streamed path (gRPC's stream_infer, the
`transcribe_stream` model), the lines to stdout when the transcripts go to
--output-dir, else to stderr, so that stdout still holds the transcript alone.

Ctrl-C stops the command within a second (exit status 130), and the requests
in flight on the server too: each request carries an id of its own
(`request_id`), and the command sends a cancel naming it (`WhisperClient.cancel`)
before it leaves, so that the server frees their decoding slots.

openai-whisper's spellings work too: `--output_format`, `--output_dir`,
`--language English`; `--model` is accepted, but the server transcribes with
the checkpoint it was started with, which a warning says.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from pathlib import Path

from tqdm import tqdm

from clients.api import ServerUnreachable, TranscriptionError, WhisperClient, new_request_id
from clients.connection import AddressError, Protocol, parse_address
from clients.outputs import ALL, CHOICES, STDIN, Input, StdoutDocument, output_formats, unique_stems, write_files
from clients.progress import ERASE_LINE, ProgressLine, SpeedRecord, audio_seconds
from clients.streaming import verbose_line
from python_backend_lib.contract.parameters import parse_request_parameters
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import LongFormMode, WindowPadding
from python_backend_lib.text.formats import Document, SubtitleOptions

PROG = "whisper-triton transcribe"
DESCRIPTION = (
    "Send audio files to a running whisper-triton server (whisper-triton serve) and print their "
    "transcripts, or write them as files: text, JSON, SRT, WebVTT or TSV. "
    "openai-whisper's spellings of the flags work too (--output_format, --output_dir, --word_timestamps, "
    "--initial_prompt, ...)."
)
EXAMPLES = """\
examples:
  whisper-triton transcribe talk.mp3                          the text, on stdout
  whisper-triton transcribe talk.mp3 -f srt > talk.srt        subtitles
  whisper-triton transcribe *.wav -o subtitles -f all         txt, srt, vtt, tsv and json files per input
  whisper-triton transcribe talk.mp3 -f vtt --word-timestamps --max-line-width 42 --max-line-count 2
  cat talk.wav | whisper-triton transcribe -                  audio from standard input
  whisper-triton transcribe talk.mp3 --url grpc://localhost:8001
  whisper-triton transcribe talk.mp3 --verbose -o out          segments as they are decoded (gRPC, port 8001)
"""
# Flags that lay out word-timed subtitles: they need --word-timestamps, as in openai-whisper.
LAYOUT_FLAGS = ("max_line_width", "max_line_count", "highlight_words")
# Ctrl-C: the shell's status for a command ended by SIGINT.
INTERRUPTED = 128 + signal.SIGINT
CLOSED_PIPE = 128 + signal.SIGPIPE  # what a shell reports for a writer whose reader left
# Ctrl-C: the cancels and the answers they bring end within this long, else the command leaves without them.
INTERRUPT_GRACE_S = 0.8
CANCEL_TIMEOUT_S = 0.5


def version() -> str:
    """The installed distribution's version, or the package's own when run from a checkout."""
    try:
        return f"whisper-triton {importlib.metadata.version('whisper-triton')}"
    except importlib.metadata.PackageNotFoundError:  # `python -m whisper_triton.cli` in a checkout
        from python_backend_lib import __version__

        return f"whisper-triton {__version__}"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help without openai-whisper's underscore spellings of the flags (DESCRIPTION names them)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = [option for option in action.option_strings if "_" not in option]
        return super()._format_action_invocation(argparse.Action(shown, action.dest, nargs=action.nargs,
                                                                 metavar=action.metavar))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.epilog = EXAMPLES
    parser.formatter_class = _HelpFormatter
    parser.add_argument("files", nargs="+", metavar="FILE", help="audio or video files (wav, flac, ogg, mp3, m4a, mp4, webm, ...); - reads stdin")
    parser.add_argument("--version", action="version", version=version())

    server = parser.add_argument_group("server")
    server.add_argument(
        "--url", metavar="URL", help="host:port, or an http://, https:// or grpc:// URL (default: localhost:8000; 8001 for grpc)"
    )
    server.add_argument(
        "--protocol", choices=[p.value for p in Protocol], help="default: the URL's scheme, else http"
    )
    server.add_argument("--concurrency", type=_positive_int, default=4, metavar="N", help="requests in flight (default: 4)")

    output = parser.add_argument_group("output")
    output.add_argument(
        "-f", "--format", "--output-format", "--output_format", choices=CHOICES, default="text", dest="output_format", metavar="FORMAT",
        help="text (txt), json, verbose_json, srt, vtt, tsv, or all (with --output-dir) (default: text)",
    )
    output.add_argument(
        "-o", "--output-dir", "--output_dir", type=Path, metavar="DIR", help="write <stem>.<ext> files here, each path reported, instead of stdout"
    )
    output.add_argument("--max-line-width", "--max_line_width", type=int, metavar="N", help="subtitles: characters per line (word timestamps)")
    output.add_argument("--max-line-count", "--max_line_count", type=int, metavar="N", help="subtitles: lines per cue (with --max-line-width)")
    output.add_argument("--highlight-words", "--highlight_words", action="store_true", help="subtitles: underline each word as it is spoken")
    output.add_argument(
        "--verbose", nargs="?", const=True, default=False, type=_true_or_false, metavar="True|False",
        help="print each segment as the server decodes it, as openai-whisper does (to stderr when the transcript "
        "goes to stdout); files go one at a time, over gRPC (default URL grpc://localhost:8001)",
    )

    decoding = parser.add_argument_group("decoding")
    decoding.add_argument(
        "--model", metavar="NAME",
        help="accepted for openai-whisper's habit and otherwise ignored: the server transcribes with the checkpoint "
        "it was started with (whisper-triton serve --checkpoint), which a warning says",
    )
    decoding.add_argument(
        "--language", metavar="LANGUAGE",
        help="a code such as 'en' or a name such as 'English' (default: multilingual checkpoints detect it)",
    )
    decoding.add_argument("--task", choices=["transcribe", "translate"])
    decoding.add_argument(
        "--timestamps", action=argparse.BooleanOptionalAction,
        help="decode with timestamp tokens (default: on, as openai-whisper: better text, long audio seeks by them)",
    )
    decoding.add_argument("--word-timestamps", "--word_timestamps", action="store_true", help="time every word (json, verbose_json, subtitles)")
    decoding.add_argument(
        "--long-form", choices=[m.value for m in LongFormMode],
        help="audio over 30 s: window after window (sequential, the default) or chunks cut at pauses, side by side (batched)",
    )
    decoding.add_argument("--prompt", "--initial-prompt", "--initial_prompt", metavar="TEXT", help="text to condition the decoding on (names, spelling)")
    decoding.add_argument("--temperature", type=float, metavar="T", help="first sampling temperature (default: 0, greedy)")
    decoding.add_argument("--temperature-increment", "--temperature_increment_on_fallback", type=float, metavar="T", help="added on each fallback, up to 1.0, at most 11 temperatures a window (default: 0.2; 0: none)")
    decoding.add_argument("--beam-size", "--beam_size", type=int, metavar="N", help="beam search with N beams at temperature 0 (default: greedy)")
    decoding.add_argument("--best-of", "--best_of", type=int, metavar="N", help="above temperature 0, keep the best of N samples (default: 1)")
    decoding.add_argument("--seed", type=int, metavar="N", help="what the temperature fallback's draws follow (default: 0)")
    decoding.add_argument("--patience", type=float, metavar="P", help="beam search ends after round(N * P) candidates (default: 1)")
    decoding.add_argument(
        "--length-penalty", "--length_penalty", type=float, metavar="ALPHA",
        help="rank candidates by log-probability / ((5 + length) / 6) ** ALPHA (default: / length)",
    )
    decoding.add_argument(
        "--no-condition-on-previous-text", action="store_false", dest="condition_on_previous_text", default=None,
        help="do not prompt each window with the text before it",
    )
    decoding.add_argument("--compression-ratio-threshold", "--compression_ratio_threshold", type=float, metavar="X", help="fallback above this (default: 2.4)")
    decoding.add_argument("--logprob-threshold", "--logprob_threshold", type=float, metavar="X", help="fallback below this log-probability (default: -1)")
    decoding.add_argument("--no-speech-threshold", "--no_speech_threshold", type=float, metavar="P", help="silence above this probability (default: 0.6)")
    decoding.add_argument(
        "--window-padding", choices=[p.value for p in WindowPadding],
        help="past the end of the audio: as openai-whisper and faster-whisper pad it (the default) or as transformers does",
    )
    decoding.add_argument(
        "--hallucination-silence-threshold", "--hallucination_silence_threshold", type=float, metavar="S",
        help="with --word-timestamps: drop doubtful text with at least S seconds of silence around it",
    )
    vad = parser.add_argument_group("voice activity (the server needs the [vad] extra)")
    vad.add_argument("--vad-filter", "--vad_filter", action="store_true", default=None, help="leave out what Silero VAD finds is not speech before decoding")
    vad.add_argument(
        "--vad-parameters", "--vad_parameters", metavar="JSON",
        help='with --vad-filter: faster-whisper\'s VAD options, e.g. \'{"min_silence_duration_ms": 500}\'',
    )


def _true_or_false(text: str) -> bool:
    """openai-whisper's spelling of a yes or no: True or False (any case)."""
    choices = {"true": True, "false": False}
    if text.lower() not in choices:
        raise argparse.ArgumentTypeError(f"must be True or False, got {text!r}")
    return choices[text.lower()]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# Flags sent as the request parameters of the same name when given.
PARAMETER_FLAGS = (
    "language", "task", "timestamps", "prompt", "long_form", "temperature", "temperature_increment",
    "condition_on_previous_text", "compression_ratio_threshold", "logprob_threshold", "no_speech_threshold",
    "hallucination_silence_threshold", "window_padding", "vad_filter", "vad_parameters",
    "beam_size", "best_of", "patience", "length_penalty", "seed",
)


def request_options(args: argparse.Namespace) -> dict[str, object]:
    """The request parameters that the command-line flags ask for (the server's
    defaults for the others)."""
    options: dict[str, object] = {name: getattr(args, name) for name in PARAMETER_FLAGS if getattr(args, name) is not None}
    if args.word_timestamps:
        options["word_timestamps"] = True
    return options


class UsageError(Exception):
    """Flags that cannot work together, or a bad value: one line, exit status 2."""


def check(args: argparse.Namespace) -> SubtitleOptions:
    """Refuse what cannot work before anything is sent; the subtitle layout asked for."""
    if not args.word_timestamps:
        for name in LAYOUT_FLAGS:
            if getattr(args, name) not in (None, False):
                raise UsageError(f"--{name.replace('_', '-')} lays out timed words: add --word-timestamps")
    if args.max_line_count is not None and args.max_line_width is None:
        raise UsageError("--max-line-count needs --max-line-width (lines are only broken at a width)")
    if args.output_format == ALL and args.output_dir is None:
        raise UsageError("--format all writes several files: give --output-dir")
    if args.files.count(STDIN) > 1:
        raise UsageError("'-' (standard input) can be read only once")
    if STDIN in args.files and sys.stdin.isatty():
        raise UsageError("'-' reads audio from standard input, which is a terminal: pipe a file in")
    if args.verbose and args.url is None and args.protocol is None:
        args.protocol = Protocol.GRPC.value  # segments stream over gRPC only
    try:
        address = parse_address(args.url, args.protocol)
        if args.verbose and address.protocol is not Protocol.GRPC:
            raise UsageError(
                f"--verbose streams segments over gRPC only, and {address} is HTTP: give --url grpc://HOST:8001"
            )
        parse_request_parameters(request_options(args))  # the server's own checks, before sending
        return SubtitleOptions(args.max_line_width, args.max_line_count, args.highlight_words)
    except (AddressError, RequestError) as error:
        raise UsageError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    """Transcribe every file; 0 if all succeeded, 1 otherwise, 2 for bad flags, 130 for Ctrl-C
    (errors go to stderr)."""
    try:
        layout = check(args)
    except UsageError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    listen_for_ctrl_c()
    if args.model is not None:
        print(
            f"{PROG}: warning: --model {args.model} is not applied: the server transcribes with the checkpoint "
            "it was started with (whisper-triton serve --checkpoint NAME chooses it)",
            file=sys.stderr,
        )
    try:
        return transcribe_all(args, layout)
    except KeyboardInterrupt:  # before any request was sent (reading standard input, say)
        print(f"{PROG}: interrupted", file=sys.stderr)
        return INTERRUPTED


def transcribe_all(args: argparse.Namespace, layout: SubtitleOptions) -> int:
    """Send every file, `--concurrency` at a time, and write each transcript in order."""
    inputs = [Input(name) for name in args.files]
    stdin_audio = sys.stdin.buffer.read() if any(i.name == STDIN for i in inputs) else b""
    options = request_options(args)
    request_ids = [new_request_id() for _ in inputs]  # Ctrl-C names them in its cancels
    local = threading.local()

    def transcribe(item: Input, request_id: str) -> Document:
        if not hasattr(local, "client"):  # tritonclient clients are not shared between threads
            local.client = WhisperClient(args.url, args.protocol)
        source = stdin_audio if item.name == STDIN else _read(item.name)
        if args.verbose:
            return stream(local.client, item, source, request_id)
        if len(inputs) > 1:
            return local.client.transcribe_document(source, request_id=request_id, **options)
        seconds_of_audio = audio_seconds(source)
        speed = SpeedRecord(str(local.client.address))
        started = time.monotonic()
        with ProgressLine(item.name, seconds_of_audio, speed.seconds_per_audio_second()):
            document = local.client.transcribe_document(source, request_id=request_id, **options)
        speed.measured(seconds_of_audio, time.monotonic() - started)
        return document

    def stream(client: WhisperClient, item: Input, source: bytes, request_id: str) -> Document:
        lines = sys.stdout if args.output_dir is not None else sys.stderr
        if len(inputs) > 1:
            print(f"==> {item.name} <==", file=lines, flush=True)
        for update in client.stream(source, request_id=request_id, response_format="verbose_json", **options):
            for segment in update.new_segments:
                print(verbose_line(segment), file=lines, flush=True)
        return Document.from_verbose_json(update.outputs.formatted)

    formats = output_formats(args.output_format)
    stdout = None if args.output_dir else StdoutDocument(sys.stdout, formats[0], layout, several=len(inputs) > 1)
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    failures = 0
    # --verbose: one file at a time, so that its lines follow one another.
    pool = ThreadPoolExecutor(max_workers=1 if args.verbose else args.concurrency)
    quiet = len(inputs) < 2 or args.verbose  # the verbose lines are the progress
    progress = tqdm(total=len(inputs), unit="file", file=sys.stderr, disable=True if quiet else None)
    futures: list[Future[Document]] = []
    try:
        for item, request_id in zip(inputs, request_ids):
            future = pool.submit(transcribe, item, request_id)
            future.add_done_callback(lambda _: progress.update())
            futures.append(future)
        for item, stem, future in zip(inputs, unique_stems(inputs), futures):
            try:
                document = future.result()
            except ServerUnreachable as error:  # every other file would fail the same way
                pool.shutdown(cancel_futures=True)
                progress.close()
                print(f"{PROG}: {error}", file=sys.stderr)
                return 1
            except (TranscriptionError, _InputError) as error:
                failures += 1
                progress.write(f"{PROG}: {item.name}: {error}", file=sys.stderr)
                continue
            if stdout is not None:
                stdout.write(item.name, document)
                continue
            for path in write_files(args.output_dir, stem, formats, document, layout):
                progress.write(f"{item.name} -> {path}", file=sys.stdout)
    except KeyboardInterrupt:
        progress.close()
        return stop_on_interrupt(args, pool, futures, request_ids)
    except BrokenPipeError:  # the reader of standard output left (`| head`): stop as for Ctrl-C
        progress.close()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush has nowhere to fail
        return stop_on_interrupt(args, pool, futures, request_ids, "standard output was closed", CLOSED_PIPE)
    pool.shutdown()
    progress.close()
    return 1 if failures else 0


def listen_for_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt here even where this process started with SIGINT
    ignored or blocked, as a child inherits both (a script's background job, a parent
    that masked it): otherwise the command would decode to the end, deaf to it."""
    if threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_on_interrupt(
    args: argparse.Namespace,
    pool: ThreadPoolExecutor,
    futures: list[Future[Document]],
    request_ids: list[str],
    why: str = "interrupted",
    status: int = INTERRUPTED,
) -> int:
    """Ctrl-C (or a closed standard output: `why`, `status`): send no more files, cancel
    those in flight on the server, and leave within INTERRUPT_GRACE_S, without a traceback.

    Leaving once the server has answered the cancelled requests closes no gRPC call
    while Triton still runs it (a transport cancel, which Triton 2.51 can crash on
    under load: server#7368); a server that does not answer in time is left."""
    signal.signal(signal.SIGINT, _leave_now)  # a second Ctrl-C does not wait
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    pool.shutdown(wait=False, cancel_futures=True)
    running = [(future, request_id) for future, request_id in zip(futures, request_ids) if not future.done()]
    outcome = _cancel_on_server(args, [request_id for _, request_id in running], deadline)
    _, unanswered = wait_for_futures([future for future, _ in running], timeout=max(0.0, deadline - time.monotonic()))
    if unanswered and outcome.startswith("; cancelled"):
        outcome = f"; sent a cancel for {len(running)}, which the server had not confirmed by now"
    erase = ERASE_LINE if sys.stderr.isatty() else ""  # a progress line still drawn
    print(f"{erase}{PROG}: {why}{outcome}", file=sys.stderr)
    if unanswered:  # their threads would hold the interpreter's exit until the server answers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _cancel_on_server(args: argparse.Namespace, request_ids: list[str], deadline: float) -> str:
    """Send a cancel for each request; what to add to the "interrupted" line ("cancelled"
    once the server has answered them all: it stopped decoding them)."""
    if not request_ids:
        return ""
    sent = 0
    try:
        with WhisperClient(args.url, args.protocol, timeout_s=CANCEL_TIMEOUT_S) as client:
            for request_id in request_ids:
                if time.monotonic() > deadline:
                    break
                client.cancel(request_id)
                sent += 1
    except TranscriptionError as error:
        return f"; could not cancel on the server: {error}"
    plural = "" if sent == 1 else "s"
    return f"; cancelled {sent} request{plural} on the server"


def _leave_now(signum: int, frame: object) -> None:
    os._exit(INTERRUPTED)


class _InputError(Exception):
    """An input file that cannot be read."""


def _read(name: str) -> bytes:
    try:
        return Path(name).read_bytes()
    except FileNotFoundError:
        raise _InputError("no such file") from None
    except IsADirectoryError:
        raise _InputError("is a folder, not an audio file") from None
    except OSError as error:
        raise _InputError(f"cannot read it: {error.strerror or error}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
