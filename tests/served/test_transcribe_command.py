"""`whisper-triton transcribe` as a person runs it: a subprocess against the real server."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import subprocess
import time

import pytest
from conftest import AUDIO_DIR, free_port, whisper_triton_command

pytestmark = pytest.mark.server

JFK = AUDIO_DIR / "jfk.wav"
CARDS = AUDIO_DIR / "cards_005.wav"
SONNET = AUDIO_DIR / "sonnet1_longform.wav"
TIMEOUT_S = 300


def transcribe(*argv, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        whisper_triton_command() + ["transcribe", *map(str, argv)],
        input=stdin, capture_output=True, timeout=TIMEOUT_S, stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def ok(*argv, stdin: bytes | None = None) -> str:
    completed = transcribe(*argv, stdin=stdin)
    assert completed.returncode == 0, completed.stderr.decode()
    return completed.stdout.decode()


def srt_cues(document: str) -> list[tuple[int, str, str]]:
    """(number, times, text) of each cue; fails on anything that is not SubRip."""
    cues = []
    for block in document.strip("\n").split("\n\n"):
        number, times, *lines = block.split("\n")
        assert re.fullmatch(r"\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}", times), block
        assert lines, block
        cues.append((int(number), times, "\n".join(lines)))
    return cues


def test_output_dir_writes_every_format_and_never_overwrites_a_shared_stem(server, tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    first, second = tmp_path / "a" / "talk.wav", tmp_path / "b" / "talk.wav"
    shutil.copy(JFK, first), shutil.copy(CARDS, second)
    out = tmp_path / "out"
    reported = ok(first, second, "--url", server.http_url, "-f", "all", "-o", out)
    extensions = ("txt", "srt", "vtt", "tsv", "json")
    assert reported.splitlines() == [f"{source} -> {out / stem}.{ext}"
                                     for source, stem in ((first, "talk"), (second, "talk-2")) for ext in extensions]
    for source, stem in ((first, "talk"), (second, "talk-2")):
        for ext, fmt in zip(extensions, ("text", "srt", "vtt", "tsv", "json")):
            alone = ok(source, "--url", server.http_url, "-f", fmt)
            written = (out / f"{stem}.{ext}").read_text()
            assert written == alone  # one file's JSON on stdout is the server's, without a "file" key
    assert (out / "talk.tsv").read_text().startswith("start\tend\ttext\n0\t")
    assert "country" in (out / "talk.txt").read_text() and "spades" in (out / "talk-2.txt").read_text()


def test_several_files_to_stdout_make_one_valid_srt(server):
    both = srt_cues(ok(JFK, CARDS, "--url", server.http_url, "--format", "srt"))
    alone = [srt_cues(ok(clip, "--url", server.http_url, "--format", "srt")) for clip in (JFK, CARDS)]
    assert [number for number, _, _ in both] == list(range(1, len(both) + 1))
    assert [(times, text) for _, times, text in both] == [(t, x) for cues in alone for _, t, x in cues]


def test_several_files_to_stdout_make_one_webvtt_and_one_table(server):
    vtt = ok(JFK, CARDS, "--url", server.http_url, "-f", "vtt")
    assert vtt.startswith(f"WEBVTT\n\nNOTE {JFK}\n\n00:00:00.000 --> ") and vtt.count("WEBVTT") == 1
    assert f"\n\nNOTE {CARDS}\n\n00:00:" in vtt
    rows = [line.split("\t") for line in ok(JFK, CARDS, "--url", server.http_url, "-f", "tsv").splitlines()]
    assert rows[0] == ["file", "start", "end", "text"] and {r[0] for r in rows[1:]} == {str(JFK), str(CARDS)}


def test_word_timestamps_change_the_subtitles(server):
    plain = srt_cues(ok(JFK, "--url", server.http_url, "-f", "srt"))
    timed = srt_cues(ok(JFK, "--url", server.http_url, "-f", "srt", "--word-timestamps"))
    assert [t for _, t, _ in timed] != [t for _, t, _ in plain]  # cues run from first to last word
    assert timed[0][1] != "00:00:00,000 --> 00:00:08,000" and timed[0][1].startswith("00:00:00,")
    lines = srt_cues(ok(JFK, "--url", server.http_url, "-f", "srt", "--word-timestamps",
                        "--max-line-width", "20", "--max-line-count", "2"))
    assert len(lines) > len(timed)
    assert all(len(text.split("\n")) <= 2 and all(len(line) <= 20 for line in text.split("\n")) for _, _, text in lines)
    words = " ".join(text.replace("\n", " ") for _, _, text in lines)
    assert words == " ".join(text.replace("\n", " ") for _, _, text in timed)
    highlighted = srt_cues(ok(JFK, "--url", server.http_url, "-f", "srt", "--word-timestamps", "--highlight-words"))
    underlined = [text for _, _, text in highlighted if "<u>" in text]
    assert len(underlined) == len(words.split()) and all(text.count("<u>") == 1 for text in underlined)


def test_standard_input_is_read_for_a_dash(server, tmp_path):
    assert ok("-", "--url", server.http_url, stdin=JFK.read_bytes()) == ok(JFK, "--url", server.http_url)
    ok("-", "--url", server.http_url, "-f", "srt", "-o", tmp_path, stdin=JFK.read_bytes())
    assert (tmp_path / "stdin.srt").read_text() == ok(JFK, "--url", server.http_url, "-f", "srt")


def test_decoding_flags_reach_the_server(server):
    def temperatures(*flags) -> set[float]:
        verbose = json.loads(ok(JFK, "--url", server.url("grpc"), "--protocol", "grpc", "-f", "verbose_json", *flags))
        return {segment["temperature"] for segment in verbose["segments"]}

    assert temperatures() == {0.0}
    assert temperatures("--temperature", "0.5", "--temperature-increment", "0") == {0.5}
    # No window is likely enough for a log-probability threshold of 0: each falls back up to 1.0.
    assert temperatures("--logprob-threshold", "0") == {1.0}
    assert temperatures("--logprob-threshold", "0", "--temperature-increment", "0") == {0.0}
    ok(JFK, "--url", server.http_url, "--no-condition-on-previous-text", "--compression-ratio-threshold", "3",
       "--no-speech-threshold", "0.9")


def test_a_long_file_shows_a_progress_line_on_a_terminal(server):
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        whisper_triton_command() + ["transcribe", str(SONNET), f"--url={server.http_url}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=terminal,
    )
    os.close(terminal)
    seen = b""
    try:
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(controller)
    assert process.wait(timeout=TIMEOUT_S) == 0
    assert "thy self thy foe" in process.stdout.read().decode().lower()
    drawn = seen.decode()
    assert re.search(rf"{re.escape(str(SONNET))}: transcribing 0:53 of audio on the server, 0:0\d so far", drawn), drawn
    assert drawn.endswith("\r\x1b[K")  # erased before the transcript


def test_a_long_file_shows_an_estimate_once_the_server_was_timed(server, tmp_path):
    """The first long file on a server shows the time taken only; it leaves its speed
    behind (in the cache folder), and the next shows a percentage and the time left."""
    environ = {**os.environ, "WHISPER_TRITON_CACHE": str(tmp_path)}
    lines = []
    for _ in range(2):
        controller, terminal = pty.openpty()
        process = subprocess.Popen(
            whisper_triton_command() + ["transcribe", str(SONNET), f"--url={server.http_url}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=terminal, env=environ,
        )
        os.close(terminal)
        seen = b""
        try:
            while chunk := _read_terminal(controller):
                seen += chunk
        finally:
            os.close(controller)
        assert process.wait(timeout=TIMEOUT_S) == 0
        lines.append(seen.decode())
    assert "%" not in lines[0] and "left" not in lines[0]
    assert (tmp_path / "transcribe-speed.json").exists()
    estimate = r"0:53 of audio on the server, 0:0\d so far(, ~\d+% \(estimated\), about 0:\d\d left|, longer than)"
    assert re.search(estimate, lines[1]), lines[1]


def _read_terminal(controller: int) -> bytes:
    try:
        return os.read(controller, 4096)
    except OSError:  # EIO: the process closed the terminal
        return b""


def test_openai_whisper_habits_work(server, tmp_path):
    """openai-whisper's spellings: --output_format all --output_dir DIR, --model NAME
    (one warning: the server's checkpoint transcribes), a language by name."""
    completed = transcribe(JFK, "--url", server.http_url, "--output_format", "all", "--output_dir", tmp_path,
                           "--model", "small", "--language", "English")
    assert completed.returncode == 0, completed.stderr.decode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jfk.json", "jfk.srt", "jfk.tsv", "jfk.txt", "jfk.vtt"]
    assert completed.stderr.decode() == (
        "whisper-triton transcribe: warning: --model small is not applied: the server transcribes with the "
        "checkpoint it was started with (whisper-triton serve --checkpoint NAME chooses it)\n"
    )
    for language in ("english", "en", "EN"):
        assert "country" in ok(JFK, "--url", server.http_url, "--language", language)
    assert "spades" in ok(CARDS, "--url", server.http_url, "--word_timestamps", "--initial_prompt", "Cards.")


def test_one_files_json_is_the_servers_verbose_json(server):
    from clients.api import WhisperClient

    printed = json.loads(ok(JFK, "--url", server.http_url, "-f", "verbose_json"))
    with WhisperClient(server.http_url) as client:
        assert printed == json.loads(client.formatted(JFK, "verbose_json"))
    assert "file" not in printed


def test_the_gateways_port_and_the_metrics_port_are_named(server, gateway):
    """--url at the port of `whisper-triton gateway` or at Triton's metrics port: one
    line naming what answered and the URL to give instead; no traceback."""
    gateway_address = gateway.removeprefix("http://").removesuffix("/v1")
    metrics_address = server.metrics_url.removeprefix("http://").removesuffix("/metrics")
    for url, said in (
        (gateway_address, f"http://{gateway_address} is whisper-triton's OpenAI-compatible gateway"),
        (f"grpc://{gateway_address}", f"grpc://{gateway_address} is whisper-triton's OpenAI-compatible gateway"),
        (metrics_address, f"http://{metrics_address} is Triton's metrics port"),
        (f"grpc://{metrics_address}", f"grpc://{metrics_address} is Triton's metrics port"),
    ):
        completed = transcribe(JFK, JFK, "--url", url)
        stderr = completed.stderr.decode()
        assert completed.returncode == 1 and len(stderr.splitlines()) == 1, stderr
        assert stderr.startswith(f"whisper-triton transcribe: {said}") and "Traceback" not in stderr
        assert "--url 127.0.0.1:8000 (HTTP) or --url grpc://127.0.0.1:8001 (gRPC)" in stderr.replace(
            "localhost", "127.0.0.1"
        )
    assert f"OpenAI clients use the gateway at {gateway}" in transcribe(JFK, "--url", gateway).stderr.decode()


def test_no_progress_line_in_a_pipe(server):
    assert transcribe(SONNET, "--url", server.http_url).stderr == b""


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (("--url", "http://{http}"), 0, ""),
        (("--url", "grpc://{grpc}"), 0, ""),
        (("--url", "{grpc}"), 1, "did not answer in HTTP: it is likely Triton's gRPC port; give its HTTP port"),
        (("--protocol", "grpc", "--url", "{http}"), 1, "closed the gRPC connection: it is likely Triton's HTTP port"),
        (("--url", "localhost:{free}"), 1, "(connection refused): is it running? Start it with `whisper-triton serve`"),
        (("--url", "grpc://localhost:{free}"), 1, "is it running? Start it with `whisper-triton serve`"),
        (("--url", "nosuchhost.invalid:8000"), 1, "cannot reach the server at http://nosuchhost.invalid:8000: "),
        (("--url", "grpc://nosuchhost.invalid:8001"), 1, "cannot reach the server at grpc://nosuchhost.invalid:8001"),
        (("--protocol", "grpc", "--url", "http://{http}"), 2, "is an HTTP URL, but this connection speaks gRPC"),
        (("--url", "{http}", "--language", "de"), 1, f"{JFK}: this checkpoint is English-only"),
        (("--url", "{http}", "--max-line-count", "2", "--word-timestamps"), 2, "--max-line-count needs --max-line-width"),
        (("--url", "{http}", "-f", "all"), 2, "--format all writes several files: give --output-dir"),
        (("--url", "{http}", "--temperature", "3"), 2, "temperature must be a number from 0 to 2"),
    ],
)
def test_every_failure_is_one_line_naming_the_cause(server, argv, status, message):
    ports = {"http": server.http_url, "grpc": server.grpc_url, "free": free_port()}
    started = time.monotonic()
    completed = transcribe(JFK, JFK, *(a.format(**ports) for a in argv))
    stderr = completed.stderr.decode()
    assert completed.returncode == status, stderr
    if status == 0:
        return
    assert stderr.startswith("whisper-triton transcribe: ") and message in stderr
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    # One line; a file the server refused is one line per file, the others go on.
    assert len(lines) == (2 if "English-only" in message else 1), stderr
    assert time.monotonic() - started < 60


def test_a_reader_that_leaves_early_ends_the_command_without_a_traceback(server):
    """`transcribe cards_00*.wav -f json --concurrency 4 | head -c 300`: the pipe closes
    while transcripts are still coming; the command stops as for Ctrl-C (cancelling what
    is in flight), says why on stderr, and exits with the status of a closed pipe."""
    import signal

    files = sorted(AUDIO_DIR.glob("cards_00*.wav")) * 8  # short, and more transcripts than head takes
    command = whisper_triton_command() + ["transcribe", *map(str, files), "-f", "json", "--concurrency", "4",
                                          "--url", server.http_url]
    writer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    first = writer.stdout.read(300)
    writer.stdout.close()  # as head does once it has its bytes
    stderr = writer.stderr.read().decode()
    status = writer.wait(timeout=TIMEOUT_S)
    assert len(first) == 300
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert status == 128 + signal.SIGPIPE, (status, stderr)
    assert "standard output was closed" in stderr, stderr
