"""`bench.alignment_cost` on the CPU: it finds every word alignment a transcription runs,
counts the operations of the first, and leaves the library's aligner as it was."""

from __future__ import annotations

import json

from bench import alignment_cost
from python_backend_lib.transcription import alignment


def test_each_alignment_of_a_transcription_is_timed_and_the_first_counted(tmp_path):
    shipped = alignment.Aligner.align
    assert alignment_cost.main(["--repeats", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "alignment-cost.json").read_text())
    # jfk.wav is one window: one alignment a transcription.
    assert data["alignments"] == 2 and data["checkpoint"] == "default" and data["clip"] == "jfk.wav"
    first, second = data["calls"]
    assert first["operations"] > 50 and second["operations"] is None  # a decoder pass and more
    assert 0 < second["ms"] and data["ms_median_unprofiled"] == second["ms"]
    assert alignment.Aligner.align is shipped
