"""The soak's verdict (`loadtest.soak.SoakReport.problems`): what it must find wrong in
a report, each rule failing on the report it guards. The figures are the CPU soak's
hours (docs/benchmarks/soak-hour.json)."""

from __future__ import annotations

import dataclasses

from loadtest.soak import JUDGED_MODELS, RSS_TOLERANCE_MIB, Snapshot, SoakReport

BEFORE = Snapshot(in_flight=0, running=0, waiting=0, healthy=2, ready=True, counters={},
                  rss_mib={"postprocessing": 271.4, "preprocessing": 1323.3, "whisper": 1149.2, "whisper_stream": 1003.4})


def report(**after_rss: float) -> SoakReport:
    after = dataclasses.replace(BEFORE, rss_mib={**BEFORE.rss_mib, **after_rss})
    return SoakReport(seconds=600.0, warmup_seconds=30.0, concurrency=6, seed=11, counts={}, warmup_counts={},
                      details={}, unexpected=[], before=BEFORE, after=after, rss_timeline_mib=[])  # fmt: skip


def test_a_soak_whose_judged_stubs_keep_their_memory_passes():
    assert report(whisper=1149.2 + RSS_TOLERANCE_MIB, preprocessing=1323.3 + 8).problems() == []
    assert report(postprocessing=271.4 + 500).problems() == []  # not judged: it holds no large blocks


def test_each_judged_model_that_keeps_more_than_the_tolerance_fails_the_soak():
    assert set(JUDGED_MODELS) == {"whisper", "preprocessing"}
    (problem,) = report(whisper=1149.2 + 186.8).problems()  # the second hour
    assert problem == f"the whisper stubs grew 187 MiB (tolerance {RSS_TOLERANCE_MIB:g})"
    (problem,) = report(preprocessing=1323.3 + 219.3).problems()  # its four instances, the same hour
    assert problem == f"the preprocessing stubs grew 219 MiB (tolerance {RSS_TOLERANCE_MIB:g})"
    assert len(report(whisper=2000.0, preprocessing=2000.0).problems()) == 2


def test_a_report_says_what_else_went_wrong():
    unwell = dataclasses.replace(report(), unexpected=["short: a wrong transcript"])
    unwell = dataclasses.replace(unwell, after=dataclasses.replace(unwell.after, in_flight=1, healthy=1, ready=False))
    problems = unwell.problems()
    assert problems[0] == "unexpected: short: a wrong transcript"
    assert problems[1].startswith("left in the whisper model: 1 requests")
    assert problems[2] == "server not well: engine healthy 1, ready False"
