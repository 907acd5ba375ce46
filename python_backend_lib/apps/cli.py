"""`whisper-triton serve`: start Triton with the Whisper models and wait for requests.

The `whisper-triton` command (whisper_triton.cli) adds this as its `serve`. Run as
`python -m python_backend_lib.apps.cli serve ...` it is that command alone, as in
any commit's checkout: bench.server_process serves other commits' code this way."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from python_backend_lib.apps import repository, server, server_watch
from python_backend_lib.apps.server import ServerError, ServerSettings, TritonServer
from python_backend_lib.checkpoints import packaged
from python_backend_lib.checkpoints.random_shapes import is_random_source
from python_backend_lib.core.quantization import Quantization
from python_backend_lib.serving.settings import CHECKPOINT_ENV, QUANTIZE_ENV

# The banner's first line: the server is ready (and `whisper-triton serve`'s tests wait for it).
READY_LINE = "whisper-triton is ready."
# `serve --mps`: ServerSettings.mps (None: auto).
MPS_CHOICES = {"auto": None, "on": True, "off": False}

HELP = "start Triton with the Whisper models and wait for requests"


class _Terminated(Exception):
    """SIGTERM arrived: stop the server as for Ctrl-C."""


class _StopRequests:
    """SIGINT and SIGTERM while `serve` runs. The first of either stops the server
    gracefully (raised as KeyboardInterrupt or _Terminated, wherever the launcher
    is: starting, serving); a Ctrl-C after that stops it now, from the handler,
    so the graceful stop under way only cleans up. A second SIGTERM changes
    nothing: Docker and Kubernetes send one and then SIGKILL."""

    def __init__(self) -> None:
        self.triton: TritonServer | None = None
        self.stopping = False

    def install(self, triton: TritonServer) -> None:
        self.triton = triton
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # Even where SIGINT was ignored on entry (a background job of a script), Ctrl-C stops the server.
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: object) -> None:
        if not self.stopping:
            self.stopping = True
            raise KeyboardInterrupt
        # Straight to the file descriptor: the handler may have interrupted a print to stderr.
        os.write(sys.stderr.fileno(), b"whisper-triton: stopping now, without waiting\n")
        self.triton.abort()

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if not self.stopping:
            self.stopping = True
            raise _Terminated


def add_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--model-repository", type=Path, help="default: the packaged model_repository/")
    serve.add_argument(
        "--checkpoint",
        metavar="NAME|FOLDER",
        help="Whisper checkpoint for every model: a packaged one by name ("
        + "; ".join(_packaged_help(checkpoint) for checkpoint in packaged.PACKAGED)
        + "), or a folder: Hugging Face's (config.json, *.safetensors, "
        "tokenizer.json; e.g. `hf download openai/whisper-small --local-dir whisper-small`) or "
        "CTranslate2's, as faster-whisper uses (model.bin, config.json, tokenizer.json; e.g. "
        "`hf download Systran/faster-whisper-small --local-dir faster-whisper-small`, converted once into "
        f"the cache); default: the packaged tiny.en (sets {CHECKPOINT_ENV})",
    )
    serve.add_argument(
        "--host",
        default=server.DEFAULT_HOST,
        metavar="ADDRESS",
        help=f"address Triton's HTTP, gRPC and metrics endpoints listen on (default {server.DEFAULT_HOST}: "
        "this machine only; 0.0.0.0 for every interface, as in a container)",
    )
    serve.add_argument("--http-port", type=int, default=server.DEFAULT_HTTP_PORT)
    serve.add_argument("--grpc-port", type=int, default=server.DEFAULT_GRPC_PORT)
    serve.add_argument("--metrics-port", type=int, default=server.DEFAULT_METRICS_PORT)
    serve.add_argument(
        "--verbose",
        action="store_true",
        help="pass on Triton's whole log (default: only its warnings and errors and the models' own lines)",
    )
    serve.add_argument(
        "--log-verbose", type=int, default=0, metavar="N", help="Triton's log verbosity (more than 0 implies --verbose)"
    )
    serve.add_argument(
        "--trace-file",
        type=Path,
        metavar="PATH",
        help="write Triton's timestamps of traced requests (each model's queue and compute, the ensemble's, "
        "gRPC's) to this JSON file when the server stops",
    )
    serve.add_argument(
        "--trace-rate",
        type=_positive_int,
        default=1000,
        metavar="N",
        help="with --trace-file: trace one request in N (default 1000; 1 traces every request)",
    )
    serve.add_argument(
        "--gpus",
        type=_gpu_list,
        metavar="LIST",
        help="GPUs to serve on, one engine each: all (default: every GPU this machine shows), "
        "a comma-separated list of indexes such as 0,1, or none (the CPU)",
    )
    serve.add_argument(
        "--engines",
        type=_engine_count,
        default=None,
        metavar="N",
        help="whisper engines (Triton instances, a process each) per GPU, or on the CPU without one: "
        "auto (default) runs 3 per GPU for tiny-sized checkpoints, whose host work outruns one GPU, and one "
        "for larger ones or on the CPU; a repository whose whisper instance group was changed is served as written. "
        "The streamed path's engine (whisper_stream, for gRPC stream_infer) stays one per GPU or on the CPU",
    )
    serve.add_argument(
        "--mps",
        choices=MPS_CHOICES,
        default="auto",
        help="run each GPU's model processes (whisper engines, preprocessing instances) under CUDA MPS, "
        "a daemon this server starts and stops, so that their kernels share the GPU at once: auto (default) "
        "with GPUs where nvidia-cuda-mps-control is installed, on (refuse to start without it), or off",
    )
    serve.add_argument(
        "--require-gpu-engine",
        action="store_true",
        help="on a GPU, refuse to start unless the engine runs with FlashInfer and CUDA graphs "
        "(instead of falling back to the slower PyTorch attention)",
    )
    serve.add_argument(
        "--quantize",
        type=_quantization,
        metavar="{" + ",".join(q.value for q in Quantization) + "}",
        help="how the whisper engines' linear layers multiply: none (the shipped config's, exact: the "
        "checkpoint's weights as they are); int8, on the CPU only (--gpus none where there are GPUs); or fp8, "
        "on GPUs with FP8 tensor cores (Hopper, Ada), the products over the encoder's positions in FP8: "
        f"faster, its words close to the exact ones' but not always the same (sets {QUANTIZE_ENV})",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=server_watch.DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="on a stop (Ctrl-C, SIGTERM), wait this long at most for the requests in flight; those "
        "still unanswered then fail with UNAVAILABLE (retry on another server)",
    )
    serve.add_argument(
        "--startup-timeout",
        type=float,
        default=server.DEFAULT_STARTUP_TIMEOUT_S,
        metavar="SECONDS",
        help="give up if the models are not ready by then",
    )


def run(args: argparse.Namespace) -> int:
    try:
        return _serve(args)
    except ServerError as error:
        print(f"whisper-triton: {error}", file=sys.stderr)
        return 1


def _serve(args: argparse.Namespace) -> int:
    settings = ServerSettings(
        model_repository=(args.model_repository or server.packaged_model_repository()).resolve(),
        checkpoint=_checkpoint_source(args.checkpoint),
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        log_verbose=args.log_verbose,
        trace_file=args.trace_file.resolve() if args.trace_file else None,
        trace_rate=args.trace_rate,
        gpus=args.gpus,
        require_gpu_engine=args.require_gpu_engine,
        quantization=args.quantize,
        engines=args.engines,
        mps=MPS_CHOICES[args.mps],
        drain_timeout=args.drain_timeout,
    )
    verbose = args.verbose or args.log_verbose > 0
    stop_requests = _StopRequests()

    def report(message: str) -> None:
        _say(f"{message} (Ctrl-C again to stop now)" if stop_requests.stopping else message)

    triton = TritonServer(settings, log=sys.stderr, verbose=verbose, report=report)
    stop_requests.install(triton)
    try:
        triton.start(timeout=args.startup_timeout)
        print(_ready_message(triton), flush=True)
        status = triton.wait_while_healthy()
        if status is None:  # an engine gave up: stop, so that Docker or Kubernetes replaces this server
            print(
                "whisper-triton: a whisper engine failed repeatedly or stalled, and refuses new requests "
                "(see the log above); stopping so that this server can be replaced",
                file=sys.stderr,
                flush=True,
            )
            return 1
        print(f"whisper-triton: tritonserver exited with status {status}", file=sys.stderr)
        return status or 1
    except (KeyboardInterrupt, _Terminated):
        return 0
    finally:
        stop_requests.stopping = True  # from here on, Ctrl-C stops at once
        triton.stop()


def _say(message: str) -> None:
    print(f"whisper-triton: {message}", file=sys.stderr, flush=True)


def _packaged_help(checkpoint: packaged.PackagedCheckpoint) -> str:
    aliases = [alias for alias, name in packaged.ALIASES.items() if name == checkpoint.name]
    named = " or ".join([checkpoint.name, *aliases])
    install = "" if checkpoint.extra is None else f", after {packaged.install_hint(checkpoint)}"
    return f"{named}: {checkpoint.description}{install}"


def _checkpoint_source(source: str | None) -> str | None:
    """A --checkpoint folder as an absolute path (`~` expanded): the models do not
    share this command's idea of the current folder or home. A packaged checkpoint's
    name stays a name, even where a folder of that name is here (./base names that).
    "random:<size>" becomes its servable folder in the cache (random weights, a tokenizer
    that spells token i as "<i>"): the models need a tokenizer, which it lacks."""
    if source is None or packaged.packaged_checkpoint(source) is not None:
        return source
    if is_random_source(source):
        from python_backend_lib.checkpoints.served_random import served_random_folder

        return str(served_random_folder(source, say=_say))
    if not Path(source).expanduser().is_dir():
        return source
    return str(Path(source).expanduser().resolve())


def _gpu_list(text: str) -> str | None:
    """--gpus: None for all, "" for none, else a list of GPU indexes (CUDA_VISIBLE_DEVICES)."""
    if text == "all":
        return None
    if text == "none":
        return ""
    indexes = text.split(",")
    if not all(index.isdigit() for index in indexes):
        raise argparse.ArgumentTypeError(f"expected all, none or GPU indexes such as 0,1; got {text!r}")
    return ",".join(indexes)


def _engine_count(text: str) -> int | None:
    """--engines: None for auto, else a count of at least 1."""
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a number of engines of at least 1; got {text!r}")
    return int(text)


def _quantization(text: str) -> Quantization:
    try:
        return Quantization(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {' or '.join(q.value for q in Quantization)}; got {text!r}"
        ) from None


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1; got {text!r}")
    return int(text)


def served_checkpoint(settings: ServerSettings, environ: dict[str, str] | None = None) -> str:
    """What the banner says is served: the checkpoint the whisper model loads, a packaged
    one with what it is ("base (multilingual base: ...)")."""
    source = settings.checkpoint
    if source is None:
        config = repository.whisper_config(settings.model_repository)
        text = config.read_text() if config.exists() else ""
        source = repository.configured_checkpoint(text, dict(os.environ if environ is None else environ))
    found = packaged.packaged_checkpoint(source)
    return f"{source} ({found.description})" if found is not None else source


def _ready_message(triton: TritonServer) -> str:
    host = triton.settings.host
    if host in server.ANY_HOST:
        where = "every interface: other machines reach it too"
    elif host.startswith("127."):
        where = f"{host}: this machine only (--host 0.0.0.0 opens every interface)"
    else:
        where = f"{host} only"
    return "\n".join(
        [
            READY_LINE,
            f"  serving: {served_checkpoint(triton.settings)}",
            f"  HTTP:    http://{triton.http_url}",
            f"  gRPC:    grpc://{triton.grpc_url}",
            f"  metrics: {triton.metrics_url}",
            f"  listening on {where}",
            "Transcribe a file from another terminal:",
            f"  whisper-triton transcribe path/to/audio.wav --url http://{triton.http_url}",
            f"  whisper-triton transcribe path/to/audio.wav --url grpc://{triton.grpc_url} --verbose"
            "   (segments as they are decoded)",
            "Stop with Ctrl-C.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="whisper-triton")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_arguments(commands.add_parser("serve", help=HELP))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
