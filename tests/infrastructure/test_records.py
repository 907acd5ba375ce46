"""The figures the docs quote (the load test, flood and soak, the GPU headline) are the stored records'.

Each record (docs/benchmarks/{loadtest,flood,soak}.json) is written by the tool
that measured it (`--record`), with its commit, machine and command; the "Load
testing" section of docs/operating.md must quote the same numbers, so a new record
without new docs (or the reverse) fails here. The "On a GPU" section of
docs/performance.md must quote the GPU records it names. And every relative link in
README.md and under docs/ must lead to a file that exists (and to a heading there,
when it names one).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "docs" / "benchmarks"
TOOLS = {"loadtest": "loadtest.run", "flood": "loadtest.flood", "soak": "loadtest.soak"}


OPERATING = REPO_ROOT / "docs" / "operating.md"
PERFORMANCE = REPO_ROOT / "docs" / "performance.md"


def section(path: Path, heading: str) -> str:
    """The part of a page from `heading` (a level-2 heading) to the next one, or to the end."""
    text = path.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n") + 1
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def load_testing_section() -> str:
    return section(OPERATING, "## Load testing")


def record(name: str) -> dict:
    return json.loads((BENCHMARKS / f"{name}.json").read_text(encoding="utf-8"))


def thousands(n: int) -> str:
    """As the docs write counts: 1,310."""
    return f"{n:,}"


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_record_says_where_it_was_measured(name):
    origin = record(name)["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}", origin["commit"] or ""), f"{name}.json has no commit"
    assert origin["machine"]["cpu"] and origin["machine"]["cpu_count"] > 0
    assert f"-m {TOOLS[name]} " in origin["command"] and f"--record docs/benchmarks/{name}" in origin["command"]
    assert (BENCHMARKS / f"{name}.md").is_file()
    assert f"docs/benchmarks/{name}.md" in load_testing_section()


def test_docs_load_test_table_is_the_record():
    data = record("loadtest")
    readme_rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in load_testing_section().splitlines()
        if line.startswith("| grpc |") or line.startswith("| http |") or line.startswith("| | Aggregated")
    ]
    expected = [
        [row["request_type"], row["name"], str(row["requests"]), str(row["failures"]), f"{row['median_ms']:.0f}",
         f"{row['p95_ms']:.0f}", f"{row['requests_per_s']:.2f}"]  # fmt: skip
        for row in [*data["rows"], data["total"]]
    ]
    assert readme_rows == expected
    assert f"**0 failures** in {data['total']['requests']} requests" in load_testing_section()
    assert data["total"]["failures"] == 0 and data["errors"] == []


def test_docs_flood_figures_are_the_record():
    data, section = record("flood"), " ".join(load_testing_section().split())
    assert data["lost"] == 0 and data["sent"] == data["answered"] + data["refused"]
    for quoted in (
        f"capacity {data['capacity_per_s']:.2f} requests/s",
        f"{data['sent']} sent at up to {data['peak_rate_per_s']:g}/s over {data['flood_s']:.0f} s",
        f"{data['answered']} answered with the right transcript, {data['refused']} refused at once",
        f"median latency {data['latency_before_s']:.2f} s before, {data['latency_after_s']:.2f} s after",
    ):
        assert quoted in section


def test_docs_soak_figures_are_the_record():
    data, section = record("soak"), " ".join(load_testing_section().split())
    assert data["problems"] == [] and data["unexpected"] == []
    totals = {
        result: sum(by.get(result, 0) for by in data["counts"].values())
        for result in ("transcribed", "refused", "cancelled", "unexpected")
    }
    assert sum(totals.values()) == data["sent"]
    for quoted in (
        f"{data['concurrency']} workers for {data['seconds']:.0f} s",
        f"{thousands(data['sent'])} requests, {thousands(totals['transcribed'])} transcribed",
        f"{totals['refused']} refused with a named error ({data['counts']['bad_input']['refused']} bad inputs",
        f"{data['counts']['fault']['refused']} broken steps",
        f"{totals['cancelled']} cancelled by their clients, {totals['unexpected']} unexpected",
        f"from {thousands(round(data['before']['rss_mib']['whisper']))} MiB after the warm-up to "
        f"{thousands(round(data['after']['rss_mib']['whisper']))} MiB",
        f"within {data['rss_tolerance_mib']:.0f} MiB",
    ):
        assert quoted in section


# ----------------------------------------------------- the three-model server on a GPU

SHIPPED = BENCHMARKS / "shipped-3647cf1"


def gpu_section() -> str:
    return section(PERFORMANCE, "## On a GPU")


def variants(path: Path) -> dict[str, dict]:
    return {v["label"]: v for v in json.loads(path.read_text(encoding="utf-8"))["variants"]}


def best(variant: dict) -> dict:
    return max(variant["points"], key=lambda p: p["goodput_per_s"])


def test_docs_gpu_headline_is_the_shipped_record():
    """The table of the shipped three-model server against the two-model one
    quotes one run's best points (served-variants.json), their ratio, and the lone
    clip's latencies from the run made for them (latency-served-variants.json)."""
    throughput = variants(SHIPPED / "served-variants.json")
    before, shipped = best(throughput["before"]), best(throughput["shipped"])
    section = gpu_section()
    assert before["concurrency"] == shipped["concurrency"] == 2048
    row = next(line for line in section.splitlines() if line.startswith("| requests/s at saturation"))
    ratio = shipped["goodput_per_s"] / before["goodput_per_s"]
    assert row == (f"| requests/s at saturation (concurrency 2,048) | {thousands(round(before['goodput_per_s']))} "
                   f"(RTFx {thousands(round(before['rtfx']))}) | {thousands(round(shipped['goodput_per_s']))} "
                   f"(RTFx {thousands(round(shipped['rtfx']))}): {ratio:.2f} times |")
    alone = variants(SHIPPED / "latency-served-variants.json")
    row = next(line for line in section.splitlines() if line.startswith("| one 5 s clip alone"))
    first, after = alone["before"]["latency_5s"]["latency_ms"], alone["shipped"]["latency_5s"]["latency_ms"]
    assert row == (f"| one 5 s clip alone, p50 / p99 | {first['p50']:.2f} / {first['p99']:.2f} ms | "
                   f"{after['p50']:.2f} / {after['p99']:.2f} ms |")
    for name in ("served-variants.json", "latency-served-variants.json"):
        run = json.loads((SHIPPED / name).read_text(encoding="utf-8"))["run"]
        assert run["commit"].startswith("3647cf1") and "H100" in run["machine"]["gpu"] and not run["dirty"]


SERVED = BENCHMARKS / "served-79441c0"


def rtfx_text(rtfx: float) -> str:
    """As the docs write an RTFx: whole thousands with a comma, below 1,000 one decimal."""
    return thousands(round(rtfx)) if rtfx >= 1000 else f"{rtfx:.1f}"


def test_docs_served_against_engine_table_is_the_record():
    """The served-against-engine rows quote served.json of one warm H100: each model's
    served point at saturation (as served.md names it) and the engine alone in as many
    processes as the server runs engines."""
    from bench.served_report import saturated

    data = json.loads((SERVED / "served.json").read_text(encoding="utf-8"))
    section = gpu_section()
    for model, label in (("tiny", "| tiny.en |"), ("large-v3", "| large-v3 (random weights, forced lengths) |")):
        served, engine = saturated(data["models"][model]["served"]), data["models"][model]["engine"]
        row = next(line for line in section.splitlines() if line.startswith(label))
        assert f"RTFx {rtfx_text(served['rtfx'])}" in row and f"concurrency {served['concurrency']:,}" in row
        assert f"| RTFx {rtfx_text(engine['rtfx'])} ({engine['processes']} process" in row and not engine["failed"]
        assert row.endswith(f"| {served['rtfx'] / engine['rtfx']:.2f} |")
    assert all(run["commit"].startswith("79441c0") and "H100" in run["machine"]["gpu"] for run in data["runs"])


LARGE_MODELS = BENCHMARKS / "large-models" / "large-models.json"


def test_the_lone_large_v3_clip_figures_are_the_record():
    """The lone 5 s clip of large-v3 before and after the decoder's fused residual norms:
    the README's and performance.md's figures are the served call's (a0d3bc2 beside a
    checkout of 0aec2f4) and the engine-alone runs' (the latency-variants record)."""
    data = json.loads(LARGE_MODELS.read_text(encoding="utf-8"))
    (run,) = [run for run in data["served"] if run["run"]["commit"].startswith("a0d3bc2")]
    variants = {v["label"]: v for v in run["variants"]}
    assert variants["before"]["checkout_commit"].startswith("0aec2f4") and "checkout_commit" not in variants["after"]
    alone = {label: v["latency_5s"]["latency_ms"]["p50"] for label, v in variants.items()}
    sentence = f"A lone 5 s clip of large-v3 with fp8 took {alone['after']} ms against {alone['before']} before"
    assert sentence in " ".join((REPO_ROOT / "README.md").read_text(encoding="utf-8").split())
    performance = " ".join(PERFORMANCE.read_text(encoding="utf-8").split())
    assert f"a lone 5 s clip of large-v3 took **{alone['after']} ms against {alone['before']}** for 0aec2f4" in (
        performance)
    engine = json.loads((BENCHMARKS / "latency" / "fused-decoder-b99e903" / "latency-variants.json").read_text())
    p50s = {label: [r["record"]["engine"]["latency_ms"]["p50"] for r in engine["runs"]
                    if r["label"] == label and r["record"]["model"] == "large-v3"] for label in ("before", "+norm+kv")}
    after, before = (" and ".join(f"{p:.2f}" for p in p50s[label]) for label in ("+norm+kv", "before"))
    assert f"large-v3 **{after} ms against {before}**" in performance


def test_the_cpu_figures_are_the_record():
    """The README's CPU line and performance.md's row are cpu.json's medians: served int8
    and float32 against faster-whisper's best, with the int8 and best turns' ranges."""
    from bench.cpu_report import ratio, summaries

    data = json.loads((BENCHMARKS / "cpu.json").read_text(encoding="utf-8"))
    found = summaries(data["measurements"])
    int8_ratio, int8, best = ratio(found, "served int8")
    float32_ratio, float32, _ = ratio(found)
    readme = " ".join((REPO_ROOT / "README.md").read_text(encoding="utf-8").split())
    assert (f"`--quantize int8` served RTFx {int8.median_rtfx:.1f} against faster-whisper int8's best "
            f"{best.median_rtfx:.1f} ({int8_ratio:.2f}; three turns {min(int8.rtfx):.1f} to {max(int8.rtfx):.1f} "
            f"against {min(best.rtfx):.1f} to {max(best.rtfx):.1f}), float32 as shipped "
            f"{float32.median_rtfx:.1f} ({float32_ratio:.2f})") in readme
    assert data["commit"][:7] in readme
    row = (f"| {int8_ratio:.2f} (RTFx {int8.median_rtfx:.1f} against {best.median_rtfx:.1f}); float32 as shipped "
           f"{float32_ratio:.2f} |")
    assert row in PERFORMANCE.read_text(encoding="utf-8")


def test_the_host_calls_table_is_the_record():
    """performance.md's table of the engine alone before and after fewer host calls a graph
    step is the lone-clip record's `engine_host_calls` runs, in their order: each run's
    p50, its plan, prepare and launch host time, and prepare and launch against the same
    run's admission."""
    record = json.loads((BENCHMARKS / "latency" / "lone-clip-tiny" / "lone-clip-runs.json").read_text())
    runs = record["engine_host_calls"]["runs"]
    assert [r["record"]["library"].get("checkout_commit", "")[:7] for r in runs] == ["2973aef", ""] * 3
    performance = PERFORMANCE.read_text(encoding="utf-8")
    rounds: dict[str, int] = {}
    for run in runs:
        label = run["label"]
        rounds[label] = rounds.get(label, 0) + 1
        parts = run["record"]["engine"]["engine_thread"]
        us = {name: 1e3 * parts[f"  step: {name}"]["ms_per_call"]
              for name in ("plan (rows, tokens, facts)", "prepare (page tables, staging)", "launch (copy in, replay)")}
        admit = 1e3 * parts["admit (encoder launched)"]["ms_per_call"]
        plan, prepare, launch = us.values()
        row = (f"| {label} {rounds[label]} | {run['record']['engine']['latency_ms']['p50']:.2f} | {plan:.1f} | "
               f"{prepare:.1f} | {launch:.1f} | {prepare / admit:.3f} | {launch / admit:.3f} |")
        assert row in performance


LONE_CLIP = BENCHMARKS / "latency" / "lone-clip-tiny" / "lone-clip-runs.json"


def test_the_lone_clip_and_h200_saturation_figures_are_the_record():
    """performance.md's rows and the README's line for tiny on one H200 at the current engine
    are the lone-clip record's last runs: the last breakdown (served p50, the engine alone,
    three events of Triton's trace, the preprocessing and whisper models' own phases, what lies outside it),
    the MPS on/off run and the last saturation run, the current code beside the checkout
    it was run against (each variant's best requests a second and RTFx, and its lone clip's p50)."""
    from bench.comparisons import best_point

    record = json.loads(LONE_CLIP.read_text(encoding="utf-8"))
    (mps,) = [run for run in record["served_variants"] if run["variants"][0]["label"] == "mps1"]
    saturation = record["served_variants"][-1]
    breakdown = record["breakdowns"][-1]
    at = {event["label"]: event["median_ms"] for event in breakdown["served"]["trace"]["events"]}
    performance = PERFORMANCE.read_text(encoding="utf-8")
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    phases, ours = breakdown["served"]["whisper_phases"], breakdown["served"]["preprocessing_phases"]
    assert (f"{breakdown['model']} served p50 {breakdown['served']['latency_ms']['p50']:.2f} ms: in whisper's queue at "
            f"{at['whisper: queued']:.2f} ms, in postprocessing's at {at['postprocessing: queued']:.2f}, sent at "
            f"{at['gRPC sent the answer']:.2f}; the engine alone {breakdown['engine']['latency_ms']['p50']:.2f} ms; "
            f"inside preprocessing, by its own metrics, {ours['request_ms']:.2f} ms from `execute` to its answer "
            f"(decode {ours['decode_ms']:.2f}, log-mel {ours['log_mel_ms']:.2f}, send {ours['send_ms']:.2f}); "
            f"inside whisper {phases['request_ms']:.2f} ms from reaching the model to its "
            f"answer, the answer's way to Triton {phases['answer_ms']:.2f} | one run, "
            f"{breakdown['served']['trace']['requests']} requests traced") in performance
    assert f"| one H200, 16 CPUs, {breakdown['provenance']['commit'][:7]} | [lone-clip-tiny]" in performance
    outside = breakdown["served"]["latency_ms"]["p50"] - phases["request_ms"]
    assert f"**About {outside:.1f} ms of a\nlone clip lie outside the engine**" in performance
    assert f"about {outside:.1f} ms of a\n  lone clip lie outside the engine" in readme
    commit = saturation["run"]["commit"][:7]
    by_run = {v["label"]: v for v in saturation["variants"]}
    now, then = [by_run["after"], by_run["after-2"]], [by_run["before"], by_run["before-2"]]
    best, earlier = [best_point(v) for v in now], [best_point(v) for v in then]
    lone = [v["latency_5s"]["latency_ms"]["p50"] for v in now]
    lone_then = [v["latency_5s"]["latency_ms"]["p50"] for v in then]
    before = saturation["variants"][0]["spec"].removeprefix("checkout:").split(",")[0]
    assert before == ".before" and [v["label"] for v in saturation["variants"]] == ["before", "after", "before-2", "after-2"]
    then_commit = saturation["variants"][0]["checkout_commit"][:7]
    figures = (f"RTFx {best[0]['rtfx']:,.0f} and {best[1]['rtfx']:,.0f} ({best[0]['goodput_per_s']:,.0f} and "
               f"{best[1]['goodput_per_s']:,.0f} requests/s at concurrency {best[0]['concurrency']:,}); a lone clip "
               f"p50 {lone[0]:.2f} and {lone[1]:.2f} ms; {then_commit}'s code beside it RTFx "
               f"{earlier[0]['rtfx']:,.0f} and {earlier[1]['rtfx']:,.0f}, {lone_then[0]:.2f} and {lone_then[1]:.2f} ms "
               f"| four runs in one call")
    assert figures in performance and f"| one H200, 16 CPUs, {commit} |" in performance
    assert (f"({commit}, 16 CPUs, two runs in one call):\n  RTFx {best[0]['rtfx']:,.0f} and {best[1]['rtfx']:,.0f} "
            f"at concurrency {best[0]['concurrency']:,}") in readme
    assert f"clip alone p50 {lone[0]:.2f} and {lone[1]:.2f} ms" in readme
    by_label = {v["label"]: v for v in mps["variants"]}
    p50 = {label: v["latency_5s"]["latency_ms"]["p50"] for label, v in by_label.items()}
    rate = {label: best_point(v)["goodput_per_s"] for label, v in by_label.items()}
    assert (f"clip p50 {p50['mps1']:.2f} and {p50['mps2']:.2f} ms with MPS, {p50['nomps1']:.2f} and "
            f"{p50['nomps2']:.2f} without; at concurrency 256 {rate['mps1']:,.0f}\nand {rate['mps2']:,.0f} "
            f"requests/s with it, {rate['nomps1']:,.0f} and {rate['nomps2']:,.0f} without") in performance


def test_the_big_checkpoints_figures_are_the_record():
    """The README's and performance.md's served RTFx of large-v3 and turbo are the best
    points (most good requests a second) of the record's H200 calls, per variant and
    code: fp8 at 569c2d8 with fa3's encoder attention ("fa3", "fa3-2", "fa3-3"), with
    SDPA ("sdpa", "sdpa-2") and 4a0f538 ("before", "before-2") side by side, and the
    earlier call of 9a2ba59 (exact float16)."""
    from bench.comparisons import best_point

    data = json.loads(LARGE_MODELS.read_text(encoding="utf-8"))
    measured = {(run["model"], v["label"], run["run"]["commit"][:7]): best_point(v)["rtfx"]
                for run in data["served"] for v in run["variants"] if best_point(v)}
    rtfx = {key: rtfx_text(value) for key, value in measured.items()}
    v3, turbo, now, then = "large-v3", "large-v3-turbo", "569c2d8", "9a2ba59"

    def runs(model: str, label: str, count: int) -> list[str]:
        return [rtfx[model, label + suffix, now] for suffix in ("", "-2", "-3")[:count]]

    def listed(figures: list[str]) -> str:  # "1,001 / 1,006 / 1,001": commas would blur the figures
        return " / ".join(figures)

    readme = " ".join((REPO_ROOT / "README.md").read_text(encoding="utf-8").split())  # lines wrapped anywhere
    assert (f"large-v3 with `--quantize fp8` served RTFx {listed(runs(v3, 'fa3', 3))} (SDPA encoder attention: "
            f"{listed(runs(v3, 'sdpa', 2))}; 4a0f538: {listed(runs(v3, 'before', 2))}); large-v3-turbo "
            f"{listed(runs(turbo, 'fa3', 3))} ({listed(runs(turbo, 'before', 2))}); exact float16 large-v3 "
            f"{rtfx[v3, 'float16', then]} ({then})") in readme
    performance = PERFORMANCE.read_text(encoding="utf-8")
    ratios = [f"{measured[v3, 'fa3' + s, now] / measured[v3, 'before' + s, now]:.2f}" for s in ("", "-2")]
    assert (f"| RTFx {listed(runs(v3, 'fa3', 3))} with fa3's encoder attention (fp8's since 0184ff1), against "
            f"{listed(runs(v3, 'sdpa', 2))} with SDPA and {listed(runs(v3, 'before', 2))} for 4a0f538 "
            f"({ratios[0]} / {ratios[1]}); target 1,000") in performance
    assert (f"| RTFx {listed(runs(turbo, 'fa3', 3))} with fa3, against {listed(runs(turbo, 'sdpa', 2))} with SDPA "
            f"and {listed(runs(turbo, 'before', 2))} for 4a0f538; target 1,500 **missed**") in performance
    assert f"tanh GELU (not shipped) {rtfx[turbo, 'approx-fa3', now]} in one run" in performance
    # The engine as it stands (b459549), three runs of one server in one call on a later lease.
    final = "b459549"
    lone = " / ".join(f"{v['latency_5s']['latency_ms']['p50']:.2f}" for run in data["served"] for v in run["variants"]
                      if run["run"]["commit"].startswith(final))
    latest = f"{listed([rtfx[turbo, f'run{i}', final] for i in (1, 2, 3)])}, a lone clip {lone} ms"
    assert f"At the final engine ({final}, another H200 lease, one call) turbo served {latest}" in readme
    assert f"at {final} (the engine as it stands, another lease, three runs in one call) {latest}" in performance
    # The tanh form as a sigmoid (c78af0d, not shipped) beside d47b745's tanh form, turbo.
    trial = [measured[turbo, label + s, "c78af0d"] for label in ("sigmoid", "before") for s in ("", "-2")]
    gain = (trial[0] + trial[1]) / (trial[2] + trial[3])
    assert (f"RTFx {rtfx_text(trial[0])} and {rtfx_text(trial[1])}, against {rtfx_text(trial[2])} and "
            f"{rtfx_text(trial[3])} for d47b745 (the tanh form) in the same call, {gain:.2f} in the mean") in (
        " ".join(performance.split()))
    # The encoder's pass alone caps turbo: the clips' mean audio over a window's milliseconds (cd8aac7).
    passes = {run["model"]: {s["batch"]: s["ms_per_window"] for s in run["sizes"]}
              for run in data["encoder"]["cd8aac7, fa3 encoder attention"]["runs"]}
    clip_s = {run["mean_clip_s"] for run in data["served"]}
    assert len(clip_s) == 1
    window_ms = passes[turbo][16]
    cap = rtfx_text(clip_s.pop() * 1000 / window_ms)
    assert f"Turbo's encoder pass alone ({window_ms} ms a window, cd8aac7) caps it at {cap} on these clips" in readme
    assert f"{window_ms} ms a window alone caps turbo at RTFx {cap} before any decoder step" in (
        " ".join(performance.split()))
    table = [f"| {model} | {listed(runs(model, 'fa3', 3))} | {listed(runs(model, 'sdpa', 2))} | "
             f"{listed(runs(model, 'before', 2))} | {rtfx[model, 'approx-fa3', now]} |" for model in (v3, turbo)]
    assert all(row in performance for row in table)
    for run in data["served"]:
        assert "H200" in run["run"]["machine"]["gpu"]
        for variant in run["variants"]:
            precision = "none" if variant["label"] == "float16" else "fp8"
            assert variant["command"].endswith(f"--quantize={precision}")
            before = {then: "71b1c40", "218b791": "4a0f538", "5c22524": "4a0f538", now: "4a0f538"}.get(
                run["run"]["commit"][:7])
            if variant["label"].startswith("before") and before:
                assert variant["checkout_commit"].startswith(before)
            if variant["label"].startswith(("fa3", "approx-fa3")):
                assert "encoder_attention" in variant["spec"] or "approx" in variant["spec"]


# ----------------------------------------------------- links in the docs

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    found, seen = set(), {}
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(pages: list[Path], root: Path = REPO_ROOT) -> list[str]:
    """Each relative link (outside code) whose file is missing, or whose #anchor names no heading there."""
    broken = []
    for page in pages:
        text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text(encoding="utf-8")))
        for target in LINK.findall(text):
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                continue  # https:, mailto: ...
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


def docs_pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def test_every_link_in_the_docs_resolves():
    assert broken_links(docs_pages()) == []


def test_the_link_check_finds_a_missing_file_and_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[fine](other.md#a-heading) [gone](missing.md) [no heading](other.md#nowhere) [web](https://example.com)\n"
        "`[in code](missing.md)`\n\n```\n[in a block](missing.md)\n```\n"
    )
    assert broken_links([page], root=tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#nowhere (no such heading)",
    ]


PARAMETERS = REPO_ROOT / "docs" / "parameters.md"
IDENTICAL = BENCHMARKS / "identical-under-load" / "h200-8015b05.json"


def test_the_identical_answers_table_is_the_record():
    """docs/parameters.md's "same answer under load" table quotes the record, point by point."""
    text = PARAMETERS.read_text(encoding="utf-8")
    table = text[text.index("### The same answer under load (GPU)"):text.index("## Beam search and best_of")]
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in table.splitlines() if line.startswith("| ")}
    points = {p["concurrency"]: p for p in json.loads(IDENTICAL.read_text(encoding="utf-8"))["servers"][0]["points"]}
    header = [int(cell.replace(",", "")) for cell in rows["clients at a time"]]
    for concurrency, shown, sampled in zip(header, rows["answers identical to alone"],
                                          rows["of them, with a sampled (fallback) window"], strict=True):
        p = points[concurrency]
        assert shown == f"{thousands(p['exact'])} of {thousands(p['compared'])}", concurrency
        assert sampled == f"{p['exact_sampled']} of {p['compared_sampled']}", concurrency


MAX_DOCS_FILES = 100  # one current page per topic, and the records those pages cite


def test_docs_hold_at_most_a_hundred_files():
    """Per-commit snapshots and raw profiles leave docs/ once no current page needs them
    (docs/benchmarks/README.md lists where they went)."""
    files = [path for path in (REPO_ROOT / "docs").rglob("*") if path.is_file()]
    assert len(files) <= MAX_DOCS_FILES, f"{len(files)} files under docs/"


WORD_TIMESTAMPS = BENCHMARKS / "live-gpu" / "13-5122971-h200" / "word-timestamps.json"


def test_the_word_timestamps_figures_are_the_record():
    """The README's and performance.md's requests a second served with word timestamps
    at 5122971 (and without them, and for 654df5d's a pass a window) are the record's best
    points, every answer compared equal to the library's."""
    from bench.comparisons import best_point

    served = json.loads(WORD_TIMESTAMPS.read_text(encoding="utf-8"))["served_5122971"]
    assert served["run"]["commit"].startswith("5122971") and "H200" in served["run"]["machine"]["gpu"]
    best = {v["label"]: best_point(v) for v in served["variants"]}
    assert all(point["exact"] == point["compared"] > 0 for point in best.values())
    rate = {label: f"{point['goodput_per_s']:,.1f}" for label, point in best.items()}
    readme = " ".join((REPO_ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"{rate['words']} requests/s against {rate['plain']} for the same clips without them" in readme
    performance = PERFORMANCE.read_text(encoding="utf-8")
    for label, row in (("words", "5122971 (the recorder's self-attention written out, 2f898ac), words**"),
                       ("rows1", "5122971 with `PASS_ROWS = 1`"), ("before-words", "654df5d, words, the same call"),
                       ("plain", "5122971, no word timestamps, the same call")):
        exact = thousands(best[label]["exact"])
        assert any(line.startswith(f"| {'**' if label == 'words' else ''}{row}") and rate[label] in line
                   and f"{exact} of {exact}" in line for line in performance.splitlines()), label


LIVE_RUN = BENCHMARKS / "live-gpu" / "15-e605769-h200" / "live.json"


def test_the_live_headline_is_the_latest_run():
    """The README's and performance.md's live figures (word end to delta, p50, and what the
    batch clients kept) are run 15's record, the range over its three runs, with no errors,
    every turn completed and no failed batch request in any row."""
    record = json.loads(LIVE_RUN.read_text(encoding="utf-8"))
    assert record["commit"].startswith("e605769") and "H200" in record["machine"]["gpu"]
    assert len(record["runs"]) == 3
    p50: dict[tuple[int, int], list[float]] = {}
    kept = []
    for run in record["runs"]:
        assert run["commit"] == record["commit"]
        for row in run["rows"]:
            assert row["errors"] == 0 and not row["batch_failed"] and row["completed_turns"] == row["turns"]
            p50.setdefault((row["sessions"], row["batch_concurrency"]), []).append(row["word_latency_p50_s"])
            if row["batch_concurrency"]:
                kept.append(100 * row["batch_rtfx_beside"] / row["batch_rtfx_alone"])
    span = {key: f"{min(values):.2f} to {max(values):.2f} s" for key, values in p50.items()}
    readme = " ".join((REPO_ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"{span[1, 0]} after the word ends (p50, one session; {span[100, 0]} with 100)" in readme
    assert (f"| one session {span[1, 0]}, 100 sessions {span[100, 0]}, 100 beside 64 batch clients "
            f"{span[100, 64]} (the batch kept {min(kept):.0f} to {max(kept):.0f}%; target 50% met), "
            f"200 sessions {span[200, 0]} |") in PERFORMANCE.read_text(encoding="utf-8")


ENGINE_COUNT = BENCHMARKS / "engines" / "10-engine-count.json"


def _engine_count_rows(variants: list[dict]) -> list[str]:
    """engines.md's rows of engine-count runs: engines (a plain `mps:on` was four then),
    best RTFx and requests a second, lone clip, host and whisper cores, GPU busy share."""
    from bench.comparisons import best_point

    rows = []
    for variant in variants:
        top = best_point(variant)
        engines = variant["spec"].partition("whisper:")[2] or "4"
        rows.append(f"| {variant['label']} | {engines} | {top['rtfx']:,.0f} | {top['goodput_per_s']:,.0f} | "
                    f"{variant['latency_5s']['latency_ms']['p50']:.2f} | {top['host_busy_cores']:.1f} | "
                    f"{top['server_cores']['whisper']['busiest']:.2f} | {top['gpu_utilisation_pct']:.0f}% |")
    return rows


def _engines_section(number: int) -> str:
    page = (BENCHMARKS / "engines.md").read_text(encoding="utf-8")
    start = page.index(f"## {number}. ")
    end = page.find(f"## {number + 1}. ", start)
    return page[start:end if end >= 0 else None]


def test_the_engine_count_table_is_the_record():
    """engines.md's section 10 lists every run of the engine-count record in its order."""
    record = json.loads(ENGINE_COUNT.read_text(encoding="utf-8"))
    table = [line for line in _engines_section(10).splitlines() if line.startswith("| e")]
    assert table == _engine_count_rows([v for run in record["runs"] for v in run["variants"]])


def test_five_engines_became_the_default_on_the_records_of_section_11():
    """Section 11's eight-core table is the record's `eight_cores` run, held to the cores
    it names; its soak figures are gpu-soak.json's run of tiny-1gpu-5-engines, every request
    answered OK and every instance named; and five is what auto runs for tiny under MPS."""
    from python_backend_lib.checkpoints.configs import load_config
    from python_backend_lib.serving.settings import auto_instances_per_gpu

    section = _engines_section(11)
    eight = json.loads(ENGINE_COUNT.read_text(encoding="utf-8"))["eight_cores"]["run"]
    assert eight["taskset"] == "0-7" and "`taskset -c 0-7 python -m bench.served_variants" in section
    table = [line for line in section.splitlines() if line.startswith(("| four", "| five"))]
    assert table == _engine_count_rows(eight["variants"])
    runs = record("gpu-soak/gpu-soak")["runs"]
    (five,) = [soak for run in runs for soak in run["soaks"] if soak["label"] == "tiny-1gpu-5-engines"]
    point, answered = five["point"], five["answered"]
    assert "--engines=5" in five["command"] and len(answered) == 5 and not five["problems"]
    assert point["statuses"] == {"OK": point["sent"]} and sum(answered.values()) >= point["sent"]
    assert (f"**{point['sent']:,} answered of {point['sent']:,} sent, all OK** "
            f"({point['goodput_per_s']:.1f} a\nsecond") in section
    assert f"the five instances {min(answered.values()):,.0f} to {max(answered.values()):,.0f} each" in section
    assert auto_instances_per_gpu(load_config("random:tiny").dims, mps=True).whisper == 5


def test_the_five_engine_soaks_at_b92d07e_are_the_records_runs_at_that_commit():
    """reliability.md's paragraph on five engines' memory quotes gpu-soak.json's two runs
    at b92d07e: the 240 s soak that failed on the GPU's memory, the 480 s one that passed,
    every request answered OK."""
    section = (REPO_ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    paragraph = section[section.index("**Five engines warm their memory pools"):]
    paragraph = " ".join(paragraph[: paragraph.index("Record of the soaks")].split())
    short, long = [run for run in record("gpu-soak/gpu-soak")["runs"] if run["run"]["commit"].startswith("b92d07e")]
    assert "b92d07e" in paragraph
    assert (short["seconds"], long["seconds"]) == (240.0, 480.0)
    for run, judged in ((short, "over the 0.5 GiB bound"), (long, "passed")):
        (soak,) = run["soaks"]
        point, answered = soak["point"], soak["answered"]
        assert point["statuses"] == {"OK": point["sent"]} and len(answered) == 5
        assert f"{point['sent']:,} of {point['sent']:,} OK" in paragraph
        assert f"{min(answered.values()):,.0f} to {max(answered.values()):,.0f}" in paragraph
        growth = soak["memory_growth_gib"]["gpu 0"]
        assert f"{growth:g} GiB" in paragraph and judged in paragraph
        assert bool(soak["problems"]) == (growth > 0.5)


def test_the_last_soak_paragraph_is_the_records_last_run():
    """reliability.md's paragraph on the soak at the last session's final code quotes
    gpu-soak.json's last run: its commit, every request answered OK, each instance's count,
    and the memory it judged."""
    section = (REPO_ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    last = record("gpu-soak/gpu-soak")["runs"][-1]
    (soak,) = last["soaks"]
    point, answered, growth = soak["point"], soak["answered"], soak["memory_growth_gib"]
    start = section.index(f"**At {last['run']['commit'][:7]}**")
    paragraph = " ".join(section[start : section.index("Record of the soaks", start)].split())
    assert point["statuses"] == {"OK": point["sent"]} and len(answered) == 5 and not soak["problems"]
    assert f"{soak['label']} for {soak['seconds']:.0f} s" in paragraph
    assert f"answered {point['sent']:,} of {point['sent']:,} OK at concurrency {point['concurrency']}" in paragraph
    assert f"({point['goodput_per_s']:.1f} a second)" in paragraph
    assert f"the five instances {min(answered.values()):,.0f} to {max(answered.values()):,.0f} each" in paragraph
    allocated = [v for k, v in growth.items() if k.startswith("allocated")]
    reserved = [v for k, v in growth.items() if k.startswith("reserved")]
    assert f"moved {min(allocated):+.3f} to {max(allocated):+.3f} GiB".replace("+-", "-") in paragraph
    assert f"reserve {min(reserved):g} to {max(reserved):+.3f} GiB" in paragraph
    assert f"the GPU's memory {growth['gpu 0']:+.3f} GiB, within the bound" in paragraph


def test_the_blocking_waits_paragraph_is_its_record():
    """performance.md's paragraph on preprocessing's waits asleep quotes the lone-clip
    record's `blocking_waits` run: each variant's lone clip, requests a second and
    preprocessing's cores, the change's commit and the one it ran beside."""
    from bench.comparisons import best_point

    run = json.loads(LONE_CLIP.read_text(encoding="utf-8"))["blocking_waits"]
    performance = PERFORMANCE.read_text(encoding="utf-8")
    start = performance.index("**Every wait of preprocessing asleep")
    paragraph = " ".join(performance[start : performance.index("**Fewer host calls", start)].split())
    by_label = {v["label"]: v for v in run["variants"]}
    after, before = [by_label["after"], by_label["after-2"]], [by_label["before"], by_label["before-2"]]
    lone = [f"{v['latency_5s']['latency_ms']['p50']:.2f}" for v in after + before]
    assert f"{lone[0]} and {lone[1]} ms against {lone[2]} and {lone[3]}" in paragraph
    rate = [f"{best_point(v)['goodput_per_s']:,.0f}" for v in after + before]
    assert f"{rate[0]} and {rate[1]} requests/s against {rate[2]} and {rate[3]}" in paragraph
    cores = [f"{best_point(v)['server_cores']['preprocessing']['cores']:.2f}" for v in after + before]
    assert f"preprocessing {cores[0]} and {cores[1]} cores busy against {cores[2]} and {cores[3]}" in paragraph
    assert f"({run['run']['commit'][:7]} beside {by_label['before']['checkout_commit'][:7]}," in paragraph


def _engine_at_work(engine: dict) -> tuple[float, float]:
    """The engine thread's ms a request at work (its loop and steps, their waits for the
    picks left out) and waiting for the picks, from a latency breakdown's engine part."""
    parts = engine["engine_thread"]
    wait = parts["  step: wait for picks"]["ms"]
    loop = ("engine loop: collect new windows", "engine loop: deliver finished", "engine loop: checkpoint the rows",
            "decoder step (on the engine thread)")  # fmt: skip
    return sum(parts[name]["ms"] for name in loop) - wait, wait


def test_the_runs_paragraph_and_row_are_their_record():
    """performance.md's paragraph on two decode steps a launch quotes the lone-clip
    record's `runs`: the four engine-alone runs column by column, the served pair, the
    answers checked, and the first version's prepare and lone clips."""
    from bench.comparisons import best_point

    run = json.loads(LONE_CLIP.read_text(encoding="utf-8"))["runs"]
    performance = PERFORMANCE.read_text(encoding="utf-8")
    start = performance.index("**Two decode steps in one graph launch, kept**")
    paragraph = " ".join(performance[start : performance.index("The three-model shape at 5d8604e", start)].split())
    engines = [run["engine_alone"][name]["engine"] for name in ("before-1", "after-1", "before-2", "after-2")]
    assert "| p50 ms | " + " | ".join(f"{e['latency_ms']['p50']:.2f}" for e in engines) + " |" in paragraph
    assert "| graph launches a request (16 steps) | " + " | ".join(
        f"{e['graph_launches_per_request']:.0f}" for e in engines) + " |" in paragraph
    at_work = [_engine_at_work(e) for e in engines]
    assert "left out) | " + " | ".join(f"{work:.2f}" for work, _ in at_work) + " |" in paragraph
    assert "| its waits for picks, ms a request | " + " | ".join(f"{wait:.2f}" for _, wait in at_work) + " |" in paragraph
    assert "| GPU kernels, ms a request | " + " | ".join(
        f"{e['kernels']['kernel_ms_per_request']:.2f}" for e in engines) + " |" in paragraph
    assert all(e["graph_steps_per_request"] == 16 for e in engines)
    assert f"kept the engine thread at work {at_work[0][0]:.2f} ms a request for {engines[0]['kernels']['kernel_ms_per_request']:.2f} ms" in paragraph
    served = {v["label"]: v for v in run["served"]["variants"]}
    lone = {label: v["latency_5s"]["latency_ms"] for label, v in served.items()}
    assert (f"a lone 5 s clip p50 {lone['after']['p50']:.2f} / p99 {lone['after']['p99']:.2f} ms against "
            f"{lone['before']['p50']:.2f} / {lone['before']['p99']:.2f}") in paragraph
    points = {label: best_point(v) for label, v in served.items()}
    assert (f"{points['after']['goodput_per_s']:,.1f} requests/s (RTFx {points['after']['rtfx']:,.1f}) against "
            f"{points['before']['goodput_per_s']:,.1f} ({points['before']['rtfx']:,.1f})") in paragraph
    after, before = points["after"], points["before"]
    assert f"{after['exact']:,} of {after['compared']:,} answers equal" in paragraph and after["differing"] == {"76": 1}
    assert f"against {before['exact']:,} of {before['compared']:,}." in paragraph and before["exact"] == before["compared"]
    assert run["served"]["run"]["commit"][:7] == "46b6fdb" and run["served"]["run"]["changed"]  # 3818a85's files
    first = run["wrapper_per_step"]
    prepare = first["breakdown"]["engine"]["engine_thread"]["  step: prepare (page tables, staging)"]["ms_per_call"]
    assert f"the host's prepare took {prepare:.3f} ms a launch" in paragraph
    first_lone = {v["label"]: v["latency_5s"]["latency_ms"]["p50"] for v in first["served"]["variants"]}
    assert (f"a served lone clip {first_lone['after']:.2f} and {first_lone['after-2']:.2f} ms against "
            f"{first_lone['before']:.2f} and {first_lone['before-2']:.2f}: no gain") in paragraph
    row = next(line for line in performance.splitlines() if line.startswith("| two decode steps in one graph launch"))
    assert (f"the engine alone p50 {engines[1]['latency_ms']['p50']:.2f} and {engines[3]['latency_ms']['p50']:.2f} ms "
            f"against {engines[0]['latency_ms']['p50']:.2f} and {engines[2]['latency_ms']['p50']:.2f}") in row
    assert f"served p50 {lone['after']['p50']:.2f} / p99 {lone['after']['p99']:.2f} ms" in row


def test_the_hour_soak_at_ac528ca_is_the_records_last_run():
    """operating.md's hour at ac528ca quotes soak-hour.json's last run: its counts, its
    settled readings of the whisper and preprocessing stubs, and its growth."""
    run = record("soak-hour")["runs"][-1]
    operating = OPERATING.read_text(encoding="utf-8")
    start = operating.index("**An hour at the code of 2026-12-02**")
    end = operating.find("\n\n", start)
    paragraph = " ".join(operating[start : end if end > 0 else None].split())
    assert f"({run['provenance']['commit'][:7]}:" in paragraph and not run["problems"] and not run["unexpected"]
    counts = run["counts"]
    total = {outcome: sum(kind.get(outcome, 0) for kind in counts.values())
             for outcome in ("transcribed", "refused", "cancelled")}
    assert (f"{run['sent']:,} requests, {total['transcribed']:,} transcribed correctly, {total['refused']:,} refused "
            f"with a named error ({counts['bad_input']['refused']:,} bad inputs, {counts['fault']['refused']:,} broken "
            f"steps), {total['cancelled']:,} cancelled by their clients, **0 unexpected**") in paragraph
    settled = [run["before"], *(reading for _, reading in run["checkpoints"]), run["after"]]
    whisper = [f"{reading['rss_mib']['whisper']:,.0f}" for reading in settled]
    assert f"settled at {whisper[0]} MiB after the warm-up, then {', '.join(whisper[1:-1])} and {whisper[-1]} MiB" in paragraph
    assert f"**+{run['growth_mib']['whisper']:.0f} in all, +{run['late_growth_mib']['whisper']:.1f} over the last stretch**" in paragraph
