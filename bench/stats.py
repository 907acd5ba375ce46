"""From request outcomes to a load point's figures, and from a sweep to its saturation point.

A load point sends requests for warm-up plus a measured window. Throughput
counts what completes inside the window (so requests sent during warm-up that
finish inside it count: the server was busy with them); latency and status
counts are over the requests sent inside the window, each followed to its end.
Goodput counts only successful responses whose transcript passed its check.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

OK = "OK"
BAD_TRANSCRIPT = "BAD_TRANSCRIPT"  # answered, but empty or of an implausible length
# Saturation: the smallest concurrency whose goodput is within this share of the sweep's best.
SATURATION_SHARE = 0.95
# The graceful-overload target: goodput at twice the saturating concurrency
# keeps at least this share of the goodput at saturation.
OVERLOAD_SHARE = 0.9
PERCENTILES = (50, 90, 99)
DIFFERING_TEXTS = 3  # a clip's most frequent texts kept where its answers differ from the library's


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request: when it was sent and answered (time.monotonic, shared by all processes on Linux)."""

    clip: int  # index into the point's clip list
    sent: float
    done: float
    status: str  # OK, BAD_TRANSCRIPT, or the gRPC status name of an error (UNAVAILABLE, ...)
    tokens: int = 0  # text tokens of the transcript
    fallback: bool = False  # some window was decoded again, hotter
    long_sample: bool = False  # a sampled window repeated itself past the plausible length (`transcripts`)
    exact: bool | None = None  # equal to the library's transcript of the clip (None: not compared)
    reason: str = ""  # an error's message, its numbers masked (`load.error_reason`), so like errors count together
    differs: str | None = None  # the text, where it was not equal to the library's transcript of the clip


@dataclass(frozen=True)
class PointStats:
    concurrency: int
    window_s: float
    sent: int  # requests sent inside the window
    answered_per_s: float  # responses of any kind completed inside the window, per second
    goodput_per_s: float  # good transcripts completed inside the window, per second
    rtfx: float  # audio seconds of those good transcripts per wall second
    latency_ms: dict[str, float | None]  # p50, p90, p99, mean of good requests sent inside the window
    statuses: dict[str, int]  # of the requests sent inside the window
    mean_tokens: float | None  # text tokens per good request
    tokens_per_audio_s: float | None
    fallbacks: int  # good requests whose decoding fell back to a higher temperature
    long_samples: int  # of those, the ones whose sampled window repeated itself past a plausible length
    # Good requests compared with the library's transcript of their clip, and those equal to it;
    # the same two counts among the ones with a sampled (fallback) window.
    compared: int = 0
    exact: int = 0
    compared_sampled: int = 0
    exact_sampled: int = 0
    differing: dict[int, int] = field(default_factory=dict)  # clip index: its compared answers not equal
    # clip index: the texts of those answers (at most DIFFERING_TEXTS a clip), each with its count
    differing_texts: dict[int, dict[str, int]] = field(default_factory=dict)
    mean_clip_s: float | None = None  # mean length of the clips of the good requests completed in the window
    problems: list[str] = field(default_factory=list)  # a few examples of bad transcripts
    reasons: dict[str, int] = field(default_factory=dict)  # "STATUS: message" of the failed requests sent inside the window

    @property
    def failed(self) -> bool:
        """A point with any bad transcript does not count: the benchmark did not do real work."""
        return self.statuses.get(BAD_TRANSCRIPT, 0) > 0

    def to_dict(self) -> dict:
        return {**asdict(self), "failed": self.failed}


def percentile_summary(latencies_s: Sequence[float]) -> dict[str, float | None]:
    """p50, p90, p99 and the mean, in ms, rounded to 0.01 ms; None for no data."""
    if not latencies_s:
        return {**{f"p{q}": None for q in PERCENTILES}, "mean": None}
    ms = np.asarray(latencies_s, dtype=np.float64) * 1e3
    summary = {f"p{q}": round(float(np.percentile(ms, q)), 2) for q in PERCENTILES}
    return {**summary, "mean": round(float(ms.mean()), 2)}


def summarize(
    outcomes: Sequence[Outcome],
    durations_s: Sequence[float],
    window: tuple[float, float],
    concurrency: int,
    problems: Sequence[str] = (),
) -> PointStats:
    """The figures of one load point; durations_s[i] is clip i's length."""
    start, end = window
    window_s = end - start
    completed = [o for o in outcomes if start <= o.done < end]
    good_completed = [o for o in completed if o.status == OK]
    sent = [o for o in outcomes if start <= o.sent < end]
    good_sent = [o for o in sent if o.status == OK]
    audio_s = sum(durations_s[o.clip] for o in good_completed)
    tokens = sum(o.tokens for o in good_sent)
    sent_audio_s = sum(durations_s[o.clip] for o in good_sent)
    return PointStats(
        concurrency=concurrency,
        window_s=round(window_s, 3),
        sent=len(sent),
        answered_per_s=round(len(completed) / window_s, 2),
        goodput_per_s=round(len(good_completed) / window_s, 2),
        rtfx=round(audio_s / window_s, 1),
        latency_ms=percentile_summary([o.done - o.sent for o in good_sent]),
        statuses=dict(sorted(Counter(o.status for o in sent).items())),
        mean_tokens=round(tokens / len(good_sent), 2) if good_sent else None,
        tokens_per_audio_s=round(tokens / sent_audio_s, 3) if sent_audio_s else None,
        fallbacks=sum(o.fallback for o in good_sent),
        long_samples=sum(o.long_sample for o in good_sent),
        compared=sum(o.exact is not None for o in good_sent),
        exact=sum(o.exact is True for o in good_sent),
        compared_sampled=sum(o.exact is not None and o.fallback for o in good_sent),
        exact_sampled=sum(o.exact is True and o.fallback for o in good_sent),
        differing=dict(sorted(Counter(o.clip for o in good_sent if o.exact is False).items())),
        differing_texts=differing_texts(good_sent),
        mean_clip_s=round(audio_s / len(good_completed), 3) if good_completed else None,
        problems=list(problems)[:5],
        reasons=dict(Counter(f"{o.status}: {o.reason}" for o in sent if o.reason).most_common()),
    )


def differing_texts(outcomes: Sequence[Outcome]) -> dict[int, dict[str, int]]:
    """For each clip with answers unequal to the library's transcript, their most frequent
    texts and how often each came: whether the server reads the clip one other way or many."""
    by_clip: dict[int, Counter[str]] = {}
    for o in outcomes:
        if o.differs is not None:
            by_clip.setdefault(o.clip, Counter())[o.differs] += 1
    return {clip: dict(texts.most_common(DIFFERING_TEXTS)) for clip, texts in sorted(by_clip.items())}


def saturation_index(goodputs: Sequence[float]) -> int | None:
    """Index of the first point whose goodput is at least SATURATION_SHARE of the best."""
    if not goodputs:
        return None
    best = max(goodputs)
    return next(i for i, g in enumerate(goodputs) if g >= SATURATION_SHARE * best)


@dataclass(frozen=True)
class Saturation:
    concurrency: int  # the smallest concurrency that reaches SATURATION_SHARE of the best goodput
    goodput_per_s: float
    rtfx: float
    best_goodput_per_s: float
    overload_concurrency: int | None  # twice `concurrency`, when measured
    overload_goodput_per_s: float | None
    overload_share: float | None  # goodput there over goodput at saturation
    graceful: bool | None  # overload_share >= OVERLOAD_SHARE


def saturation(points: Sequence[PointStats]) -> Saturation | None:
    """Where a concurrency sweep (ascending) saturates, and what twice that concurrency keeps."""
    counted = [p for p in points if not p.failed]
    index = saturation_index([p.goodput_per_s for p in counted])
    if index is None:
        return None
    at = counted[index]
    twice = next((p for p in counted if p.concurrency == 2 * at.concurrency), None)
    share = round(twice.goodput_per_s / at.goodput_per_s, 3) if twice and at.goodput_per_s else None
    return Saturation(
        concurrency=at.concurrency,
        goodput_per_s=at.goodput_per_s,
        rtfx=at.rtfx,
        best_goodput_per_s=max(p.goodput_per_s for p in counted),
        overload_concurrency=twice.concurrency if twice else None,
        overload_goodput_per_s=twice.goodput_per_s if twice else None,
        overload_share=share,
        graceful=None if share is None else share >= OVERLOAD_SHARE,
    )


def sweep_done(points: Sequence[PointStats], min_top: int) -> bool:
    """A doubling sweep has seen enough: it reached `min_top` and twice its saturating
    concurrency with points that count (a failed point is measured again further on)."""
    found = saturation(points)
    counted = [p for p in points if not p.failed]
    top = counted[-1].concurrency if counted else 0
    return found is not None and top >= min_top and top >= 2 * found.concurrency
