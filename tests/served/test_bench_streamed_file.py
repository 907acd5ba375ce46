"""bench.streamed_file against the real server: both paths timed, their transcripts compared,
and the gateway's `stream=True` (a gateway of its own in front) beside them."""

from __future__ import annotations

import json

import pytest

from bench.streamed_file import main


@pytest.mark.server
def test_a_run_times_both_paths_and_finds_the_streamed_transcript_equal(server, tmp_path):
    main(["--triton-grpc", server.grpc_url, "--recordings", "jfk.wav", "--repeats", "1", "--out", str(tmp_path),
          "--gateway"])
    record = json.loads((tmp_path / "streamed-file.json").read_text())
    (times,) = record["files"]
    assert times["recording"] == "jfk.wav" and times["audio_s"] == 11.0 and times["requests"] == 1
    # The first segment cannot come after the stream's final response, which carries the whole
    # transcript: the batch path's own answer, token for token.
    assert 0 < times["first_segment_p50_ms"] <= times["streamed_final_p50_ms"]
    assert times["batch_p50_ms"] > 0 and times["updates"] >= 1 and times["equal"] is True
    # Through the gateway: a delta for each of jfk.wav's two segments, joined to the batch text.
    assert 0 < times["sse_first_delta_p50_ms"] <= times["sse_done_p50_ms"]
    assert times["sse_deltas"] == 2 and times["sse_equal"] is True
    report = (tmp_path / "README.md").read_text()
    assert report.startswith("# A file's streamed transcript") and "| jfk.wav | 11.0 | 1 |" in report
    assert "the openai client's `stream=True`" in report and "| 2 | True |" in report
