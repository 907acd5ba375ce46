"""`whisper-triton gateway`: OpenAI's audio API in front of a running Triton (`app`),
in one process or `--workers` of them (`workers`)."""

import argparse
import os
import sys

from clients.connection import AddressError
from gateway import app, live_turn, realtime, workers
from gateway.api_key import API_KEY_ENV
from gateway.app import BYTES_PER_MB, DEFAULT_MAX_FILE_MB, DEFAULT_TRITON_URL, GatewaySettings, create_app
from gateway.openai_api import DEFAULT_MODEL_ID

DEFAULT_PORT = 9000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--triton-url", default=DEFAULT_TRITON_URL,
        help="Triton's gRPC address, host:port or grpc://host:port (default: %(default)s)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on (default: %(default)s)")
    parser.add_argument(
        "--model-id", action="append", dest="model_ids", metavar="ID",
        help=f"a `model` value to accept, repeatable (default: {DEFAULT_MODEL_ID}); "
        "name the checkpoint here, e.g. --model-id whisper-1 --model-id tiny.en",
    )
    parser.add_argument(
        "--max-file-mb", type=float, default=DEFAULT_MAX_FILE_MB, help="upload limit (default: %(default)s)"
    )
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="per request to Triton (default: none)")
    parser.add_argument(
        "--max-live-sessions", type=int, default=realtime.DEFAULT_MAX_SESSIONS, metavar="N",
        help="live transcription sessions (/v1/realtime) at once; one more is refused (default: %(default)s)",
    )
    parser.add_argument(
        "--live-hypothesis-every", type=float, default=live_turn.HYPOTHESIS_STEP_S, metavar="SECONDS",
        help="a live turn is transcribed again each time it has grown by this much audio, one transcription at "
        "a time per session: less shows words sooner and asks more of the server (default: %(default)s)",
    )
    parser.add_argument(
        "--workers", type=int, default=1, metavar="N",
        help="gateway processes on the one port, each with its own cores: one runs about a hundred live "
        "sessions on a core; --max-live-sessions stays the limit for them all (default: %(default)s)",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV) or None, metavar="KEY",
        help=f"refuse /v1 requests without `Authorization: Bearer KEY` (401); default: ${API_KEY_ENV}, "
        "else no key (anyone who reaches the port may transcribe)",
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM, in one process or `--workers` (`workers`); 0 after a
    graceful stop."""
    import uvicorn

    try:
        settings = GatewaySettings(
            triton_url=args.triton_url,
            model_ids=tuple(args.model_ids or (DEFAULT_MODEL_ID,)),
            max_file_bytes=int(args.max_file_mb * BYTES_PER_MB),
            timeout_s=args.timeout,
            api_key=args.api_key,
            max_live_sessions=args.max_live_sessions,
            live_hypothesis_every_s=args.live_hypothesis_every,
        )
        workers.check_workers(args.workers)
    except AddressError as error:
        print(f"whisper-triton gateway: --triton-url: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"whisper-triton gateway: {error}", file=sys.stderr)
        return 2
    if args.workers > 1:
        return workers.serve(create_app, settings, workers.Listen(args.host, args.port), args.workers)
    workers.serve_until_stopped(uvicorn.Server(uvicorn.Config(create_app(settings), host=args.host, port=args.port,
                                                              log_level="info")))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="whisper-triton gateway", description=app.__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
