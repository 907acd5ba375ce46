"""`whisper-triton transcribe`: flags to request parameters, results to output, without a server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clients.cli import render, request_options
from python_backend_lib.apps.cli import build_parser
from python_backend_lib.core.segments import Segment
from python_backend_lib.text.formats import Document

RESULT = Document(
    text="Ask not.", segments=(Segment(0.0, 1.0, "Ask", (1,)), Segment(1.0, 2.5, "not.", (2,), id=1)), duration=2.5,
    language="en",
)


def parse(*argv: str):
    return build_parser().parse_args(["transcribe", "a.wav", *argv])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ((), {}),  # the server's defaults: timestamps on
        (("--format=srt",), {}),
        (("--word-timestamps", "--long-form=batched"), {"word_timestamps": True, "long_form": "batched"}),
        (("--format=vtt", "--no-timestamps"), {"timestamps": False}),
        (("--no-timestamps",), {"timestamps": False}),
        (("--timestamps",), {"timestamps": True}),
        (
            ("--language=de", "--task=translate", "--prompt=Hallo"),
            {"language": "de", "task": "translate", "prompt": "Hallo"},
        ),
    ],
)
def test_flags_become_typed_request_parameters(argv, expected):
    assert request_options(parse(*argv)) == expected


def test_protocol_and_concurrency_are_checked():
    with pytest.raises(SystemExit):
        parse("--protocol=ftp")
    with pytest.raises(SystemExit):
        parse("--concurrency=0")
    with pytest.raises(SystemExit):
        parse("--long-form=parallel")


def test_gateway_flags_have_the_documented_defaults():
    args = build_parser().parse_args(["gateway"])
    assert (args.triton_url, args.host, args.port, args.max_file_mb) == ("localhost:8001", "127.0.0.1", 9000, 25)
    assert args.model_ids is None  # whisper-1
    args = build_parser().parse_args(["gateway", "--model-id=whisper-1", "--model-id=tiny.en", "--port=9100"])
    assert (args.model_ids, args.port) == (["whisper-1", "tiny.en"], 9100)


def test_render_each_format():
    path = Path("talk.wav")
    assert render("text", path, RESULT) == "Ask not.\n"
    assert json.loads(render("json", path, RESULT))["file"] == "talk.wav"
    assert render("srt", path, RESULT).startswith("1\n00:00:00,000 --> 00:00:01,000\nAsk\n")
    assert render("vtt", path, RESULT).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nAsk\n")
    verbose = json.loads(render("verbose_json", path, RESULT))
    assert (verbose["file"], verbose["language"], verbose["segments"][1]["id"]) == ("talk.wav", "english", 1)


def test_serve_flags_have_the_documented_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.http_port, args.grpc_port, args.metrics_port, args.log_verbose) == (8000, 8001, 8002, 0)
    assert args.model_repository is None and args.checkpoint is None


def test_an_unreachable_server_is_reported_per_file(tmp_path, capsys):
    from python_backend_lib.apps.cli import main

    clip = tmp_path / "a.wav"
    clip.write_bytes(b"RIFF")
    status = main(["transcribe", str(clip), "--url=localhost:9"])  # nothing listens on the discard port
    assert status == 1
    assert f"whisper-triton: {clip}:" in capsys.readouterr().err
