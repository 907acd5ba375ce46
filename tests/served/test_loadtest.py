"""The load test: clips, names and runner checked without a server, then short real runs.

Locust patches the standard library for gevent when imported, so it never runs
inside pytest: the runs are `python -m loadtest.run` subprocesses.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import AUDIO_DIR, RunningServer

REPO_ROOT = Path(__file__).resolve().parents[2]
# loadtest/ is a folder of the checkout, not part of the installed package.
sys.path.insert(0, str(REPO_ROOT))

from loadtest import run  # noqa: E402
from loadtest.clips import Clip, RequestStats, Summary, load_clips, request_name  # noqa: E402

RUN_TIMEOUT_S = 240  # the runs below last 4 s and 15 s, plus locust's start and the requests in flight


def clip(duration_s: float, transcript: str = "some words") -> Clip:
    return Clip(name="x.wav", audio=b"", duration_s=duration_s, transcript=transcript)


def test_every_manifest_clip_loads_shortest_first():
    clips = load_clips(AUDIO_DIR)
    assert {c.name for c in clips} == {p.name for p in AUDIO_DIR.glob("*.wav")}
    assert [c.duration_s for c in clips] == sorted(c.duration_s for c in clips)
    assert all(c.is_speech and c.audio.startswith(b"RIFF") for c in clips)


def test_long_clips_can_be_left_out():
    clips = load_clips(AUDIO_DIR, max_duration_s=5.0)
    assert clips and all(c.duration_s <= 5.0 for c in clips)
    assert "jfk.wav" not in {c.name for c in clips}


def test_a_manifest_naming_a_missing_file_is_refused(tmp_path):
    (tmp_path / "manifest.tsv").write_text("file\tduration_s\ttranscript\ngone.wav\t1.0\thello\n")
    with pytest.raises(ValueError, match="gone.wav"):
        load_clips(tmp_path)


def test_no_clip_short_enough_is_refused():
    with pytest.raises(ValueError, match="at most 0.5 s"):
        load_clips(AUDIO_DIR, max_duration_s=0.5)


@pytest.mark.parametrize(
    ("duration_s", "name"),
    [
        (1.1, "transcribe <5s"),
        (4.99, "transcribe <5s"),
        (5.0, "transcribe 5-30s"),
        (30.0, "transcribe 5-30s"),
        (53.27, "transcribe >30s"),
    ],
)
def test_requests_are_named_by_clip_length(duration_s, name):
    assert request_name(clip(duration_s)) == name


def test_only_clips_with_a_transcript_must_come_back_with_text():
    assert clip(2.0).is_speech
    assert not clip(2.0, transcript="  ").is_speech


def test_a_summary_survives_json():
    row = RequestStats("grpc", "transcribe <5s", 12, 1, 830.0, 1400.0, 2.5)
    total = RequestStats("", "Aggregated", 12, 1, 830.0, 1400.0, 2.5)
    summary = Summary(rows=(row,), total=total, errors=("1 x grpc transcribe <5s: boom",))
    assert Summary.from_json(summary.to_json()) == summary
    assert len(summary.table()) == 3


def test_the_runner_is_headless_bounded_and_fails_on_any_error():
    args = run.parse_args(["--users", "3", "--run-time", "7s", "--protocols", "http", "--csv-prefix", "out/x"])
    command = run.locust_command(args)
    assert "--headless" in command
    assert command[command.index("--run-time") + 1] == "7s"
    assert command[command.index("--exit-code-on-error") + 1] == "1"
    assert command[command.index("--csv") + 1] == "out/x"
    assert command[command.index("--html") + 1] == "out/x.html"
    assert command[-1] == "HttpTranscribeUser" and "GrpcTranscribeUser" not in command


@pytest.mark.parametrize("argv", [["--protocols", "ftp"], ["--protocols", ","], ["--users", "0"]])
def test_the_runner_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit):
        run.parse_args(argv)


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def run_loadtest(prefix: Path, *arguments: str) -> tuple[subprocess.CompletedProcess, Summary | None]:
    completed = subprocess.run(
        [sys.executable, "-m", "loadtest.run", "--csv-prefix", str(prefix), *arguments],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    summary_json = Path(f"{prefix}_summary.json")
    summary = Summary.from_json(summary_json.read_text()) if summary_json.is_file() else None
    return completed, summary


@pytest.mark.slow
def test_a_run_against_no_server_fails(tmp_path):
    completed, summary = run_loadtest(
        tmp_path / "none",
        f"--http-url=localhost:{closed_port()}",
        f"--grpc-url=localhost:{closed_port()}",
        "--users=2",
        "--spawn-rate=2",
        "--run-time=4s",
    )
    assert completed.returncode != 0, completed.stdout[-3000:]
    failed = completed.stderr.strip().splitlines()[-1]  # the last line says why
    assert failed.startswith(f"loadtest: FAILED: {summary.total.failures} of {summary.total.requests} requests failed; "
                             "first error: "), failed
    assert "Connection refused" in failed or "failed to connect" in failed, failed
    assert summary is not None and summary.total.requests > 0
    assert summary.total.failures == summary.total.requests
    assert summary.errors


@pytest.mark.server
@pytest.mark.slow
def test_a_short_run_against_the_server_passes(server: RunningServer, tmp_path):
    prefix = tmp_path / "loadtest"
    completed, summary = run_loadtest(
        prefix,
        f"--http-url=http://{server.http_url}",  # the forms the serve banner prints
        f"--grpc-url=grpc://{server.grpc_url}",
        "--users=4",
        "--spawn-rate=4",
        "--run-time=15s",
        "--max-clip-seconds=30",
        f"--record={tmp_path / 'record'}",
    )
    output = completed.stdout[-4000:] + completed.stderr[-4000:]
    assert completed.returncode == 0, output
    assert summary is not None, output
    assert summary.total.failures == 0 and not summary.errors, output
    for protocol in ("grpc", "http"):
        sent = sum(row.requests for row in summary.rows if row.request_type == protocol)
        assert sent > 0, f"no {protocol} request completed:\n{output}"
    assert Path(f"{prefix}_stats.csv").is_file() and Path(f"{prefix}.html").is_file()
    # The record keeps the figures with where they come from.
    stored = json.loads((tmp_path / "record.json").read_text())
    assert Summary.from_json(json.dumps({k: stored[k] for k in ("rows", "total", "errors")})) == summary
    assert stored["settings"]["users"] == 4
    origin = stored["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}", origin["commit"])
    assert origin["machine"]["cpu_count"] >= 1 and origin["machine"]["cpu"]
    assert origin["command"].startswith("python -m loadtest.run ")
    page = (tmp_path / "record.md").read_text()
    assert origin["commit"][:12] in page and f"| Aggregated | {summary.total.requests} | 0 |" in page


@pytest.mark.server
@pytest.mark.slow
def test_a_short_live_run_against_the_gateway_passes(gateway: str, tmp_path):
    """Live users stream clips to the gateway's Realtime sessions and commit each turn."""
    prefix = tmp_path / "live"
    completed, summary = run_loadtest(
        prefix, "--protocols=live", f"--gateway-url={gateway}", "--users=2", "--spawn-rate=2", "--run-time=20s",
        "--max-clip-seconds=12",
    )  # fmt: skip
    output = completed.stdout[-4000:] + completed.stderr[-4000:]
    assert completed.returncode == 0, output
    assert summary is not None and summary.total.failures == 0 and not summary.errors, output
    rows = {row.name: row for row in summary.rows}
    assert {row.request_type for row in summary.rows} == {"live"}, output
    assert set(rows) <= {"live first delta", "live completed"}, output
    assert rows["live completed"].requests >= 2, output


def test_without_locust_the_run_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(run.importlib.util, "find_spec", lambda name: None if name == "locust" else object())
    assert run.main(["--run-time=1s"]) == run.EXIT_ON_FAILURE
    assert capsys.readouterr().err == (
        "loadtest: locust is not installed; install the load-test extra: pip install -e '.[loadtest]'\n"
    )


def test_urls_of_the_other_protocol_are_refused(capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--grpc-url=http://localhost:8001"])
    assert "--grpc-url: 'http://localhost:8001' is an HTTP URL" in capsys.readouterr().err
    assert run.parse_args(["--http-url=http://localhost:8000/"]).http_url == "localhost:8000"


@pytest.mark.server
@pytest.mark.slow
def test_a_live_run_brings_the_gateways_key(server: RunningServer, tmp_path):
    """Against a gateway that asks for an API key, the live users send it (from
    WHISPER_TRITON_API_KEY, or --api-key); without it every turn fails, saying why."""
    import os

    from test_gateway import start_gateway

    from gateway.api_key import API_KEY_ENV

    key = "sk-live-load"
    process, base_url = start_gateway(server.grpc_url, tmp_path, [f"--api-key={key}"])
    common = ("--protocols=live", f"--gateway-url={base_url}", "--users=1", "--spawn-rate=1", "--max-clip-seconds=6")
    try:
        keyed, summary = run_loadtest(tmp_path / "keyed", *common, "--run-time=10s", f"--api-key={key}")
        output = keyed.stdout[-3000:] + keyed.stderr[-3000:]
        assert keyed.returncode == 0 and summary is not None and summary.total.failures == 0, output
        assert {row.name: row for row in summary.rows}["live completed"].requests >= 1, output
        environ = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        # Refused at its first turn: a short run says so as well as a long one.
        unkeyed = subprocess.run([sys.executable, "-m", "loadtest.run", "--csv-prefix", str(tmp_path / "unkeyed"),
                                  *common, "--run-time=3s"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                                 env=environ)
        assert unkeyed.returncode != 0 and "no API key given" in unkeyed.stdout + unkeyed.stderr, unkeyed.stderr[-3000:]
    finally:
        process.terminate()
        process.wait(timeout=60)
