"""bench.step_bookkeeping: the per-row bookkeeping of an overlapped step, timed for each row count."""

from __future__ import annotations

import json

from bench import step_bookkeeping


def test_each_call_is_timed_for_each_row_count_and_written(tmp_path):
    out = tmp_path / "bookkeeping.json"
    record = step_bookkeeping.main(["--rows", "1", "3", "--reps", "5", "--out", str(out)])
    assert json.loads(out.read_text()) == record
    assert set(record["us_a_step"]) == {"1", "3"}
    for timed in record["us_a_step"].values():
        assert set(timed) == {"plan", "settle", "save for a rewind"} and all(us > 0 for us in timed.values())


def test_the_saved_states_are_the_rows_before_the_step_in_flight():
    """What the timed checkpoint saves for rows that follow themselves: each row with one
    token fewer in its cache and the token the step in flight fed it pending again."""
    from python_backend_lib.engine.batch import DecodeBatch
    from python_backend_lib.engine.overlap import Launched, mark_launched, plan_step

    rows = step_bookkeeping.steady_rows(2)
    first = plan_step(rows, None, 8, step_bookkeeping.TIMESTAMP_BEGIN)
    mark_launched(first.parts)
    launched = step_bookkeeping.launched_from(Launched, first)
    saved = DecodeBatch.checkpoint(type("Batch", (), {"_in_flight": launched, "rows": rows})())
    assert [(s.row, s.cached, s.pending) for s in saved] == [(r, step_bookkeeping.GENERATED + 1, [5]) for r in rows]
    assert [(r.cached, r.pending) for r in rows] == [(step_bookkeeping.GENERATED + 2, [])] * 2
