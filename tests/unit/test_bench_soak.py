"""The GPU soak's judgement (`bench.gpu_soak.problems`) and the load generator's error reasons:
what a soak's record must show for the soak to pass, each rule failing on the record it guards."""

from __future__ import annotations

import asyncio
import copy
import time

from bench import gpu_soak, live_latency
from bench.gpu_soak import KINDS, SOAKS, problems
from bench.host import later_growth
from bench.load import error_reason
from bench.stats import Outcome, summarize
from bench.transcripts import TranscriptCheck, judge
from python_backend_lib.contract.parameters import parse_request_parameters

PASSING = {
    "label": "tiny-2gpu",
    "point": {"statuses": {"OK": 900, "UNAVAILABLE": 12}, "problems": [],
              "reasons": {"UNAVAILABLE: server overloaded: N requests in flight, the limit": 12}},
    "answered": {"gpu0/whisper_0_0": 230.0, "gpu0/whisper_0_1": 220.0, "gpu1/whisper_0_0": 225.0,
                 "gpu1/whisper_0_1": 225.0},
    "held_after": {"gpu0/whisper_0_0": 0.0, "gpu1/whisper_0_0": 0.0},
    "failed_steps": {"gpu0/whisper_0_0": 0.0},
    "engine_stalled": {"gpu0/whisper_0_0": 0.0},
    "live": {"sessions": 32, "turns": 192, "completed": 192, "errors": [], "max_send_lag_s": 0.01},
    # the memory watch's samples: a rise in the first half, level in the second
    "memory": [{"s": 10.0 * n, "host_gib": {"whisper": 20.0 + min(n, 5) * 0.2, "tritonserver": 1.0},
                "gpus_gib": [40.0 + min(n, 5) * 0.5, 41.0],
                "instances_gib": {"reserved": {"gpu0/whisper_0_0": 9.0 + min(n, 5) * 0.1, "gpu1/whisper_0_0": 9.5},
                                  "allocated": {"gpu0/whisper_0_0": 8.0, "gpu1/whisper_0_0": 8.0}}}
               for n in range(1, 31)],
}


def changed(path: tuple[str, ...], value) -> dict:
    record = copy.deepcopy(PASSING)
    target = record
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return record


def leaking(kind: str, *keys) -> dict:
    """PASSING with one role's host memory, one GPU's or one instance's pool rising by a
    steady 0.04 GiB a sample."""
    record = copy.deepcopy(PASSING)
    for n, sample in enumerate(record["memory"]):
        target = sample[kind]
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] += 0.04 * n
    return record


def test_a_soak_where_everything_is_answered_or_refused_as_overloaded_passes():
    assert problems(PASSING) == []
    assert problems({**PASSING, "memory": []}) == problems({**PASSING, "memory": PASSING["memory"][:1]}) == []


def test_memory_is_judged_over_the_loads_second_half():
    growth = later_growth(PASSING["memory"])
    assert growth == {"host whisper": 0.0, "host tritonserver": 0.0, "gpu 0": 0.0, "gpu 1": 0.0,  # the early rise left out
                      "reserved gpu0/whisper_0_0": 0.0, "reserved gpu1/whisper_0_0": 0.0,
                      "allocated gpu0/whisper_0_0": 0.0, "allocated gpu1/whisper_0_0": 0.0}
    leak = later_growth(leaking("host_gib", "whisper")["memory"])
    assert leak["host whisper"] == round(0.04 * (29 - 14), 3) > gpu_soak.MEMORY_GROWTH_LIMIT_GIB  # samples 15 to 30
    (problem,) = problems(leaking("gpus_gib", 1))
    assert problem.startswith("memory grew over the load's second half (GiB): {'gpu 1': 0.6")


def test_every_way_a_soak_can_lose_or_fail_a_request_is_a_problem():
    cases = {
        "timeout": changed(("point", "statuses", "DEADLINE_EXCEEDED"), 1),
        "internal": changed(("point", "statuses", "INTERNAL"), 3),
        "bad answer": changed(("point", "statuses", "BAD_TRANSCRIPT"), 1),
        "unavailable, not overload": changed(("point", "statuses", "UNAVAILABLE"), 13),
        "stalled instance": changed(("answered", "gpu1/whisper_0_1"), 2.0),
        "held after the settle": changed(("held_after", "gpu1/whisper_0_0"), 1.0),
        "failed step": changed(("failed_steps", "gpu0/whisper_0_0"), 1.0),
        "stalled engine": changed(("engine_stalled", "gpu0/whisper_0_0"), 1.0),
        "live turn lost": changed(("live", "completed"), 191),
        "live error": changed(("live", "errors"), ['{"type": "error"}']),
        "live audio sent late": changed(("live", "max_send_lag_s"), 913.112),
        "no live turn": changed(("live", "turns"), 0) | {"live": {**PASSING["live"], "turns": 0, "completed": 0}},
        "nothing answered": changed(("point", "statuses"), {"UNAVAILABLE": 12}),
        "host memory rising": leaking("host_gib", "whisper"),
        "GPU memory rising": leaking("gpus_gib", 1),
        "one instance's reserved memory rising": leaking("instances_gib", "reserved", "gpu1/whisper_0_0"),
    }
    for name, record in cases.items():
        assert problems(record), name
    assert problems({"label": "x", "error": "RuntimeError: the server did not start"})


def test_the_live_sessions_begin_spread_over_the_moments_after_the_soak_starts(monkeypatch):
    """live_session takes the moment a session begins (time.monotonic()); a delay passed
    instead began every session at once and read the host's uptime as send lag."""
    begins = []

    async def session(url, stream, begin):
        begins.append(begin)
        return live_latency.SessionResult(turns=1, turn_latencies_s=[0.5])

    monkeypatch.setattr(live_latency, "live_session", session)
    started = time.monotonic()
    tally = asyncio.run(gpu_soak._live_soak("http://localhost:1/v1", sessions=4, seconds=0.0))
    assert tally.sessions == 4 and tally.completed == 4 and tally.errors == []
    assert all(started <= b <= started + gpu_soak.LIVE_START_SPREAD_S + 1.0 for b in begins), (started, begins)
    assert len(set(begins)) == 4, begins


def test_error_reasons_mask_numbers_so_like_errors_count_together():
    first = error_reason("server overloaded: 1024 requests in flight, the limit 1024 ...")
    second = error_reason("server overloaded: 998 requests in flight,\n the limit 1024 ...")
    assert first == second == "server overloaded: N requests in flight, the limit N ..."
    outcomes = [Outcome(0, 1.0, 1.1, "UNAVAILABLE", reason=first), Outcome(0, 1.2, 1.3, "UNAVAILABLE", reason=second),
                Outcome(0, 1.3, 1.4, "OK")]
    assert summarize(outcomes, [1.0], (0.0, 2.0), 1).reasons == {f"UNAVAILABLE: {first}": 2}


def test_random_weights_decoding_freely_pass_on_form_alone():
    record = {"text": "", "segments": [{"tokens": list(range(444)), "temperature": 1.0}]}
    assert judge(record, TranscriptCheck(50257, 1.0, free_length=True)).ok
    assert not judge(record, TranscriptCheck(50257, 1.0)).ok


def test_every_soak_asks_for_request_kinds_the_server_accepts():
    for kind in KINDS.values():
        parse_request_parameters({"response_format": "verbose_json", **kind})
    assert {"tiny-1gpu", "tiny-2gpu", "tiny-2gpu-no-mps", "base-mixed", "large-v3", "large-v3-fp8"} <= set(SOAKS)
    assert SOAKS["large-v3-fp8"].quantize == "fp8" and SOAKS["large-v3"].quantize is None
    assert any(s.live_sessions for s in SOAKS.values()) and {s.mps for s in SOAKS.values()} == {True, False}


def test_a_soak_may_ask_for_its_engines_and_its_cpu_smoke_run_leaves_them_to_auto():
    """The four-engine soak serves `--engines=4` on its GPU; the CPU smoke run of any soak
    serves exact, auto's engines, at the concurrency asked for."""
    soak = SOAKS["tiny-1gpu-4-engines"]
    argv = gpu_soak.serve_command(soak, None, None).argv()
    assert "--engines=4" in argv and "--gpus=0" in argv and "--mps=on" in argv
    assert not any(a.startswith("--engines") for a in gpu_soak.serve_command(SOAKS["tiny-1gpu"], None, None).argv())
    smoke = gpu_soak.on_cpu(soak, 8)
    assert (smoke.gpus, smoke.mps, smoke.engines, smoke.quantize, smoke.concurrency) == (None, None, None, None, 8)
    smoke_argv = gpu_soak.serve_command(smoke, None, None).argv()
    assert not any(a.startswith(("--engines", "--gpus", "--mps")) for a in smoke_argv)
    assert gpu_soak.on_cpu(SOAKS["tiny-2gpu"], 4).live_sessions == 4


def test_a_soak_of_another_checkout_is_named_by_its_commit_in_the_table():
    """`--checkout` serves an earlier commit's code: its table row says which, so an A/B of
    two soaks in one call never reads as the same code twice."""
    ours = dict(PASSING, problems=[])
    theirs = dict(PASSING, problems=[], checkout=".before", checkout_commit="0aec2f495f3e0ef557c18e63a7859cce7ccaefde")
    folder_only = dict(PASSING, problems=[], checkout="/tmp/old")
    run = {"commit": "22a5ecb" + "0" * 33, "dirty": False, "machine": {"gpu": "NVIDIA H200", "cpu_count": 16}}
    data = {"seconds": 100, "run": run, "clients": 8, "clips": ["a"], "mean_clip_s": 5.0,
            "command": "python -m bench.gpu_soak", "soaks": [ours, theirs, folder_only]}
    labels = [line.split(" | ")[0].lstrip("| ") for line in gpu_soak.markdown(data).splitlines()
              if line.startswith("| tiny")]
    assert labels == ["tiny-2gpu", "tiny-2gpu (0aec2f4)", "tiny-2gpu (/tmp/old)"]
    assert gpu_soak.served_label(theirs) == "tiny-2gpu (0aec2f4)"
