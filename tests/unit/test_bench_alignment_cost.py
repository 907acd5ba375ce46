"""`bench.alignment_cost` on the CPU: it finds every round of word alignments a
transcription runs, counts the operations of the first of each size, and leaves the
library's aligner as it was."""

from __future__ import annotations

import json

from bench import alignment_cost
from python_backend_lib.transcription import alignment


def test_rounds_of_one_window_and_of_several_are_timed_and_counted(tmp_path):
    shipped = alignment.Aligner.align_many
    assert alignment_cost.main(["--repeats", "2", "--together", "3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "alignment-cost.json").read_text())
    rows = data["summary"]
    # jfk.wav is one window: two transcriptions alone, then two of three copies at once.
    assert sum(row["windows"] * row["calls"] for row in rows) == 2 + 2 * 3
    alone, largest = rows[0], rows[-1]
    assert alone["windows"] == 1 and alone["calls"] >= 2 and alone["operations"] > 50
    assert largest["windows"] > 1 and largest["operations"] < largest["windows"] * alone["operations"]
    assert alignment.Aligner.align_many is shipped
