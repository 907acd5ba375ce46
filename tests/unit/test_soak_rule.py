"""The soak's verdict (`loadtest.soak_report.SoakReport.problems`): what it must find wrong in
a report, each rule failing on the report it guards. The figures are the CPU soak's
hours (docs/benchmarks/soak-hour.json)."""

from __future__ import annotations

import dataclasses

from loadtest.soak import stretches
from loadtest.soak_report import JUDGED_MODELS, LATE_TOLERANCE_MIB, RSS_TOLERANCE_MIB, Snapshot, SoakReport

BEFORE = Snapshot(in_flight=0, running=0, waiting=0, healthy=2, ready=True, counters={},
                  rss_mib={"postprocessing": 271.4, "preprocessing": 1323.3, "whisper": 1149.2, "whisper_stream": 1003.4})


def settled(**rss: float) -> Snapshot:
    return dataclasses.replace(BEFORE, rss_mib={**BEFORE.rss_mib, **rss})


def report(checkpoints: tuple[tuple[float, Snapshot], ...] = (), **after_rss: float) -> SoakReport:
    return SoakReport(seconds=600.0, warmup_seconds=30.0, concurrency=6, seed=11, counts={}, warmup_counts={},
                      details={}, unexpected=[], before=BEFORE, after=settled(**after_rss), rss_timeline_mib=[],
                      checkpoints=list(checkpoints))  # fmt: skip


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


def test_a_long_soak_settles_between_stretches_of_the_load():
    assert stretches(600.0, None) == [600.0]
    assert stretches(600.0, 600.0) == stretches(600.0, 900.0) == [600.0]
    assert stretches(6000.0, 1200.0) == [1200.0] * 5
    assert stretches(1000.0, 300.0) == [300.0, 300.0, 300.0, 100.0]


def test_memory_that_rises_early_and_then_holds_passes_the_last_stretchs_rule():
    # the shape of the hours: most of the rise in the first stretch, then level
    early = ((300.0, settled(whisper=1149.2 + 60, preprocessing=1323.3 + 5)),)
    passed = report(early, whisper=1149.2 + 60 + LATE_TOLERANCE_MIB, preprocessing=1323.3)
    assert passed.problems() == []
    assert passed.late_growth_mib("whisper") == LATE_TOLERANCE_MIB and report().late_growth_mib("whisper") is None


def test_memory_that_keeps_rising_fails_the_last_stretchs_rule_within_the_whole_runs_tolerance():
    # 25 MiB a stretch: within the whole run's tolerance after two, over the last stretch's
    rising = tuple((300.0 * n, settled(whisper=1149.2 + 25 * n)) for n in (1, 2))
    (problem,) = report(rising, whisper=1149.2 + 25 * 2 + LATE_TOLERANCE_MIB + 1).problems()
    assert problem == f"the whisper stubs grew 65 MiB after 600 s of the soak (tolerance {LATE_TOLERANCE_MIB:g})"
    assert 25 * 2 + LATE_TOLERANCE_MIB + 1 < RSS_TOLERANCE_MIB
    (problem,) = report(rising[:1], preprocessing=1323.3 + 100).problems()
    assert problem.startswith("the preprocessing stubs grew 100 MiB after 300 s of the soak")
    # the whole run's rule still holds beside it
    assert len(report(rising, whisper=1149.2 + 200).problems()) == 2
