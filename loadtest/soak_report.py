"""The soak's verdict and its record (loadtest/soak.py runs the load): the server
between loads (`Snapshot`), the memory rules, the report and its markdown.

The rules: no UNEXPECTED outcome, nothing left in the whisper model, the engine
healthy and Triton ready, and the memory the judged stubs keep once settled within
`RSS_TOLERANCE_MIB` of where it was after the warm-up; with settled checkpoints, the
last stretch alone within `LATE_TOLERANCE_MIB`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from loadtest.soak_requests import WEIGHTS, Outcome, Result

# The whisper stub's RSS rises with the most memory its requests held at once, and the
# allocator keeps what they freed until the idle engine gives it back
# (`devices.host_memory.IDLE_RELEASE_S`); the server runs with two malloc arenas
# (`apps.triton_environment.MALLOC_ARENAS`), which hold less of it meanwhile. So memory
# is read with the server settled, after a warm-up of the same load, and may then grow by
# RSS_TOLERANCE_MIB, twice the largest rise seen after the warm-up before either change.
# The measurements: docs/reliability.md. A leak of each request's audio or features, or
# of a slot, grows with the requests (over 1,000 in 10 minutes) and survives the release.
RSS_TOLERANCE_MIB = 128.0
# The models whose stubs the memory rule judges, each model's instances together: both
# give what they freed back once idle (the whisper engine's loop, the preprocessing
# model's `IdleRelease`), so a settled reading is what they keep. postprocessing holds
# no large blocks; whisper_stream's engine idles through the soak.
JUDGED_MODELS = ("whisper", "preprocessing")
# What the judged stubs may grow, settled, over a long soak's last stretch between two
# settled readings (`--settle-every`): half the whole run's tolerance, and about twice the
# largest rise seen under load in the second half of an hour-long run (33 MiB,
# docs/operating.md). A leak of a steady rate grows in every stretch; the native
# memory that rises with the first minutes of the load and then holds, only in the first.
LATE_TOLERANCE_MIB = 64.0


@dataclass(frozen=True)
class Snapshot:
    """The server between loads: what the whisper model holds, its health, its stubs' memory."""

    in_flight: float
    running: float
    waiting: float
    healthy: float
    ready: bool
    rss_mib: dict[str, float]  # by model, its instances' stubs together
    counters: dict[str, float]  # whisper_requests_total by outcome, restarts, failed steps

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.running == 0 and self.waiting == 0



def count(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """kind -> result -> requests."""
    counts: dict[str, dict[str, int]] = {}
    for outcome in outcomes:
        by_result = counts.setdefault(outcome.kind, {})
        by_result[outcome.result.value] = by_result.get(outcome.result.value, 0) + 1
    return dict(sorted(counts.items()))



@dataclass(frozen=True)
class SoakReport:
    seconds: float
    warmup_seconds: float
    concurrency: int
    seed: int
    counts: dict[str, dict[str, int]]  # the soak proper: kind -> result -> requests
    warmup_counts: dict[str, dict[str, int]]
    details: dict[str, int]  # "kind result: detail" -> requests, warm-up included
    unexpected: list[str]  # the first few, in words, warm-up included
    before: Snapshot  # after the warm-up
    after: Snapshot  # once settled
    rss_timeline_mib: list[tuple[float, float]]  # the whisper stub's RSS during the soak proper
    # Settled readings between stretches of the soak proper (`--settle-every`), by the
    # seconds of load before each; none in a soak of one stretch.
    checkpoints: list[tuple[float, Snapshot]] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return sum(sum(by_result.values()) for by_result in self.counts.values())

    def growth_mib(self, model: str) -> float:
        """How much more `model`'s stubs kept settled after the soak than after the warm-up."""
        return self.after.rss_mib.get(model, 0.0) - self.before.rss_mib.get(model, 0.0)

    def late_growth_mib(self, model: str) -> float | None:
        """How much more `model`'s stubs kept settled after the soak than at its last
        checkpoint; None without checkpoints."""
        if not self.checkpoints:
            return None
        return self.after.rss_mib.get(model, 0.0) - self.checkpoints[-1][1].rss_mib.get(model, 0.0)

    def problems(self) -> list[str]:
        """Why the soak failed; empty when it passed."""
        problems = [f"unexpected: {line}" for line in self.unexpected]
        if not self.after.idle:
            problems.append(f"left in the whisper model: {self.after.in_flight:g} requests, "
                            f"{self.after.running:g} windows decoding, {self.after.waiting:g} waiting")  # fmt: skip
        # whisper_engine_healthy is 1 per healthy engine (whisper's and whisper_stream's): all still healthy
        if self.after.healthy < self.before.healthy or not self.after.ready:
            problems.append(f"server not well: engine healthy {self.after.healthy:g}, ready {self.after.ready}")
        for model in JUDGED_MODELS:
            if self.growth_mib(model) > RSS_TOLERANCE_MIB:
                problems.append(f"the {model} stubs grew {self.growth_mib(model):.0f} MiB "
                                f"(tolerance {RSS_TOLERANCE_MIB:g})")  # fmt: skip
            late = self.late_growth_mib(model)
            if late is not None and late > LATE_TOLERANCE_MIB:
                problems.append(f"the {model} stubs grew {late:.0f} MiB after {self.checkpoints[-1][0]:.0f} s "
                                f"of the soak (tolerance {LATE_TOLERANCE_MIB:g})")  # fmt: skip
        return problems

    def results(self) -> dict:
        data = asdict(self)
        # rss_growth_mib: the whisper stubs', as the records before JUDGED_MODELS name it
        data |= {"sent": self.sent, "rss_growth_mib": round(self.growth_mib("whisper"), 1),
                 "growth_mib": {model: round(self.growth_mib(model), 1) for model in JUDGED_MODELS},
                 "late_growth_mib": {model: self.late_growth_mib(model) for model in JUDGED_MODELS},
                 "rss_tolerance_mib": RSS_TOLERANCE_MIB, "late_tolerance_mib": LATE_TOLERANCE_MIB, "weights": WEIGHTS, "problems": self.problems()}  # fmt: skip
        return data

def markdown(report: SoakReport) -> list[str]:
    results = [r.value for r in Result]
    rows = [f"| {kind} | " + " | ".join(str(by.get(r, 0)) for r in results) + f" | {sum(by.values())} |"
            for kind, by in report.counts.items()]  # fmt: skip
    totals = [sum(by.get(r, 0) for by in report.counts.values()) for r in results]
    before, after = report.before, report.after
    return [
        f"{report.concurrency} workers for {report.seconds:.0f} s (after a warm-up of {report.warmup_seconds:.0f} s of "
        f"the same load), each sending one request at a time, of a kind picked at random (weights {WEIGHTS}, seed "
        f"{report.seed}), against `whisper-triton serve` with the packaged tiny.en on the CPU and a fault prompt "
        "armed. Every answer is judged against the transcript the server gave the same input alone before the load "
        "(`loadtest/soak_requests.py`). The soak proper:",
        "",
        "| kind | " + " | ".join(results) + " | all |",
        "| --- |" + " --- |" * (len(results) + 1),
        *rows,
        "| all | " + " | ".join(map(str, totals)) + f" | {report.sent} |",
        "",
        "The warm-up: " + ", ".join(f"{kind} {by}" for kind, by in report.warmup_counts.items()) + ".",
        "",
        "By detail (warm-up included):",
        "",
        *[f"- {detail}: {count}" for detail, count in report.details.items()],
        "",
        "| after the warm-up / once settled | before | after |",
        "| --- | --- | --- |",
        *[f"| {model} stubs' RSS (MiB) | {before.rss_mib[model]:.0f} | {after.rss_mib.get(model, float('nan')):.0f} |"
          for model in before.rss_mib],  # fmt: skip
        f"| whisper requests in flight / windows decoding / waiting | {before.in_flight:g} / {before.running:g} / "
        f"{before.waiting:g} | {after.in_flight:g} / {after.running:g} / {after.waiting:g} |",
        f"| engine healthy, Triton ready | {before.healthy:g}, {before.ready} | {after.healthy:g}, {after.ready} |",
        "",
        "The whisper stub's RSS during the soak (s: MiB): "
        + ", ".join(f"{second:.0f}: {rss:.0f}" for second, rss in report.rss_timeline_mib) + ".",
        "",
        *checkpoint_lines(report),
        "Settled, the stubs grew: " + ", ".join(f"{model} {report.growth_mib(model):.0f} MiB" for model in JUDGED_MODELS)
        + f" (tolerance {RSS_TOLERANCE_MIB:g} MiB each). "
        + ("Passed." if not report.problems() else "FAILED: " + "; ".join(report.problems())),
    ]


def checkpoint_lines(report: SoakReport) -> list[str]:
    """The settled readings between stretches and the last stretch's growth; none without checkpoints."""
    if not report.checkpoints:
        return []
    readings = [(0.0, report.before), *report.checkpoints, (report.seconds, report.after)]
    return [
        "Settled between stretches of the soak (s of load: " + ", ".join(JUDGED_MODELS) + " MiB): "
        + "; ".join(f"{second:.0f}: " + ", ".join(f"{shot.rss_mib.get(model, float('nan')):.0f}" for model in JUDGED_MODELS)
                    for second, shot in readings) + ".",  # fmt: skip
        "",
        f"After {report.checkpoints[-1][0]:.0f} s, the last stretch: "
        + ", ".join(f"{model} {report.late_growth_mib(model):+.0f} MiB" for model in JUDGED_MODELS)
        + f" (tolerance {LATE_TOLERANCE_MIB:g} MiB each).",
        "",
    ]
