"""The served benchmark's pure pieces: statistics, transcript checks, forced lengths, host readings,
provenance, carrying files in parts, the stand-in repository and the report."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bench import served_report
from bench.carry import gather, split
from bench.host import CpuTimes, ServerProcesses, busy_cores, parse_proc_stat, process_cpu_seconds
from bench.jobs import MAX_FORCED_TOKENS, Job, forced_jobs, forced_tokens, real_jobs
from bench.load import first_clip, split_slots
from bench.server_process import ServeCommand
from bench.standin import CANNED_NAME, STANDIN_SOURCE, canned_check, canned_verbose_json, write_standin_repository
from bench.stats import BAD_TRANSCRIPT, OK, Outcome, PointStats, saturation, summarize, sweep_done
from bench.transcripts import REQUEST_PARAMETERS, TranscriptCheck, judge, judge_json, text_tokens
from loadtest.provenance import blob_id, commit_info, stamped_commit_info, write_stamp
from python_backend_lib.apps.server import packaged_model_repository
from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.contract.parameters import parse_request_parameters

EOT = 50256


# ------------------------------------------------------------------ statistics


def test_a_point_counts_completions_in_its_window_and_latency_of_requests_sent_in_it():
    durations = [2.0, 4.0]
    outcomes = [
        Outcome(0, sent=9.0, done=10.5, status=OK, tokens=5),  # sent in warm-up, done inside: throughput only
        Outcome(1, sent=10.5, done=11.0, status=OK, tokens=10),
        Outcome(0, sent=11.0, done=11.2, status=OK, tokens=6, fallback=True),
        Outcome(1, sent=11.2, done=11.3, status="UNAVAILABLE"),
        Outcome(0, sent=11.5, done=12.5, status=OK, tokens=7),  # done after the window: latency only
        Outcome(1, sent=12.6, done=12.7, status=OK, tokens=8),  # after the window: not counted
    ]
    stats = summarize(outcomes, durations, window=(10.0, 12.0), concurrency=2)
    assert stats.sent == 4
    assert stats.answered_per_s == 2.0  # 4 completions in 2 s
    assert stats.goodput_per_s == 1.5
    assert stats.rtfx == (2.0 + 4.0 + 2.0) / 2.0
    assert stats.statuses == {OK: 3, "UNAVAILABLE": 1}
    latencies_ms = np.array([0.5, 0.2, 1.0]) * 1e3
    assert stats.latency_ms["p50"] == pytest.approx(np.percentile(latencies_ms, 50))
    assert stats.latency_ms["p99"] == pytest.approx(np.percentile(latencies_ms, 99))
    assert stats.mean_tokens == pytest.approx((10 + 6 + 7) / 3, abs=0.01)
    assert stats.tokens_per_audio_s == pytest.approx(23 / 8.0, abs=1e-3)
    assert stats.fallbacks == 1 and not stats.failed


def test_one_bad_transcript_fails_the_point():
    outcomes = [Outcome(0, 1.0, 1.1, OK, 3), Outcome(0, 1.2, 1.3, BAD_TRANSCRIPT, 0)]
    stats = summarize(outcomes, [1.0], (0.0, 2.0), 1, problems=["clip: empty text"])
    assert stats.failed and stats.goodput_per_s == 0.5 and stats.problems == ["clip: empty text"]
    assert stats.to_dict()["failed"] is True


def point(concurrency: int, goodput: float, failed: bool = False) -> PointStats:
    statuses = {OK: 10, **({BAD_TRANSCRIPT: 1} if failed else {})}
    return PointStats(concurrency, 8.0, 11, goodput, goodput, goodput * 5, {}, statuses, 10.0, 3.0, 0, 0)


def test_saturation_is_the_first_concurrency_within_5_percent_of_the_best():
    sweep = [point(1, 100), point(2, 190), point(4, 350), point(8, 600), point(16, 800), point(32, 900),
             point(64, 950), point(128, 960)]
    found = saturation(sweep)
    assert found.concurrency == 64 and found.best_goodput_per_s == 960
    assert found.overload_concurrency == 128 and found.overload_share == pytest.approx(960 / 950, abs=1e-3)
    assert found.graceful
    assert sweep_done(sweep, min_top=64)
    assert not sweep_done(sweep[:-1], min_top=64)  # 64 is not yet twice the saturating 64
    assert not sweep_done(sweep, min_top=256)
    failed_at_twice = sweep[:-1] + [point(128, 960, failed=True)]
    assert not sweep_done(failed_at_twice, min_top=64)  # a failed point is measured again further on
    assert sweep_done(failed_at_twice + [point(256, 955)], min_top=64)


def test_overload_that_loses_goodput_is_not_graceful_and_failed_points_do_not_count():
    found = saturation([point(1, 100), point(2, 200), point(4, 150), point(8, 5000, failed=True)])
    assert found.concurrency == 2 and found.overload_share == 0.75 and found.graceful is False


def test_the_time_is_split_between_the_phases_asked_for_by_their_shares():
    from bench.served import Settings, phase_budgets

    budgets = phase_budgets(["ceiling", "served", "engine", "transformers"], Settings(), 500.0)
    assert sum(budgets.values()) == pytest.approx(500.0) and budgets["served"] > budgets["ceiling"]
    alone = phase_budgets(["engine", "transformers"], Settings(), 300.0)
    assert alone == pytest.approx({"engine": 300 * 0.13 / 0.35, "transformers": 300 * 0.22 / 0.35})


@pytest.mark.parametrize("concurrency, processes, expected", [
    (1, 4, [(0, 1)]), (6, 4, [(0, 2), (2, 2), (4, 1), (5, 1)]), (512, 4, [(0, 128), (128, 128), (256, 128), (384, 128)]),
])
def test_slots_are_spread_evenly_over_the_client_processes(concurrency, processes, expected):
    assert split_slots(concurrency, processes) == expected


@pytest.mark.parametrize("concurrency", [1, 7, 64, 96, 200, 2048])
def test_in_a_short_window_every_clip_is_sent_about_equally_often(concurrency):
    """Each slot sends the clips after its first in turn; after n requests a slot, the counts per clip
    differ by at most one round of the starts' spacing, whatever the concurrency."""
    clips, per_slot = 96, 9
    counts = [0] * clips
    for slot in range(concurrency):
        for k in range(per_slot):
            counts[(first_clip(slot, concurrency, clips) + k) % clips] += 1
    expected = concurrency * per_slot / clips
    assert max(counts) - min(counts) <= max(1.0, expected / per_slot) + 1


# ------------------------------------------------------------------ transcripts and jobs


def verbose(text: str, *token_lists: list[int], temperature: float = 0.0) -> dict:
    return {"text": text, "segments": [{"tokens": t, "temperature": temperature} for t in token_lists]}


def test_text_tokens_leave_out_timestamps_and_control_tokens():
    assert text_tokens(verbose("x", [50364, 11, 12, 50400], [50400, 13, 50500]), EOT) == 3


@pytest.mark.parametrize("record, check, problem", [
    (verbose("hello there", [11, 12]), TranscriptCheck(EOT, 1.0), None),
    (verbose("  ", [11]), TranscriptCheck(EOT, 1.0), "empty text"),
    (verbose("x", []), TranscriptCheck(EOT, 1.0), "0 text tokens for 1 s (plausible: 1 to 20)"),
    (verbose("x", list(range(21))), TranscriptCheck(EOT, 1.0), "21 text tokens for 1 s (plausible: 1 to 20)"),
    (verbose("x", [1, 2, 3]), TranscriptCheck(EOT, 1.0, expected_tokens=3), None),
    (verbose("x", [1, 2]), TranscriptCheck(EOT, 1.0, expected_tokens=3), "2 text tokens, 3 forced"),
])
def test_a_transcript_must_be_non_empty_and_of_a_plausible_or_the_forced_length(record, check, problem):
    assert judge(record, check).problem == problem


def test_a_sampled_window_that_loops_is_the_models_answer_but_a_greedy_loop_is_not():
    looping = list(range(53))  # 53 text tokens for 1.5 s, as tiny.en sampled on the H100
    sampled = judge(verbose("o o o", looping, temperature=1.0), TranscriptCheck(EOT, 1.5))
    assert sampled.ok and sampled.long_sample and sampled.fallback
    greedy = judge(verbose("o o o", looping), TranscriptCheck(EOT, 1.5))
    assert greedy.problem == "53 text tokens for 1.5 s (plausible: 1 to 25)" and not greedy.long_sample
    assert judge(verbose(" ", [], temperature=1.0), TranscriptCheck(EOT, 1.5)).problem == "empty text"
    outcomes = [Outcome(0, 1.0, 1.1, OK, 53, True, True), Outcome(0, 1.2, 1.3, OK, 3)]
    assert summarize(outcomes, [1.5], (0.0, 2.0), 1).long_samples == 1


def test_a_sampled_answer_is_compared_for_equality_but_never_judged_wrong_by_its_words():
    check = TranscriptCheck(EOT, 2.0, reference="the quick brown fox")
    equal = judge(verbose("the quick brown fox", [1, 2, 3, 4], temperature=0.2), check)
    assert equal.exact is True and equal.differs is None
    sampled = judge(verbose("a slow red hen", [1, 2, 3, 4], temperature=0.2), check)
    assert sampled.ok and sampled.exact is False  # the seeded draw followed a moved logit
    assert sampled.differs == "a slow red hen"
    greedy = judge(verbose("a slow red hen", [1, 2, 3, 4]), check)
    assert greedy.problem.startswith("word error rate 1.00") and greedy.exact is False
    outcomes = [Outcome(0, 1.0, 1.1, OK, 4, True, exact=True),
                Outcome(0, 1.1, 1.2, OK, 4, True, exact=False, differs="a slow red hen"),
                Outcome(0, 1.2, 1.3, OK, 4, exact=True), Outcome(1, 1.2, 1.3, OK, 4, exact=False, differs="b"),
                Outcome(1, 1.3, 1.4, OK, 4, exact=False, differs="c"), Outcome(1, 1.4, 1.5, OK, 4, exact=False, differs="c")]
    point = summarize(outcomes, [2.0, 2.0], (0.0, 2.0), 1)
    assert (point.compared, point.exact, point.compared_sampled, point.exact_sampled) == (6, 2, 2, 1)
    assert point.differing == {0: 1, 1: 3}
    assert point.differing_texts == {0: {"a slow red hen": 1}, 1: {"c": 2, "b": 1}}  # the clip's readings, likeliest first


def test_fallback_and_broken_documents_are_reported():
    assert judge(verbose("a", [1], temperature=0.2), TranscriptCheck(EOT, 1.0)).fallback
    assert judge_json(b"{not json", TranscriptCheck(EOT, 1.0)).problem.startswith("not verbose_json")


def test_forced_lengths_follow_the_clip_length_within_whispers_positions():
    assert forced_tokens(5.48, 3.2) == 18
    assert forced_tokens(0.1, 3.2) == 1
    assert forced_tokens(200.0, 3.2) == MAX_FORCED_TOKENS


def test_jobs_ask_what_the_server_parses_into_the_librarys_options():
    from bench.clips import load_clips

    clip = load_clips()[0]
    real, = real_jobs([clip], EOT)
    assert real.parameters == REQUEST_PARAMETERS and real.check.expected_tokens is None
    assert real.options == parse_request_parameters(REQUEST_PARAMETERS).transcription
    assert real.options.decoding.timestamps  # the shipped default
    forced, = forced_jobs([clip], EOT, 3.0)
    n = forced_tokens(clip.clip.duration_s, 3.0)
    options = forced.options
    assert options.decoding.min_new_tokens == options.decoding.max_new_tokens == n == forced.check.expected_tokens
    assert options.temperatures == (0.0,) and not options.decoding.timestamps
    assert forced.load_request().wav == clip.wav


def test_added_parameters_reach_every_request_and_its_reference_options():
    """`bench.served --parameter`: beam search for every request, and the library's
    reference transcript decoded with it too (`bench.references` reads `Job.options`)."""
    from bench.clips import load_clips
    from bench.served import parse_args

    args = parse_args(["--model", "tiny", "--out", "/tmp/x", "--parameter", "beam_size=5", "--parameter", "best_of=5",
                       "--parameter", "long_form=batched"])
    assert args.parameters == {"beam_size": 5, "best_of": 5, "long_form": "batched"}
    job, = real_jobs(load_clips()[:1], EOT, args.parameters)
    assert job.parameters == {**REQUEST_PARAMETERS, **args.parameters}
    assert (job.options.decoding.beam_size, job.options.decoding.best_of) == (5, 5)
    for bad in (["--model", "tiny", "--parameter", "beam_size=99"], ["--model", "large-v3", "--parameter", "beam_size=5"],
                ["--model", "tiny", "--parameter", "beam_size"]):
        with pytest.raises(SystemExit):
            parse_args([*bad, "--out", "/tmp/x"])


# ------------------------------------------------------------------ host readings


def test_cpu_busy_cores_from_proc_stat():
    before = parse_proc_stat("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n")
    after = parse_proc_stat("cpu  400 0 150 1000 50 0 0 0 0 0\n")
    assert before == CpuTimes(busy=150, total=1000)
    assert busy_cores(before, after, cores=16) == pytest.approx(16 * 400 / 600, abs=0.01)
    assert busy_cores(None, after, 16) is None
    with pytest.raises(ValueError):
        parse_proc_stat("intr 1 2 3\n")


def test_a_server_process_cpu_time_becomes_cores_by_role():
    spent = sum(i * i for i in range(200_000))  # some CPU time of this process's own
    assert spent and process_cpu_seconds(os.getpid()) > 0
    assert process_cpu_seconds(2**31 - 1) is None  # no such process
    processes = ServerProcesses({"whisper": (11, 12), "tritonserver": (13,), "gone": (14,)})
    before = {11: 10.0, 12: 5.0, 13: 1.0, 14: None}
    after = {11: 12.0, 12: 5.5, 13: 1.5, 14: None}
    assert processes.busy(before, after, 2.0) == {
        "whisper": {"processes": 2, "cores": 1.25, "busiest": 1.0},
        "tritonserver": {"processes": 1, "cores": 0.25, "busiest": 0.25},
    }


# ------------------------------------------------------------------ provenance


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def commit_all(repo: Path, message: str) -> None:
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)


def repository(tmp_path: Path, files: dict[str, str]) -> Path:
    """A new repository under tmp_path holding `files` (path: text) in its first commit."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    commit_all(repo, "first")
    return repo


def test_a_blob_id_is_what_git_gives_the_content(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"some content\n\x00binary")
    assert blob_id(path.read_bytes()) == git(tmp_path, "hash-object", str(path))


def test_the_stamp_tells_a_clean_copy_from_a_changed_one(tmp_path):
    repo = repository(tmp_path, {"a.py": "a = 1\n", "sub/b.txt": "b\n"})
    stamp = write_stamp(repo, tmp_path / "stamp.json")
    assert stamp == json.loads((tmp_path / "stamp.json").read_text())
    assert stamp["commit"] == git(repo, "rev-parse", "HEAD")
    copy = tmp_path / "copy"  # what a device machine gets: the files, no .git
    copy.mkdir()
    (copy / "sub").mkdir()
    (copy / "a.py").write_text("a = 1\n")
    (copy / "sub" / "b.txt").write_text("b\n")
    (copy / "untracked.log").write_text("ignored\n")
    info = stamped_commit_info(stamp, copy)
    assert (info.commit, info.dirty, info.changed) == (stamp["commit"], False, ())
    (copy / "a.py").write_text("a = 2\n")
    (copy / "sub" / "b.txt").unlink()
    info = stamped_commit_info(stamp, copy)
    assert info.dirty and info.changed == ("a.py", "sub/b.txt") and info.checked_by == "stamp"


def test_a_stamp_outranks_a_repository_whose_head_is_another_commit(tmp_path):
    """A device copy once held the repository of an earlier copy: its HEAD named a
    commit that was not the one carried. The stamp, written for the carried tree, wins."""
    repo = repository(tmp_path, {"a.py": "a = 1\n"})
    old_head = git(repo, "rev-parse", "HEAD")
    (repo / "a.py").write_text("a = 2\n")
    commit_all(repo, "second")
    stamp_path = tmp_path / "stamp.json"
    stamp = write_stamp(repo, stamp_path)
    git(repo, "reset", "-q", "--soft", old_head)  # the stale repository: HEAD is the first commit
    info = commit_info(repo, stamp_path)
    assert (info.commit, info.dirty, info.checked_by) == (stamp["commit"], False, "stamp")
    assert info.commit != old_head


def test_a_stamp_of_an_earlier_commit_gives_way_to_a_clean_repository(tmp_path):
    """A stamp written before the last commit finds the tree changed; git, at the commit
    the tree is, finds it clean and names it."""
    repo = repository(tmp_path, {"a.py": "a = 1\n"})
    stamp_path = tmp_path / "stamp.json"
    stamp = write_stamp(repo, stamp_path)
    (repo / "a.py").write_text("a = 2\n")
    commit_all(repo, "second")
    info = commit_info(repo, stamp_path)
    assert (info.commit, info.dirty, info.checked_by) == (git(repo, "rev-parse", "HEAD"), False, "git")
    assert info.commit != stamp["commit"]
    (repo / "a.py").write_text("a = 3\n")  # changed since both: the stamp's answer, naming the file
    info = commit_info(repo, stamp_path)
    assert (info.commit, info.dirty, info.checked_by, info.changed) == (stamp["commit"], True, "stamp", ("a.py",))


# ------------------------------------------------------------------ carrying a file in parts


def test_a_file_split_in_parts_is_joined_only_when_every_part_is_there(tmp_path):
    original = tmp_path / "weights.whl"
    original.write_bytes(np.random.default_rng(0).bytes(1_000_003))
    manifest = split(original, 3, tmp_path / "carry")
    assert [len((tmp_path / "carry" / str(i) / n).read_bytes()) for i, n in enumerate(manifest.parts, 1)] == [
        333_335, 333_335, 333_333]
    stash = tmp_path / "stash"
    assert gather(tmp_path / "carry" / "1", stash) is None
    assert gather(tmp_path / "carry" / "3", stash) is None
    joined = gather(tmp_path / "carry" / "2", stash)
    assert joined == stash / "weights.whl" and joined.read_bytes() == original.read_bytes()


def test_a_damaged_part_is_refused(tmp_path):
    original = tmp_path / "f.bin"
    original.write_bytes(b"0123456789")
    manifest = split(original, 2, tmp_path / "carry")
    (tmp_path / "carry" / "2" / manifest.parts[1]).write_bytes(b"xxxxx")
    with pytest.raises(ValueError, match="damaged"):
        gather(tmp_path / "carry" / "2", tmp_path / "stash")


# ------------------------------------------------------------------ the stand-in repository


def test_the_stand_in_repository_differs_from_the_packaged_one_only_in_whisper(tmp_path):
    source = packaged_model_repository()
    built = write_standin_repository(tmp_path / "ceiling")
    theirs = {p.relative_to(source) for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    ours = {p.relative_to(built) for p in built.rglob("*") if p.is_file()}
    model = Path("whisper", "1", "model.py")
    assert ours == theirs | {Path("whisper", "1", CANNED_NAME)}
    for name in theirs - {model}:
        assert (built / name).read_bytes() == (source / name).read_bytes(), name
    assert (built / model).read_bytes() == STANDIN_SOURCE.read_bytes()


def test_the_canned_transcript_is_a_real_verbose_json_of_realistic_length():
    record = canned_verbose_json()
    check = canned_check(EOT)
    assert judge(record, check).ok
    assert 3 <= check.duration_s <= 8 and check.expected_tokens >= 10  # a sentence, near the mean clip
    assert record["text"].strip() and record["segments"][0]["avg_logprob"] > -1


def test_random_weights_are_served_with_every_non_text_token_suppressed():
    from python_backend_lib.checkpoints.served_random import text_only

    checkpoint = load_checkpoint("random:tiny:0")
    special = checkpoint.config.special
    suppressed = set(text_only(checkpoint).config.suppress_tokens)
    assert special.eot not in suppressed and special.eot - 1 not in suppressed
    assert set(range(special.eot + 1, checkpoint.config.dims.n_vocab)) <= suppressed
    assert {special.no_timestamps, special.timestamp_begin, special.sot} <= suppressed


# ------------------------------------------------------------------ the report


def sweep_section(goodputs: dict[int, float], failed_at: int | None = None) -> dict:
    points = []
    for concurrency, goodput in goodputs.items():
        failed = concurrency == failed_at
        points.append({**point(concurrency, goodput, failed).to_dict(), "client_processes": 1,
                       "client_cpu_cores": 0.1, "host_busy_cores": 3.0, "gpu_utilisation_pct": 50.0,
                       "gpu_memory_used_gib": 5.0,
                       "latency_ms": {"p50": 10.0, "p90": 12.0, "p99": 20.0, "mean": 11.0},
                       "models": {"whisper": {"queue_ms": 1.0, "execute_ms": 0.5}}})
    stats = [point(c, g, c == failed_at) for c, g in goodputs.items()]
    from dataclasses import asdict

    return {"run": 0, "points": points, "saturation": asdict(saturation(stats)),
            "server": {"command": "whisper-triton serve", "name": "triton", "version": "2.51.0", "ready_s": 9.0}}


def results_fixture(commits: tuple[str, ...] = ("abc",)) -> dict:
    runs = [{"id": i, "model": "tiny", "phases": ["served"], "quick": False, "commit": c, "dirty": False,
             "changed": [], "checked_by": "stamp", "date": "2026-11-23", "command": "python -m bench.served",
             "machine": {"gpu": "H100", "gpu_memory_gib": 79.6, "cpu_count": 16, "driver": "580", "torch": "2.11",
                         "python": "3.12"}} for i, c in enumerate(commits)]
    served = sweep_section({1: 100.0, 2: 150.0, 4: 200.0, 8: 150.0})
    served["latency_5s"] = {**served["points"][0], "clip": {"duration_s": 4.96}}
    tiny = {
        "source": "default", "random_weights": False, "tokens_per_audio_s": 3.1,
        "clips": [{"name": "c", "recording": "r.wav", "start_s": 0.0, "end_s": 4.96, "duration_s": 4.96,
                   "forced_tokens": None}],
        "ceiling": sweep_section({1: 500.0, 2: 1100.0, 4: 1200.0, 8: 1210.0}),
        "served": served,
        "engine": {"rtfx": 1500.0, "requests_per_s": 300.0, "mean_tokens": 17.0, "requests": 1024, "slots": 256,
                   "failed": False},
        "transformers": {"transformers": "5.17", "dtype": "float16", "attention": "sdpa", "decoding": "greedy",
                         "feature_extraction": "WhisperFeatureExtractor(device='cuda')",
                         "rows": [{"batch": 1, "rtfx": 100.0, "generate_rtfx": 120.0, "requests_per_s": 20.0,
                                   "mean_tokens": 17.0},
                                  {"batch": 2, "rtfx": 180.0, "generate_rtfx": 230.0, "requests_per_s": 36.0,
                                   "mean_tokens": 17.0},
                                  {"batch": 4, "error": "out of memory: CUDA"}],
                         "best": {"batch": 2, "rtfx": 180.0}, "best_generate": {"batch": 2, "rtfx": 230.0}},
    }
    return {"runs": runs, "models": {"tiny": tiny}}


def target_rows(data: dict) -> dict[str, list]:
    return {row[0]: row for row in served_report.targets(data)}


def test_the_targets_are_read_from_the_saturated_point_and_the_best_transformers_batch():
    rows = target_rows(results_fixture())
    assert rows["tiny served RTFx at saturation"][2:] == ["1000.0 (concurrency 4)", "missed"]
    assert rows["tiny served / engine alone (RTFx)"][2:] == ["0.667 (1000.0 / 1500.0)", "met"]
    assert rows["tiny served / transformers' best (feature extraction included)"][2:] == [
        "5.556 (1000.0 / 180.0 at batch 2)", "met"]
    assert rows["tiny p50, ~5 s clip, concurrency 1"][2:] == ["10.0 ms (4.96 s clip)", "met"]
    assert rows["tiny: goodput at 2x saturation / at saturation"][2:] == ["0.75 (concurrency 8 vs 4)", "missed"]
    assert rows["tiny: ceiling (stand-in whisper), best requests/s"][2:] == [1210.0, "met"]
    assert rows["large-v3 served / engine alone (RTFx)"][2:] == [None, "not measured"]


def test_a_failed_point_or_phase_never_counts():
    data = results_fixture()
    data["models"]["tiny"]["served"] = sweep_section({1: 100.0, 2: 150.0, 4: 200.0, 8: 5000.0}, failed_at=8)
    data["models"]["tiny"]["engine"] = {"error": "RuntimeError: boom"}
    rows = target_rows(data)
    assert rows["tiny served RTFx at saturation"][2] == "1000.0 (concurrency 4)"
    assert rows["tiny served / engine alone (RTFx)"][3] == "not measured"
    text = served_report.markdown(data)
    assert "FAILED" in text and "failed: RuntimeError: boom" in text


def test_the_report_names_its_runs_and_says_when_they_are_not_one(tmp_path):
    text = served_report.markdown(results_fixture())
    assert "All rows come from one commit on one machine." in text
    assert "`python -m bench.served`" in text and "H100 (79.6 GiB), 16 CPUs" in text
    assert "not one run" in served_report.markdown(results_fixture(("abc", "def")))
    assert "Quick run" not in text
    quick = results_fixture()
    quick["runs"][0]["quick"] = True
    assert "These are not figures to quote." in served_report.markdown(quick)
    path = tmp_path / "served.json"
    path.write_text(json.dumps(results_fixture()))
    served_report.write(path, tmp_path)
    assert (tmp_path / "served.md").read_text() == text
    assert (tmp_path / "served.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_served_command_names_the_gpus_when_asked():
    from bench.server_process import ServeCommand

    assert "--gpus=0,1" in ServeCommand("default", gpus="0,1").argv()
    assert not any(a.startswith("--gpus") for a in ServeCommand("default").argv())


def test_other_instance_groups_are_served_from_a_copy_that_differs_only_there(tmp_path):
    from bench.repository_copy import Instances, instance_group, repository_with_instances
    from bench.served import parse_args

    args = parse_args(["--model", "tiny", "--out", str(tmp_path), "--instances", "preprocessing=2",
                       "--instances", "whisper=2:cpu"])  # fmt: skip
    assert args.instances == {"preprocessing": Instances(2), "whisper": Instances(2, "cpu")}
    copy = repository_with_instances(args.instances, tmp_path / "repository")
    packaged = packaged_model_repository()
    changed = {
        "preprocessing": lambda text: text.replace("    count: 4\n", "    count: 2\n"),
        "whisper": lambda text: text.replace("    count: 1\n    kind: KIND_AUTO\n", "    count: 2\n    kind: KIND_CPU\n"),
    }
    for config in sorted(packaged.glob("*/config.pbtxt")):
        change = changed.get(config.parent.name, lambda text: text)
        assert (copy / config.relative_to(packaged)).read_text() == change(config.read_text())
    whisper = (copy / "whisper" / "config.pbtxt").read_text()
    assert "count: 2" in whisper and "kind: KIND_CPU" in whisper
    for bad in ("preprocessing", "preprocessing=0", "=4", "preprocessing=four", "whisper=1:tpu"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"MODEL=COUNT\[:KIND\]"):
            instance_group(bad)
    with pytest.raises(SystemExit):
        parse_args(["--model", "tiny", "--out", str(tmp_path), "--instances", "whisper=x"])


def test_the_ceiling_comparison_reports_each_stored_runs_best_point_and_instances(tmp_path):
    from bench.ceiling_compare import load_variant, main

    stored = sorted((Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "ceiling").glob("*.json"))
    assert len(stored) >= 2
    main([*map(str, stored), "--out", str(tmp_path)])
    report = (tmp_path / "ceiling.md").read_text()
    assert (tmp_path / "ceiling.png").stat().st_size > 0
    for path in stored:
        data = json.loads(path.read_text())
        (model,) = data["models"].values()
        best = max(model["ceiling"]["points"], key=lambda p: p["goodput_per_s"])
        variant = load_variant(path)
        row = next(line for line in report.splitlines() if line.startswith(f"| {path.stem} |"))
        assert f"| {best['goodput_per_s']} | {best['concurrency']} |" in row
        assert data["runs"][0]["commit"][:10] in row and variant.instances in row
    with pytest.raises(ValueError, match="no ceiling sweep"):
        broken = tmp_path / "broken.json"
        broken.write_text(json.dumps({"runs": [{}], "models": {"tiny": {"ceiling": {"error": "boom"}}}}))
        load_variant(broken)


def test_a_scaling_sweep_runs_two_points_past_its_peak():
    from bench.gpu_scaling import past_peak

    def points(*goodputs, failed=()):
        return [PointStats(concurrency=2**i, window_s=1.0, sent=1, answered_per_s=g, goodput_per_s=g, rtfx=g,
                           latency_ms={}, statuses={BAD_TRANSCRIPT: 1} if i in failed else {OK: 1},
                           mean_tokens=None, tokens_per_audio_s=None, fallbacks=0, long_samples=0)
                for i, g in enumerate(goodputs)]

    assert not past_peak(points(1, 2, 3))
    assert not past_peak(points(1, 3, 2))  # one point past the peak: it may still rise
    assert past_peak(points(1, 3, 2, 2.5))
    assert not past_peak(points(1, 3, 2, 9, failed=(3,)))  # a failed point does not count
    assert not past_peak([])


def test_a_variant_may_serve_under_mps():
    from bench.served_variants import parse_variant

    variant = parse_variant("shared=mps:on,preprocessing:2")
    assert variant.mps and variant.instances and variant.checkout is None
    assert "--mps=on" in ServeCommand(None, mps=variant.mps).argv()
    assert "--mps=off" in ServeCommand(None, mps=parse_variant("alone=mps:off").mps).argv()
    assert not any(a.startswith("--mps") for a in ServeCommand(None).argv())  # the launcher's auto
    with pytest.raises(argparse.ArgumentTypeError, match="bad --variant"):
        parse_variant("shared=mps:yes")


def test_a_variant_may_run_the_encoder_attention_through_another_kernel(tmp_path, monkeypatch):
    import bench.served_variants as served_variants
    from python_backend_lib.apps.repository import config_parameter

    monkeypatch.setattr(served_variants, "STATE_DIR", tmp_path)
    variant = served_variants.parse_variant("fa3=encoder_attention:flashinfer,quantize:fp8")
    assert variant.whisper_parameters == {"encoder_attention": "flashinfer"} and variant.quantize == "fp8"
    repository = served_variants.repository_for(variant)
    assert config_parameter((repository / "whisper" / "config.pbtxt").read_text(), "encoder_attention") == "flashinfer"
    assert served_variants.repository_for(served_variants.parse_variant("shipped=quantize:fp8")) is None
    words = served_variants.parse_variant("words=word_timestamps:on,checkout:.before")
    assert words.request_parameters == {"word_timestamps": True} and words.checkout is not None
    job = Job(None, {"language": "en"}, None)
    assert [j.parameters for j in words.jobs([job])] == [{"language": "en", "word_timestamps": True}]
    assert variant.jobs([job]) == [job]
    for bad in ("fa3=encoder_attention:fa3", "mixed=checkout:.before,encoder_attention:flashinfer",
                "words=word_timestamps:yes"):
        with pytest.raises(argparse.ArgumentTypeError, match="bad --variant"):
            served_variants.parse_variant(bad)


def test_a_variants_checkout_is_recorded_with_its_commit_or_as_a_folder(tmp_path):
    """A checkout without its COMMIT file is named by its folder in the record and in
    bench.large_models' table, never taken for the commit the call ran."""
    from bench.large_models import served_rows
    from bench.server_process import checkout_record

    assert checkout_record(None) == {}
    assert checkout_record(tmp_path) == {"checkout": str(tmp_path)}
    (tmp_path / "COMMIT").write_text("d47b745113238838d0934e2214e1941a701c1010\n")
    assert checkout_record(tmp_path) == {"checkout": str(tmp_path), "checkout_commit": "d47b745113238838d0934e2214e1941a701c1010"}
    point = {"rtfx": 1400.0, "goodput_per_s": 260.0, "concurrency": 256, "failed": False}
    alone = {"latency_ms": {"p50": 22.0, "p99": 24.0}}
    variants = [{"label": "before", "checkout": ".before", "points": [point], "latency_5s": alone},
                {"label": "after", "points": [point], "latency_5s": alone}]
    rows = served_rows([{"model": "large-v3-turbo", "run": {"commit": "c78af0d" + "0" * 33}, "variants": variants}])
    assert [row[2] for row in rows] == [".before", "c78af0d"]


def test_the_large_models_record_lists_passes_larger_than_the_engines_beside_its_own():
    from bench.large_models import PROFILED_BATCH, larger_pass_rows

    def run(*batches: int) -> dict:
        sizes = [{"batch": b, "ms_per_pass": 4.0 * b, "ms_per_window": 4.0, "tflops": 600.0} for b in batches]
        return {"model": "large-v3", "variant": "fp8", "sizes": sizes}

    assert larger_pass_rows({"as captured": {"runs": [run(1, PROFILED_BATCH)]}}) == []
    rows = larger_pass_rows({"larger": {"runs": [run(1, PROFILED_BATCH, 2 * PROFILED_BATCH)]}})
    assert [row[3] for row in rows] == [PROFILED_BATCH, 2 * PROFILED_BATCH]


def test_a_servers_memory_is_read_by_role():
    """This process stands for a server's one role: its proportional set size is what it holds."""
    from bench.host import process_memory_gib

    mine = process_memory_gib(os.getpid())
    assert mine is not None and 0.01 < mine < 64
    roles = ServerProcesses({"tritonserver": (os.getpid(),), "gone": (2**22 + 7,)})
    memory = roles.memory_gib()
    assert memory.keys() == {"tritonserver"} and abs(memory["tritonserver"] - mine) < 0.05  # a gone process: no entry


def test_a_quiet_servers_statistics_agree_once_every_model_counted_the_last_request():
    from bench.triton_stats import agree, stats_delta

    def reading(**requests: int) -> dict:
        return {name: {"requests": n, "failures": 0, "executions": n, "queue_ns": 0, "compute_ns": 0}
                for name, n in requests.items()}

    settled = reading(transcribe=9, preprocessing=9, whisper=9, postprocessing=9, whisper_stream=0)
    # The client has its answer; postprocessing and the ensemble count the request a moment later.
    counting = reading(transcribe=8, preprocessing=9, whisper=9, postprocessing=8, whisper_stream=0)
    assert agree(settled) and not agree(counting) and agree({})
    # A window read from the early reading counts the request before it among its own.
    after = reading(transcribe=13, preprocessing=13, whisper=13, postprocessing=13)
    assert stats_delta(counting, after)["transcribe"]["requests"] == 5
    assert {m["requests"] for m in stats_delta(settled, after).values()} == {4}


def test_a_held_busy_encoder_is_summarised_by_its_phases_and_named_clock_limits():
    """bench.encoder_sustained's row, as the large-models record shows it: the median pass
    alone, of the first and the last tenth back to back, and nvidia-smi's limit reasons named
    by their bits, each with its share of the samples."""
    from bench.encoder_sustained import SUMMARY_HEADER, limits, summary_row
    from bench.large_models import sustained_section

    run = {
        "model": "large-v3-turbo", "batch": 16, "alone_ms": [52.0, 53.0, 51.0],
        "alone_gpu": {"sm_clock_mhz": {"median": 1980.0}, "power_w": {"max": 300.0}, "limit_reasons": {}},
        "sustained_ms": [54.0, 55.0] + [57.0] * 16 + [58.0, 59.0],
        "sustained_gpu": {"sm_clock_mhz": {"median": 1680.0}, "power_w": {"median": 691.0},
                          "limit_reasons": {"0x0000000000000004": 9, "0x0000000000000000": 1}},
        "profiled": {"replays": [{"busy_ms": 56.0, "span_ms": 57.0}, {"busy_ms": 56.5, "span_ms": 57.2},
                                 {"busy_ms": 55.0, "span_ms": 56.0}]},
    }
    row = dict(zip(SUMMARY_HEADER, summary_row(run)))
    assert row["ms a pass alone"] == 52.0
    assert row["ms a pass, first tenth back to back"] == 54.5 and row["ms a pass, last tenth"] == 58.5
    assert row["clock limited by"] == "the power cap (90%), none (10%)"
    assert row["kernels busy / span of a profiled replay, ms"] == "56.00 / 57.00"
    assert limits({"0x0000000000000084": 3, "0x0000000000000040": 1}) == (
        "the power cap and the power brake (75%), hardware heat (25%)")
    record = {"provenance": {"machine": {"gpu": "NVIDIA H200", "cpu_count": 16, "cpu": "Xeon", "torch": "2.11"},
                             "command": "python -m bench.encoder_sustained --out X"}, "run": run}
    section = "\n".join(sustained_section({"537b1c2": record}))
    assert "| 537b1c2 | large-v3-turbo | 16 | 52.0 | 1980.0 | 54.5 | 58.5 | 1680.0 | 691.0 |" in section
