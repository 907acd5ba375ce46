"""bench.beam_wer's clip sets and error counting (the run itself is a benchmark, not a test)."""

from __future__ import annotations

from bench.beam_wer import edits, english_clips, english_words, multilingual_clips, plot, report


def test_edits_count_insertions_deletions_and_substitutions():
    assert edits(list("kitten"), list("sitting")) == 3
    assert edits([], ["a"]) == 1 and edits(["a"], []) == 1 and edits(["a", "b"], ["a", "b"]) == 0


def test_the_english_set_is_every_recording_with_its_transcript():
    clips = english_clips()
    assert len(clips) == 15 and all(c.path.exists() and c.reference and c.language == "en" for c in clips)
    assert "sonnet1_longform.wav" in {c.path.name for c in clips}  # long-form decoding is scored too
    assert english_words("29340.") == english_words("two nine three four zero")


def test_the_multilingual_set_takes_so_many_clips_per_language():
    clips = multilingual_clips(per_language=1)
    languages = [c.language for c in clips]
    assert len(languages) == len(set(languages)) >= 4 and "en" not in languages
    assert all(c.path.exists() and c.reference for c in clips)
    names = [c.path.name for c in multilingual_clips(per_language=4)]
    assert len(names) == len(set(names))  # a recording in both folders counts once


def test_the_report_and_plot_show_every_system_of_every_set(tmp_path):
    systems = [{"system": name, "clips": 2, "wer": wer, "cer": wer / 2, "seconds": 1.0, "transcripts": ["a", "b"]}
               for name, wer in (("ours beam_size=5", 0.1), ("faster-whisper beam_size=5", 0.2))]
    record = {"command": "python -m bench.beam_wer", "threads": 2,
              "run": {"commit": "0123456789abcdef", "dirty": False, "date": "today"},
              "sets": [{"set": name, "checkpoint": "default", "systems": systems} for name in ("english", "multilingual")]}
    table = report(record)
    assert table.count("| ours beam_size=5 |") == 2 and "| 0.200 | 0.100 |" in table
    plot(record, tmp_path / "beam-wer.png")
    assert (tmp_path / "beam-wer.png").read_bytes().startswith(b"\x89PNG")
