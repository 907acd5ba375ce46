"""`bench.served`'s JSON as a Markdown table against issue 9's targets, and a plot.

    python -m bench.report docs/benchmarks/served.json      # writes served.md and served.png beside it

Every row names the run it came from (commit, machine, date, command), and
the report says whether all rows share one commit and one machine. A phase
that failed, or a load point with any bad transcript, is shown as such and
never counted toward a target.
"""

from __future__ import annotations

from pathlib import Path

from bench.markdown import markdown_table
from bench.stats import OVERLOAD_SHARE

TARGET_TINY_RTFX = 5000
TARGET_SERVED_OVER_ENGINE = 0.5  # tiny: served RTFx at least half the engine's
TARGET_P50_MS = 15.0  # tiny, ~5 s clip, concurrency 1
TARGET_P99_OVER_P50 = 2.0
TARGET_OVER_TRANSFORMERS = 5.0  # tiny: served / transformers' best batched generate, feature extraction included
TARGET_LARGE_SERVED_OVER_ENGINE = 0.8
TARGET_CEILING_REQUESTS_PER_S = 1000  # below this the design must change (the first requirement)
MODEL_ORDER = ("tiny", "large-v3", "tiny-random")
PER_MODEL_COLUMNS = ("preprocessing", "whisper")


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator is not None and denominator else None


def _verdict(value: float | None, ok: bool | None) -> str:
    return "not measured" if value is None else ("met" if ok else "missed")


def _models(data: dict) -> list[str]:
    names = list(data.get("models", {}))
    return sorted(names, key=lambda n: (MODEL_ORDER.index(n) if n in MODEL_ORDER else len(MODEL_ORDER), n))


# ------------------------------------------------------------------ what each phase gives


def saturated(section: dict | None) -> dict | None:
    """The load point at a sweep's saturation, if the phase measured one without error."""
    if not section or section.get("error") or not section.get("saturation"):
        return None
    at = section["saturation"]["concurrency"]
    return next((p for p in section.get("points", []) if p["concurrency"] == at), None)


def engine_rtfx(model: dict) -> float | None:
    engine = model.get("engine") or {}
    return None if engine.get("error") or engine.get("failed") else engine.get("rtfx")


def transformers_best(model: dict) -> dict | None:
    section = model.get("transformers") or {}
    return None if section.get("error") else section.get("best")


def targets(data: dict) -> list[list]:
    rows = []
    tiny, large = data["models"].get("tiny", {}), data["models"].get("large-v3", {})
    served = saturated(tiny.get("served"))
    rtfx = served["rtfx"] if served else None
    rows.append(["tiny served RTFx at saturation", f">= {TARGET_TINY_RTFX}",
                 f"{rtfx} (concurrency {served['concurrency']})" if served else None,
                 _verdict(rtfx, rtfx is not None and rtfx >= TARGET_TINY_RTFX)])
    ratio = _ratio(rtfx, engine_rtfx(tiny))
    rows.append(["tiny served / engine alone (RTFx)", f">= {TARGET_SERVED_OVER_ENGINE}",
                 f"{ratio} ({rtfx} / {engine_rtfx(tiny)})" if ratio else None,
                 _verdict(ratio, ratio is not None and ratio >= TARGET_SERVED_OVER_ENGINE)])
    latency = (tiny.get("served") or {}).get("latency_5s")
    p50 = latency["latency_ms"]["p50"] if latency and not latency["failed"] else None
    p99 = latency["latency_ms"]["p99"] if p50 is not None else None
    clip = f"{latency['clip']['duration_s']} s clip" if latency else ""
    rows.append(["tiny p50, ~5 s clip, concurrency 1", f"<= {TARGET_P50_MS:g} ms",
                 f"{p50} ms ({clip})" if p50 is not None else None,
                 _verdict(p50, p50 is not None and p50 <= TARGET_P50_MS)])
    rows.append(["tiny p99 / p50 there", f"<= {TARGET_P99_OVER_P50:g}",
                 f"{_ratio(p99, p50)} ({p99} ms)" if p50 else None,
                 _verdict(p50, p50 is not None and p99 <= TARGET_P99_OVER_P50 * p50)])
    best = transformers_best(tiny)
    ratio = _ratio(rtfx, best["rtfx"] if best else None)
    rows.append(["tiny served / transformers' best (feature extraction included)", f">= {TARGET_OVER_TRANSFORMERS:g}",
                 f"{ratio} ({rtfx} / {best['rtfx']} at batch {best['batch']})" if ratio else None,
                 _verdict(ratio, ratio is not None and ratio >= TARGET_OVER_TRANSFORMERS)])
    large_served = saturated(large.get("served"))
    ratio = _ratio(large_served["rtfx"] if large_served else None, engine_rtfx(large))
    rows.append(["large-v3 served / engine alone (RTFx)", f">= {TARGET_LARGE_SERVED_OVER_ENGINE}",
                 f"{ratio} ({large_served['rtfx']} / {engine_rtfx(large)})" if ratio else None,
                 _verdict(ratio, ratio is not None and ratio >= TARGET_LARGE_SERVED_OVER_ENGINE)])
    for name in _models(data):
        section = data["models"][name].get("served") or {}
        found = section.get("saturation") if not section.get("error") else None
        share = found.get("overload_share") if found else None
        rows.append([f"{name}: goodput at 2x saturation / at saturation", f">= {OVERLOAD_SHARE}",
                     f"{share} (concurrency {found['overload_concurrency']} vs {found['concurrency']})"
                     if share is not None else None, _verdict(share, found and found.get("graceful"))])
        ceiling = saturated(data["models"][name].get("ceiling"))
        best = data["models"][name]["ceiling"]["saturation"]["best_goodput_per_s"] if ceiling else None
        rows.append([f"{name}: ceiling (stand-in whisper), best requests/s", f">= {TARGET_CEILING_REQUESTS_PER_S}",
                     best, _verdict(best, best is not None and best >= TARGET_CEILING_REQUESTS_PER_S)])
    return rows


# ------------------------------------------------------------------ tables


def provenance_section(data: dict) -> list[str]:
    runs = data.get("runs", [])
    rows = [[r["id"], r["model"], " ".join(r["phases"]) + (" (quick)" if r.get("quick") else ""),
             f"{(r['commit'] or '?')[:10]}{' dirty' if r['dirty'] else ''}",
             f"{r['machine']['gpu'] or 'no GPU'} ({r['machine']['gpu_memory_gib'] or '-'} GiB), "
             f"{r['machine']['cpu_count']} CPUs, driver {r['machine']['driver'] or '-'}",
             f"torch {r['machine']['torch']}, Python {r['machine']['python']}", r["date"],
             f"`{r['command']}`" + (f" (by `{r['call']}`)" if r.get("call") else "")]
            for r in runs]
    commits = {(r["commit"], r["dirty"]) for r in runs}
    machines = {(r["machine"]["gpu"], r["machine"]["cpu_count"], r["machine"]["driver"]) for r in runs}
    one = len(commits) == 1 and len(machines) == 1
    lines = ["## Runs", "",
             ("All rows come from one commit on one machine." if one else
              f"**Rows come from {len(commits)} commit states and {len(machines)} machines: not one run.**"),
             ""]
    dirty = [r for r in runs if r["dirty"]]
    if dirty:
        lines += [f"Run {r['id']}: the tree differed from the commit in {', '.join(r['changed'])}." for r in dirty]
        lines.append("")
    return lines + [markdown_table(["run", "model", "phases", "commit", "machine", "software", "date", "command"], rows)]


def summary_rows(name: str, model: dict) -> list[list]:
    rows = []
    for phase, label in (("ceiling", "ceiling: stand-in whisper (canned transcript, formats written), real preprocessing"),
                         ("served", "served: whisper-triton serve, gRPC")):
        section = model.get(phase) or {}
        point = saturated(section)
        if section.get("error"):
            rows.append([label, None, None, None, None, None, f"failed: {section['error']}"])
        elif point:
            rows.append([label, point["rtfx"], point["goodput_per_s"], point["latency_ms"]["p50"],
                         point["latency_ms"]["p99"], point["mean_tokens"],
                         f"at saturation, concurrency {point['concurrency']}"])
    latency = (model.get("served") or {}).get("latency_5s")
    if latency:
        rows.append([f"served, one {latency['clip']['duration_s']} s clip at a time", latency["rtfx"],
                     latency["goodput_per_s"], latency["latency_ms"]["p50"], latency["latency_ms"]["p99"],
                     latency["mean_tokens"], "concurrency 1" + (" FAILED" if latency["failed"] else "")])
    engine = model.get("engine") or {}
    if engine.get("error"):
        rows.append(["engine alone", None, None, None, None, None, f"failed: {engine['error']}"])
    elif engine:
        processes = engine.get("processes", 1)
        rows.append(["engine alone (Pipeline, log-mel included)", engine["rtfx"], engine["requests_per_s"], None,
                     None, engine["mean_tokens"],
                     f"{engine['requests']} requests at once, {processes} process(es)"
                     + (" under MPS" if engine.get("mps") else "") + f", {engine['slots']} slots each"
                     + (" FAILED" if engine["failed"] else "")])
    hf = model.get("transformers") or {}
    if hf.get("error"):
        rows.append(["transformers", None, None, None, None, None, f"failed: {hf['error']}"])
    for key, label, rtfx_key in (("best", "transformers generate + feature extraction, best batch", "rtfx"),
                                 ("best_generate", "transformers generate alone, best batch", "generate_rtfx")):
        if hf.get(key):
            row = next(r for r in hf["rows"] if r.get("batch") == hf[key]["batch"]
                       and r.get("variant") == hf[key].get("variant"))
            rows.append([label, row[rtfx_key], row["requests_per_s"] if rtfx_key == "rtfx" else None, None, None,
                         row["mean_tokens"], f"batch {row['batch']}, {row.get('variant', '')}, {hf['dtype']}, "
                         f"{hf['attention']}"])
    return rows


def sweep_table(section: dict) -> str:
    rows = []
    for p in section.get("points", []):
        models = p.get("models", {})
        queue_execute = [f"{models[m]['queue_ms']} / {models[m]['execute_ms']}" if m in models else None
                         for m in PER_MODEL_COLUMNS]
        statuses = ", ".join(f"{k} {v}" for k, v in p["statuses"].items())
        rows.append([p["concurrency"], p["goodput_per_s"], p["rtfx"], p["answered_per_s"], p["latency_ms"]["p50"],
                     p["latency_ms"]["p99"], statuses + (" FAILED" if p["failed"] else ""), p["mean_tokens"],
                     _fallbacks(p), f"{p['client_cpu_cores']} ({p['client_processes']})", p["host_busy_cores"],
                     p.get("gpu_utilisation_pct"), p.get("gpu_memory_used_gib"), *queue_execute])
    return markdown_table(["concurrency", "good req/s", "RTFx", "answered/s", "p50 ms", "p99 ms", "requests sent (status)",
                   "tokens/request", "fallbacks", "client CPU cores (processes)", "host CPU cores busy", "GPU %",
                   "GPU GiB", *(f"{m} queue / execute ms" for m in PER_MODEL_COLUMNS)], rows)


def model_section(name: str, model: dict) -> list[str]:
    clips = model.get("clips", [])
    durations = [c["duration_s"] for c in clips]
    weights = "random weights of the real shapes, forced lengths" if model.get("random_weights") else "real weights"
    parts = ["", f"## {name}", "",
             f"Checkpoint `{model.get('source')}` ({weights}); {len(clips)} clips, "
             f"{min(durations, default=0)} to {max(durations, default=0)} s, mean "
             f"{sum(durations) / max(len(durations), 1):.2f} s, {sum(durations):.0f} s in all."]
    if model.get("forced_tokens_per_audio_s"):
        parts.append(f"Every request decodes exactly round({model['forced_tokens_per_audio_s']} x its length) text "
                     "tokens (tiny's measured text tokens per second of audio), no temperature fallback.")
    elif model.get("tokens_per_audio_s"):
        parts.append(f"Real decode lengths: {model['tokens_per_audio_s']} text tokens per second of audio; "
                     f"request parameters {model.get('request_parameters')}.")
    parts += ["", markdown_table(["system", "RTFx", "req/s", "p50 ms", "p99 ms", "tokens/request", ""],
                         summary_rows(name, model))]
    for phase in ("ceiling", "served"):
        section = model.get(phase)
        if section and section.get("points"):
            server = section.get("server", {})
            parts += ["", f"### {name}: {phase} sweep", "",
                      f"`{server.get('command')}` ({server.get('name')} {server.get('version')}, ready after "
                      f"{server.get('ready_s')} s); {section['points'][0]['window_s']} s measured per point."
                      + (f" {section['stopped']}." if section.get("stopped") else ""), "", sweep_table(section)]
    hf = model.get("transformers") or {}
    if hf.get("rows"):
        parts += ["", f"### {name}: transformers {hf['transformers']}", "",
                  f"{hf['dtype']}, {hf['attention']}, {hf['decoding']}; features by {hf['feature_extraction']}.", "",
                  markdown_table(["variant", "batch", "batches", "requests", "RTFx with features", "RTFx generate alone", "req/s",
                          "tokens/request", "feature s", "generate s", "peak GiB"],
                         [[r.get("variant", ""), r["batch"], r.get("batches"), r.get("requests"), r.get("rtfx"),
                           r.get("generate_rtfx"), r.get("requests_per_s"),
                           r.get("mean_tokens"), r.get("feature_s"), r.get("generate_s"),
                           r.get("peak_memory_gib") if "error" not in r else r["error"]] for r in hf["rows"]])]
    if clips:
        parts += ["", "<details><summary>clips</summary>", "",
                  markdown_table(["clip", "recording", "start s", "end s", "seconds", "forced tokens"],
                         [[c["name"], c["recording"], c["start_s"], c["end_s"], c["duration_s"], c["forced_tokens"]]
                          for c in clips]), "", "</details>"]
    return parts


def markdown(data: dict) -> str:
    parts = ["# Served benchmark: the ceiling, the served path, the engine alone and transformers", "",
             "Made by `python -m bench.served` (see the commands below); the numbers are in `served.json`. "
             "RTFx is seconds of audio transcribed per wall second; goodput counts only answers whose transcript "
             "passed its check (non-empty, plausible length; exact length where forced).", "",
             "## Targets (issue 9)", ""]
    if any(r.get("quick") for r in data.get("runs", [])):
        parts += ["**Quick run (`--quick`): short points on a few clips, a check of the harness. "
                  "These are not figures to quote.**", ""]
    parts += [markdown_table(["target", "wanted", "measured", ""], targets(data)), ""]
    parts += provenance_section(data)
    for name in _models(data):
        parts += model_section(name, data["models"][name])
    return "\n".join(parts) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _models(data)
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(6.5 * max(1, len(names)), 4.8), squeeze=False)
    for axis, name in zip(axes[0], names):
        model = data["models"][name]
        for phase, style in (("ceiling", "--"), ("served", "-")):
            points = (model.get(phase) or {}).get("points", [])
            if points:
                axis.plot([p["concurrency"] for p in points], [p["rtfx"] for p in points], style, marker="o",
                          label=f"{phase} (goodput)")
        engine = engine_rtfx(model)
        if engine:
            axis.axhline(engine, color="tab:green", linestyle=":", label=f"engine alone ({engine})")
        best = transformers_best(model)
        if best:
            axis.axhline(best["rtfx"], color="tab:red", linestyle="-.",
                         label=f"transformers best, batch {best['batch']} ({best['rtfx']})")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("requests in flight (concurrency)")
        axis.set_ylabel("RTFx (audio s per wall s)")
        axis.set_title(name)
        axis.legend(fontsize=8)
    machines = {r["machine"]["gpu"] or "CPU" for r in data.get("runs", [])}
    fig.suptitle(", ".join(sorted(machines)))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(json_path: Path, out: Path) -> None:
    import json

    data = json.loads(Path(json_path).read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / "served.md").write_text(markdown(data))
    plot(data, out / "served.png")


def _fallbacks(point: dict) -> str:
    """Requests that fell back, and how many of those sampled a loop past a plausible length."""
    long = point.get("long_samples", 0)
    return f"{point['fallbacks']} ({long} long)" if long else str(point["fallbacks"])
