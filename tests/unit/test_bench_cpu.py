"""bench.cpu's arithmetic: word errors over the clips, the served / faster-whisper ratios and its report."""

from __future__ import annotations

from reference import Clip

from bench.cpu import Measurement, corpus_errors, cpu_identity
from bench.cpu_report import cpu_name, ratio, render, summaries, write_report

REFERENCES = {
    "a.wav": Clip("a.wav", 2.0, "ten of clubs"),
    "b.wav": Clip("b.wav", 3.0, "go forward ten meters"),
}


def test_word_errors_are_summed_over_clips_after_normalisation():
    # "10" is spelled out and punctuation dropped before comparing; b has one substitution.
    texts = {"a.wav": "10 of clubs.", "b.wav": "Go forward two meters"}
    assert corpus_errors(texts, REFERENCES) == (1, 7)


def _record(system: str, repeat: int, wall_s: float) -> dict:
    measurement = Measurement(
        system=system, setting=f"{system} setting", repeat=repeat, audio_s=100.0, wall_s=wall_s, cpu_s=wall_s * 1.5,
        load_before=0.5, load_after=0.7, texts={"a.wav": "ten of clubs", "b.wav": "go forward ten meters"},
    )  # fmt: skip
    return measurement.record(REFERENCES)


def test_the_ratio_is_served_median_over_the_best_faster_whisper_median():
    records = [
        *(_record("served", i, wall) for i, wall in enumerate((10.0, 20.0, 12.5))),  # RTFx 10, 5, 8: median 8
        *(_record("served int8", i, wall) for i, wall in enumerate((5.0, 4.0, 5.0))),  # 20, 25, 20: median 20
        *(_record("faster-whisper", i, wall) for i, wall in enumerate((5.0, 6.25, 8.0))),  # 20, 16, 12.5: median 16
        *(_record("faster-whisper batched", i, wall) for i, wall in enumerate((10.0, 10.0, 10.0))),  # 10
    ]
    value, served, best = ratio(summaries(records))
    assert (served.median_rtfx, best.system, best.median_rtfx) == (8.0, "faster-whisper", 16.0)
    assert value == 0.5
    assert ratio(summaries(records), "served int8")[0] == 1.25
    data = {
        "date": "2026-01-01 00:00", "commit": "0123456789abcdef", "dirty": False, "command": "python -m bench.cpu",
        "machine": {"cpu": "test CPU", "cores": 2}, "clips": [{"file": "a.wav"}, {"file": "b.wav"}],
        "audio_s_per_round": 50.0, "rounds": 2, "repeats": 3, "decoding": {"served": "greedy"},
        "measurements": records, "tuning": [],
    }  # fmt: skip
    report = render(data)
    assert "Served / faster-whisper best (faster-whisper, faster-whisper setting): 0.50" in report
    assert "Served int8 / faster-whisper best (faster-whisper, faster-whisper setting): 1.25" in report
    assert "## Served int8: CPU time by process" in report
    assert "the same words on 2 of 2 clips" in report


def test_the_report_is_written_with_its_plot(tmp_path):
    records = [_record(system, 0, 10.0) for system in ("served", "faster-whisper")]
    data = {
        "date": "2026-01-01 00:00", "commit": "0123456789abcdef", "dirty": False, "command": "python -m bench.cpu",
        "machine": {"cpu": "test CPU", "cores": 2}, "clips": [{"file": "a.wav"}], "audio_s_per_round": 50.0,
        "rounds": 2, "repeats": 1, "decoding": {}, "measurements": records, "tuning": [],
    }  # fmt: skip
    write_report(data, tmp_path)
    assert "![RTFx of each system](cpu.png)" in (tmp_path / "cpu.md").read_text()
    assert (tmp_path / "cpu.png").read_bytes().startswith(b"\x89PNG")


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 avx512f avx512bw

processor\t: 1
cpu family\t: 25
model\t\t: 1
model name\t: another
flags\t\t: fpu sse2
"""


def test_the_machine_is_named_by_its_first_processor_with_family_model_and_avx512():
    """A virtual machine's model name says only "AMD EPYC": the family, model and AVX-512
    tell two generations apart in a record and its report."""
    identity = cpu_identity(CPUINFO)
    assert identity == {"cpu": "AMD EPYC", "cpu_family": "26", "cpu_model": "2", "avx512": True}
    assert cpu_name({**identity, "cores": 2}) == "AMD EPYC (family 26, model 2, AVX-512)"
    assert cpu_identity(CPUINFO.replace(" avx512f", ""))["avx512"] is False
    assert cpu_name({"cpu": "AMD EPYC", "cores": 2}) == "AMD EPYC"  # a record made before
