"""`bench.cpu`'s JSON as Markdown and a plot: the side-by-side table, the ratios, where the CPU time went.

    python -m bench.cpu_report docs/benchmarks/cpu.json [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference import normalize

FASTER_WHISPER = ("faster-whisper", "faster-whisper batched")
SERVED = ("served", "served int8")  # float32, as shipped, and `--quantize int8`


@dataclass(frozen=True)
class Summary:
    """One system's measured repetitions."""

    system: str
    setting: str
    rtfx: list[float]
    wall_s: list[float]
    cpu_s: list[float]
    wer: list[float]
    load: list[float]
    records: list[dict]

    @classmethod
    def of(cls, records: list[dict]) -> Summary:
        first = records[0]
        return cls(
            first["system"], first["setting"], [r["rtfx"] for r in records], [r["wall_s"] for r in records],
            [r["cpu_s"] for r in records], [r["wer"] for r in records],
            [x for r in records for x in (r["load_before"], r["load_after"])], records,
        )  # fmt: skip

    @property
    def median_rtfx(self) -> float:
        return statistics.median(self.rtfx)

    def row(self, audio_s: float) -> list[str]:
        cpu = statistics.median(self.cpu_s)
        return [
            f"**{self.system}**", self.setting, f"**{self.median_rtfx:.2f}**",
            f"{min(self.rtfx):.2f}–{max(self.rtfx):.2f}", f"{statistics.median(self.wall_s):.1f}",
            f"{cpu:.1f}", f"{cpu / audio_s:.3f}", f"{statistics.median(self.wer):.1%}",
            f"{min(self.load):.1f}–{max(self.load):.1f}",
        ]  # fmt: skip


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows])


def summaries(records: list[dict]) -> list[Summary]:
    systems: dict[str, list[dict]] = {}
    for record in records:
        systems.setdefault(record["system"], []).append(record)
    return [Summary.of(group) for group in systems.values()]


def ratio(found: list[Summary], system: str = "served") -> tuple[float, Summary, Summary] | None:
    """A served system's median RTFx over the best faster-whisper median, and the two summaries."""
    served = next((s for s in found if s.system == system), None)
    rivals = [s for s in found if s.system in FASTER_WHISPER]
    if served is None or not rivals:
        return None
    best = max(rivals, key=lambda s: s.median_rtfx)
    return served.median_rtfx / best.median_rtfx, served, best


def agreement(found: list[Summary]) -> list[str]:
    """Clips whose normalised words differ between served and the other systems (first repetition)."""
    served = next((s for s in found if s.system == "served"), None)
    if served is None:
        return []
    lines = []
    for other in found:
        if other is served:
            continue
        ours, theirs = served.records[0]["texts"], other.records[0]["texts"]
        differ = [f for f in ours if normalize(ours[f]) != normalize(theirs.get(f, ""))]
        lines.append(f"- served and {other.system}: the same words on {len(ours) - len(differ)} of {len(ours)} clips"
                     + (f"; they differ on {', '.join(differ)}" if differ else ""))  # fmt: skip
        for f in differ:
            lines.append(f"  - {f}: served «{ours[f]}» / {other.system} «{theirs.get(f, '')}»")
    return lines


def process_split(served: Summary) -> str:
    names = sorted({k for r in served.records for k in r["cpu_by_process"]})
    rows = [[name, f"{statistics.median(r['cpu_by_process'].get(name, 0.0) for r in served.records):.2f}"]
            for name in names]  # fmt: skip
    return table(["process", "CPU s per measurement (median)"], rows)


def cpu_name(machine: dict) -> str:
    """The CPU with its family, model and AVX-512 where the record has them (records before
    `bench.cpu.cpu_identity` name only what /proc/cpuinfo's model name says)."""
    if machine.get("cpu_family") is None:
        return machine["cpu"]
    avx = ", AVX-512" if machine.get("avx512") else ", no AVX-512"
    return f"{machine['cpu']} (family {machine['cpu_family']}, model {machine['cpu_model']}{avx})"


def render(data: dict) -> str:
    audio = data["audio_s_per_round"] * data["rounds"]
    found = summaries(data["measurements"])
    machine = data["machine"]
    out = [
        "# CPU: served tiny.en, float32 and int8, against faster-whisper int8",
        "",
        f"{data['date']}, commit `{data['commit'][:12]}`{' (uncommitted changes)' if data['dirty'] else ''}, "
        f"{cpu_name(machine)}, {machine['cores']} cores; torch {machine.get('torch')}, ctranslate2 "
        f"{machine.get('ctranslate2')}, faster-whisper {machine.get('faster-whisper')}.",
        "",
        f"Command: `{data['command']}`. {len(data['clips'])} recordings of tests/data/audio "
        f"({data['audio_s_per_round']:.1f} s of audio), sent {data['rounds']} times per measurement as WAV files; "
        f"systems take turns, {data['repeats']} repetitions each (median, and the range). "
        "CPU is the CPU time of every process that did the work (for served: the client and all of the server's).",
        "",
    ]
    if data.get("server_changes"):
        out += [f"Served with these changes to the shipped settings: {', '.join(data['server_changes'])}.", ""]
    for system in SERVED:
        outcome = ratio(found, system)
        if outcome:
            value, served, best = outcome
            out += [f"**{system.capitalize()} / faster-whisper best ({best.system}, {best.setting}): {value:.2f}** "
                    f"(RTFx {served.median_rtfx:.2f} / {best.median_rtfx:.2f}).", ""]  # fmt: skip
    headers = ["system", "setting", "RTFx", "RTFx range", "wall s", "CPU s", "CPU s per audio s", "WER", "load avg"]
    out += [table(headers, [s.row(audio) for s in found]), "", "![RTFx of each system](cpu.png)", ""]
    out += ["Decoding: " + "; ".join(f"{k}: {v}" for k, v in data["decoding"].items()) + ".", ""]
    out += ["## Do the transcripts agree?", "", *agreement(found), ""]
    for served in (s for s in found if s.system in SERVED):
        out += [f"## {served.system.capitalize()}: CPU time by process", "", process_split(served), ""]
    out += ["## faster-whisper settings tried (one round each)", "",
            table(["system", "setting", "RTFx", "CPU s", "load avg"],
                  [[r["system"], r["setting"], r["rtfx"], round(r["cpu_s"], 1), r["load_before"]]
                   for r in data["tuning"]]), ""]  # fmt: skip
    return "\n".join(out)


def plot(data: dict, path: Path) -> None:
    """Each system's median RTFx as a bar, its repetitions' range as the error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = summaries(data["measurements"])
    medians = [s.median_rtfx for s in found]
    spread = [[m - min(s.rtfx) for s, m in zip(found, medians)], [max(s.rtfx) - m for s, m in zip(found, medians)]]
    fig, axes = plt.subplots(figsize=(9, 4.2))
    bars = axes.bar([s.system for s in found], medians, yerr=spread, capsize=6,
                    color=["tab:blue" if s.system in SERVED else "tab:gray" for s in found])  # fmt: skip
    axes.bar_label(bars, labels=[f"{m:.1f}" for m in medians], label_type="center", color="white")
    axes.set_ylabel("RTFx (audio s / wall s), median and range")
    machine = data["machine"]
    axes.set_title(f"tiny.en on {cpu_name(machine)}, {machine['cores']} cores, commit {data['commit'][:7]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(data: dict, out: Path) -> None:
    (out / "cpu.md").write_text(render(data))
    plot(data, out / "cpu.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    write_report(json.loads(args.results.read_text()), args.out or args.results.parent)


if __name__ == "__main__":
    main()
