"""The `whisper-triton` command: `serve` starts Triton, `transcribe` sends it files,
`gateway` puts OpenAI's audio API in front of it.

Each command is its own package's (python_backend_lib.apps.cli, clients.cli and
gateway.cli); only this module knows them all, so none of them imports another."""

from __future__ import annotations

import argparse
import sys

from clients import cli as client_cli
from gateway import cli as gateway_cli
from python_backend_lib.apps import cli as server_cli

EXAMPLES = """\
examples:
  whisper-triton serve                                   start Triton with the packaged tiny.en
  whisper-triton transcribe talk.mp3 -f srt > talk.srt   from another terminal
  whisper-triton gateway                                 OpenAI's audio API on port 9000
  whisper-triton COMMAND --help                          each command's options
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="whisper-triton",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=client_cli.version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help=server_cli.HELP)
    server_cli.add_arguments(serve)
    serve.set_defaults(run=server_cli.run)

    transcribe = commands.add_parser("transcribe", help="transcribe audio files on a running server")
    client_cli.add_arguments(transcribe)
    transcribe.set_defaults(run=client_cli.run)

    openai_gateway = commands.add_parser("gateway", help="serve OpenAI's audio API in front of a running Triton")
    gateway_cli.add_arguments(openai_gateway)
    openai_gateway.set_defaults(run=gateway_cli.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
