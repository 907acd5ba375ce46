"""`whisper-triton transcribe`: flags to request parameters, results to output, without a server."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from clients.cli import request_options
from clients.connection import AddressError, Protocol, ServerAddress, parse_address, triton_message
from clients.outputs import EXTENSIONS, Input, StdoutDocument, output_formats, unique_stems
from python_backend_lib.core.segments import Segment
from python_backend_lib.text.formats import Document, ResponseFormat, SubtitleOptions
from whisper_triton.cli import build_parser

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
        (
            ("--temperature=0.4", "--temperature-increment=0", "--no-condition-on-previous-text",
             "--compression-ratio-threshold=3", "--logprob-threshold=-2", "--no-speech-threshold=0.9"),
            {"temperature": 0.4, "temperature_increment": 0.0, "condition_on_previous_text": False,
             "compression_ratio_threshold": 3.0, "logprob_threshold": -2.0, "no_speech_threshold": 0.9},
        ),
        (("--initial-prompt=Names.",), {"prompt": "Names."}),
        (("--initial_prompt=Names.", "--word_timestamps", "--temperature_increment_on_fallback=0"),
         {"prompt": "Names.", "word_timestamps": True, "temperature_increment": 0.0}),
        (("--language=English", "--model=small"), {"language": "English"}),  # the server reads the name
        (("--window-padding=openai-whisper",), {"window_padding": "openai-whisper"}),
        (("--window-padding=transformers",), {"window_padding": "transformers"}),
        (("--beam-size=5", "--best-of=3", "--patience=1.5", "--length-penalty=0.6", "--seed=9"),
         {"beam_size": 5, "best_of": 3, "patience": 1.5, "length_penalty": 0.6, "seed": 9}),
        (("--beam_size", "4", "--best_of", "2", "--length_penalty", "1"),
         {"beam_size": 4, "best_of": 2, "length_penalty": 1.0}),
    ],
)
def test_flags_become_typed_request_parameters(argv, expected):
    assert request_options(parse(*argv)) == expected


def test_openai_whisper_spellings_are_accepted_and_kept_out_of_the_help(capsys):
    args = parse("--output_format", "all", "--output_dir", "out", "--max_line_width", "40", "--model", "tiny.en")
    assert (args.output_format, str(args.output_dir), args.max_line_width, args.model) == ("all", "out", 40, "tiny.en")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["transcribe", "--help"])
    shown = capsys.readouterr().out
    assert "--output-format" in shown and "--output_format" in shown  # named once, in the description
    assert "--output_dir" not in shown.split("positional arguments")[1]


@pytest.mark.parametrize(
    ("given", "code"),
    [("en", "en"), ("EN", "en"), ("English", "en"), ("english", "en"), (" German ", "de"), ("Myanmar", "my"),
     ("norwegian nynorsk", "nn"), ("castilian", "es"), ("zz", "zz")],
)
def test_languages_may_be_named(given, code):
    from python_backend_lib.contract.parameters import parse_request_parameters

    assert parse_request_parameters({"language": given}).decoding.language == code


def test_the_estimate_of_a_long_file(tmp_path):
    from clients.progress import MIN_MEASURED_AUDIO_S, ProgressLine, SpeedRecord

    assert ProgressLine("a.wav", 120.0).text(5) == "a.wav: transcribing 2:00 of audio on the server, 0:05 so far"
    line = ProgressLine("a.wav", 120.0, seconds_per_audio_second=0.1)  # 12 s expected
    assert line.text(3).endswith(", 0:03 so far, ~25% (estimated), about 0:09 left")
    assert line.text(13).endswith(", 0:13 so far, longer than this server's earlier speed suggested")
    record = SpeedRecord("http://localhost:8000", tmp_path / "speed.json")
    assert record.seconds_per_audio_second() is None
    record.measured(MIN_MEASURED_AUDIO_S / 2, 100.0)  # too short to tell
    assert record.seconds_per_audio_second() is None
    record.measured(100.0, 10.0)
    record.measured(100.0, 20.0)
    assert record.seconds_per_audio_second() == pytest.approx(0.15)
    assert SpeedRecord("grpc://localhost:8001", record.path).seconds_per_audio_second() is None


def test_protocol_and_concurrency_are_checked():
    with pytest.raises(SystemExit):
        parse("--protocol=ftp")
    with pytest.raises(SystemExit):
        parse("--concurrency=0")
    with pytest.raises(SystemExit):
        parse("--long-form=parallel")


def test_the_command_loads_no_torch():
    """`whisper-triton` holds every subcommand, the client's among them: torch would
    add seconds to each `transcribe` at start, and to its exit after Ctrl-C."""
    code = "import sys, whisper_triton.cli\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gateway_flags_have_the_documented_defaults():
    args = build_parser().parse_args(["gateway"])
    assert (args.triton_url, args.host, args.port, args.max_file_mb) == ("localhost:8001", "127.0.0.1", 9000, 25)
    assert args.model_ids is None  # whisper-1
    args = build_parser().parse_args(["gateway", "--model-id=whisper-1", "--model-id=tiny.en", "--port=9100"])
    assert (args.model_ids, args.port) == (["whisper-1", "tiny.en"], 9100)


def render(output_format: str, path: Path, document: Document) -> str:
    """One file printed in `output_format`, as the command prints it."""
    printed = io.StringIO()
    StdoutDocument(printed, ResponseFormat(output_format), SubtitleOptions(), several=False).write(str(path), document)
    return printed.getvalue()


def test_render_each_format():
    path = Path("talk.wav")
    assert render("text", path, RESULT) == "Ask not.\n"
    assert json.loads(render("json", path, RESULT)) == json.loads(RESULT.render(ResponseFormat.JSON))
    assert render("srt", path, RESULT).startswith("1\n00:00:00,000 --> 00:00:01,000\nAsk\n")
    assert render("vtt", path, RESULT).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nAsk\n")
    verbose = json.loads(render("verbose_json", path, RESULT))  # OpenAI's verbose_json, key for key: no "file"
    assert list(verbose)[:5] == ["task", "language", "duration", "text", "segments"] and "file" not in verbose
    assert verbose == json.loads(RESULT.render(ResponseFormat.VERBOSE_JSON))
    assert (verbose["language"], verbose["segments"][1]["id"]) == ("english", 1)


def test_several_files_print_json_lines_naming_each_file():
    printed = io.StringIO()
    document = StdoutDocument(printed, ResponseFormat.VERBOSE_JSON, SubtitleOptions(), several=True)
    document.write("a.wav", RESULT)
    document.write("b.wav", RESULT)
    lines = [json.loads(line) for line in printed.getvalue().splitlines()]
    assert [line["file"] for line in lines] == ["a.wav", "b.wav"]
    alone = json.loads(RESULT.render(ResponseFormat.VERBOSE_JSON))
    assert all({key: value for key, value in line.items() if key != "file"} == alone for line in lines)


def test_serve_flags_have_the_documented_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.http_port, args.grpc_port, args.metrics_port, args.log_verbose) == (8000, 8001, 8002, 0)
    assert args.model_repository is None and args.checkpoint is None
    assert (args.trace_file, args.trace_rate) == (None, 1000)  # no trace unless asked; then Triton's own rate


def test_a_trace_rate_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--trace-file", "t.json", "--trace-rate", "0"])
    assert "expected a whole number of at least 1; got '0'" in capsys.readouterr().err


def test_an_unreachable_server_stops_the_command_with_one_line(tmp_path, capsys):
    from whisper_triton.cli import main

    clip = tmp_path / "a.wav"
    clip.write_bytes(b"RIFF")
    status = main(["transcribe", str(clip), str(clip), "--url=localhost:9"])  # nothing listens on the discard port
    assert status == 1
    err = capsys.readouterr().err
    assert err == (
        "whisper-triton transcribe: no server answers at http://localhost:9 (connection refused): is it running? "
        "Start it with `whisper-triton serve`, or give the address it prints\n"
    )


def test_version_and_examples(capsys):
    for argv in (["--version"], ["transcribe", "--version"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert re.fullmatch(r"whisper-triton \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["transcribe", "--help"])
    help_text = capsys.readouterr().out
    assert "Send audio files to a running whisper-triton server" in help_text
    assert "examples:\n  whisper-triton transcribe talk.mp3 " in help_text


@pytest.mark.parametrize(
    ("names", "stems"),
    [
        (["a/talk.wav", "b/talk.mp3", "talk.flac"], ["talk", "talk-2", "talk-3"]),
        (["a/talk.wav", "b/talk.wav", "talk-2.wav"], ["talk", "talk-3", "talk-2"]),  # talk-2 is taken
        (["-", "x/stdin.wav"], ["stdin", "stdin-2"]),
        (["one.wav", "two.wav"], ["one", "two"]),
    ],
)
def test_outputs_never_share_a_name(names, stems):
    assert unique_stems([Input(n) for n in names]) == stems


def test_output_formats():
    assert output_formats("txt") == output_formats("text") == (ResponseFormat.TEXT,)
    assert [EXTENSIONS[f] for f in output_formats("all")] == ["txt", "srt", "vtt", "tsv", "json"]


@pytest.mark.parametrize(
    ("url", "protocol", "expected"),
    [
        (None, None, ServerAddress("localhost:8000", Protocol.HTTP)),
        (None, "grpc", ServerAddress("localhost:8001", Protocol.GRPC)),
        ("localhost:8000", None, ServerAddress("localhost:8000", Protocol.HTTP)),
        ("http://localhost:8000/", "http", ServerAddress("localhost:8000", Protocol.HTTP)),
        ("https://triton.example:443/prefix", None, ServerAddress("triton.example:443/prefix", Protocol.HTTP, tls=True)),
        ("grpc://localhost:8001", None, ServerAddress("localhost:8001", Protocol.GRPC)),
        ("GRPC://localhost:8001", "grpc", ServerAddress("localhost:8001", Protocol.GRPC)),
    ],
)
def test_urls_with_or_without_a_scheme(url, protocol, expected):
    assert parse_address(url, protocol) == expected


@pytest.mark.parametrize(
    ("url", "protocol", "message"),
    [
        ("http://localhost:8001", "grpc", "is an HTTP URL, but this connection speaks gRPC"),
        ("grpc://localhost:8001", "http", "is a gRPC URL, but this connection speaks HTTP"),
        ("ftp://localhost:8001", None, "has the scheme 'ftp'"),
        ("http://", None, "names no host"),
        ("grpc://localhost:8001/v2", None, "without a path"),
    ],
)
def test_urls_of_another_protocol_are_refused(url, protocol, message):
    with pytest.raises(AddressError, match=re.escape(message)):
        parse_address(url, protocol)


def test_tritons_ensemble_prefix_is_dropped():
    assert triton_message("in ensemble 'transcribe', audio is 3601.0 s long") == "audio is 3601.0 s long"
    assert triton_message("server overloaded") == "server overloaded"


def test_a_server_that_went_away_mid_request_is_named_so():
    """An HTTP request whose server died (no answer, and nothing listens there any more)
    was diagnosed as "likely Triton's gRPC port"; it is the server that went away. Where
    something still listens without speaking HTTP/1.1 (gRPC's port), that diagnosis stands."""
    import http.client
    import socket

    from clients.connection import connection_failure

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free again once closed: nothing listens there
    gone = connection_failure(ServerAddress(f"127.0.0.1:{port}", Protocol.HTTP, False),
                              http.client.RemoteDisconnected("Remote end closed connection without response"))
    assert "closed the connection without answering and no longer listens: it stopped or crashed" in gone
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = ServerAddress(f"127.0.0.1:{listening.getsockname()[1]}", Protocol.HTTP, False)
        other = connection_failure(address, http.client.RemoteDisconnected("Remote end closed connection"))
    assert "did not answer in HTTP" in other
