"""Turn a benchmark's JSON into a Markdown report and a plot.

    python -m bench.report docs/benchmarks/gpu.json [--out docs/benchmarks]      # bench.gpu: gpu.md, gpu.png
    python -m bench.report docs/benchmarks/served.json [--out docs/benchmarks]   # bench.served: served.md, served.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.markdown import markdown_table

# The targets: (what, how to read it from the results, threshold, higher is better).
TARGET_RTFX_TINY_TRITON = 4000
TARGET_P50_MS_TINY_TRITON = 15
TARGET_SPEEDUP_VS_HF = 10
TARGET_GRAPH_SPEEDUP_BATCH1 = 2
TARGET_RTFX_LARGE = 500


def _best(records, **match):
    chosen = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    return max(chosen, key=lambda r: r["rtfx"]) if chosen else None


def targets(data: dict) -> list[list]:
    offline, steps, triton = data.get("offline", []), data.get("steps", []), data.get("triton", [])
    rows = []
    shipped = [r for r in triton if r.get("repository", "as shipped") == "as shipped"]
    saturated = [r for r in shipped if r.get("workload") == "librispeech-like" and r.get("model") == "tiny"]
    best = max(saturated, key=lambda r: r["rtfx"]) if saturated else None
    rows.append(["tiny through Triton, RTFx at saturation", f">= {TARGET_RTFX_TINY_TRITON}",
                 f"{best['rtfx']} ({best['protocol']}, concurrency {best['concurrency']})" if best else "not run",
                 _met(best and best["rtfx"] >= TARGET_RTFX_TINY_TRITON, best)])
    tried = [r for r in triton if r.get("repository", "as shipped") != "as shipped" and r.get("workload") == "librispeech-like"]
    if tried:
        top = max(tried, key=lambda r: r["rtfx"])
        rows.append(["(the same with more CPU instances of the audio models)", f">= {TARGET_RTFX_TINY_TRITON}",
                     f"{top['rtfx']} ({top['repository']}; {top['protocol']}, concurrency {top['concurrency']})",
                     _met(top["rtfx"] >= TARGET_RTFX_TINY_TRITON, top)])
    hf_tiny = _best(offline, model="tiny", workload="librispeech-like", system="hf-generate")
    if best and hf_tiny:
        ratio = round(best["rtfx"] / hf_tiny["rtfx"], 2)
        rows.append(["tiny through Triton / transformers (librispeech-like)", f">= {TARGET_SPEEDUP_VS_HF}x", f"{ratio}x",
                     _met(ratio >= TARGET_SPEEDUP_VS_HF, ratio)])
    short = [r for r in shipped if r.get("workload") == "5s-clip" and r.get("model") == "tiny"]
    fastest = min(short, key=lambda r: r["p50_ms"]) if short else None
    rows.append(["tiny through Triton, p50 of a 5 s clip at concurrency 1", f"<= {TARGET_P50_MS_TINY_TRITON} ms",
                 f"{fastest['p50_ms']} ms ({fastest['protocol']})" if fastest else "not run",
                 _met(fastest and fastest["p50_ms"] <= TARGET_P50_MS_TINY_TRITON, fastest)])
    for model in sorted({r["model"] for r in offline}):
        for workload in sorted({r["workload"] for r in offline if r["model"] == model}):
            hf = _best(offline, model=model, workload=workload, system="hf-generate")
            ours = _best(offline, model=model, workload=workload, system="engine-graphs")
            ratio = round(ours["rtfx"] / hf["rtfx"], 1) if hf and ours else None
            rows.append([f"{model} {workload}: engine with graphs / transformers throughput", f">= {TARGET_SPEEDUP_VS_HF}x",
                         f"{ratio}x" if ratio else "not run", _met(ratio and ratio >= TARGET_SPEEDUP_VS_HF, ratio)])
    for model in sorted({r["model"] for r in steps}):
        eager = next((r for r in steps if r["model"] == model and r["system"] == "engine-eager" and r["batch"] == 1), None)
        graph = next((r for r in steps if r["model"] == model and r["system"] == "engine-graphs" and r["batch"] == 1), None)
        ratio = round(eager["step_ms"] / graph["step_ms"], 2) if eager and graph else None
        rows.append([f"{model}: decode step at batch 1, eager / graph", f">= {TARGET_GRAPH_SPEEDUP_BATCH1}x",
                     f"{ratio}x ({eager['step_ms']} / {graph['step_ms']} ms)" if ratio else "not run",
                     _met(ratio and ratio >= TARGET_GRAPH_SPEEDUP_BATCH1, ratio)])
    large = [r for r in offline if r["model"] == "large-v3" and r["system"] == "engine-graphs"]
    if large:
        worst = min(large, key=lambda r: r["rtfx"])
        rows.append(["large-v3 RTFx (engine with graphs, worst workload)", f">= {TARGET_RTFX_LARGE}",
                     f"{worst['rtfx']} ({worst['workload']})", _met(worst["rtfx"] >= TARGET_RTFX_LARGE, worst)])
    return rows


def _met(ok, measured) -> str:
    if measured is None:
        return "not measured"
    return "met" if ok else "missed"


def markdown(data: dict) -> str:
    device = data.get("device", {})
    parts = [
        "# GPU benchmark",
        "",
        f"{device.get('gpu', '?')}, {device.get('date', '?')}; torch {device.get('torch', '?')}, CUDA {device.get('cuda', '?')}, "
        f"Python {device.get('python', '?')}. Random weights with the real shapes, fp16; every request decodes a forced "
        "number of tokens (min_new_tokens = max_new_tokens). Made by `python -m bench.gpu`; the numbers are in `gpu.json`.",
        "",
        "## Targets",
        "",
        markdown_table(["target", "wanted", "measured", ""], targets(data)),
    ]
    offline = data.get("offline", [])
    if offline:
        hf = {(r["model"], r["workload"]): r["rtfx"] for r in offline if r["system"] == "hf-generate"}
        rows = [
            [r["model"], r["workload"], r["system"], r["requests"], r["rtfx"],
             f"{r['rtfx'] / hf[(r['model'], r['workload'])]:.1f}x" if (r["model"], r["workload"]) in hf else "",
             r["requests_per_s"], r["p50_ms"], r["p95_ms"], r["p99_ms"], r.get("peak_memory_gib")]
            for r in offline
        ]
        parts += ["", "## Offline: all requests submitted at once", "",
                  "Latency is from the submission of all requests to each one's result; features are computed beforehand.", "",
                  markdown_table(["model", "workload", "system", "requests", "RTFx", "vs HF", "req/s", "p50 ms", "p95 ms", "p99 ms",
                          "peak GPU GiB"], rows)]
    steps = data.get("steps", [])
    if steps:
        rows = []
        for model in sorted({r["model"] for r in steps}):
            for batch in sorted({r["batch"] for r in steps if r["model"] == model}):
                eager = next((r for r in steps if r["model"] == model and r["batch"] == batch and r["system"] == "engine-eager"), {})
                graph = next((r for r in steps if r["model"] == model and r["batch"] == batch and r["system"] == "engine-graphs"), {})
                ratio = f"{eager['step_ms'] / graph['step_ms']:.2f}x" if eager and graph else ""
                rows.append([model, batch, eager.get("step_ms"), graph.get("step_ms"), graph.get("replay_gpu_ms"), ratio])
        parts += ["", "## Decode step time", "",
                  "Wall time of one `DecodeBatch.step` with every row decoding (host work and the token readback "
                  "included), and the GPU time of the graph replay alone.", "",
                  markdown_table(["model", "batch", "eager ms", "graph ms", "replay on GPU ms", "eager / graph"], rows)]
    breakdown = data.get("breakdown", [])
    if breakdown:
        parts += ["", "## Where an offline run's time goes", "",
                  "One more run of the first workload with timers around the batch's calls (admission "
                  "timed to a synchronize): encoding and cross K/V (admit), the decode steps (with how "
                  "many eager passes and graph replays they took), and the rest (engine loop, callbacks).", "",
                  markdown_table(["model", "system", "workload", "wall s", "admit s (calls)", "steps s (calls)",
                          "eager passes", "graph replays", "other s"],
                         [[b["model"], b["system"], b["workload"], b["wall_s"], f"{b['admit_s']} ({b['admit_calls']})",
                           f"{b['steps_s']} ({b['steps_calls']})", b["eager_passes"], b["graph_replays"],
                           b["other_s"]] for b in breakdown])]
    memory = data.get("memory", [])
    if memory:
        parts += ["", "## Memory", "", markdown_table(
            ["model", "slots", "weights GiB", "KV pool GiB", "graphs MiB", "capture s", "buckets"],
            [[m["model"], m["slots"], m["weights_gib"], m["kv_pool_gib"], m["graphs_mib"], m["capture_s"],
              " ".join(map(str, m["buckets"]))] for m in memory])]
    encoder = data.get("encoder_attention", [])
    if encoder:
        parts += ["", "## Encoder self-attention kernel", "", markdown_table(
            ["model", "batch", "heads", "kernel", "ms", "first call s", "rel. error vs SDPA"],
            [[e["model"], e["batch"], e["heads"], e["kernel"], e["ms"], e["first_call_s"], e["relative_error_vs_sdpa"]]
             for e in encoder])]
    triton = data.get("triton", [])
    if triton:
        def per_model(t, model, key):
            return t.get("models", {}).get(model, {}).get(key)

        parts += ["", "## Through Triton (ensemble `transcribe`, WAV in, text out)", "",
                  "Per-model times are Triton's statistics over the same requests, per request: "
                  "preprocessing's execute() (audio decoding and log-mel on the CPU) and the time requests "
                  "queue for it and for whisper.", "", markdown_table(
            ["model repository", "protocol", "workload", "concurrency", "requests", "RTFx", "req/s", "p50 ms", "p95 ms",
             "p99 ms", "preprocessing execute ms", "preprocessing queue ms", "whisper queue ms", "forced tokens"],
            [[t.get("repository", "as shipped"), t["protocol"], t["workload"], t["concurrency"], t["requests"], t["rtfx"],
              t["requests_per_s"], t["p50_ms"], t["p95_ms"], t["p99_ms"], per_model(t, "preprocessing", "execute_ms"),
              per_model(t, "preprocessing", "queue_ms"), per_model(t, "whisper", "queue_ms"), t["forced_tokens"]]
             for t in triton])]
    failures = data.get("failures", [])
    if failures:
        parts += ["", "## Failures", ""] + [f"- {f['model']}: {f['error']}" for f in failures]
    return "\n".join(parts) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    offline = data.get("offline", [])
    groups = sorted({(r["model"], r["workload"]) for r in offline})
    systems = ["hf-generate", "engine-eager", "engine-graphs"]
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        values = [next((r["rtfx"] for r in offline if (r["model"], r["workload"]) == g and r["system"] == system), 0) for g in groups]
        left.bar([i + k * width for i in range(len(groups))], values, width, label=system)
    left.set_xticks([i + width for i in range(len(groups))], [f"{m}\n{w}" for m, w in groups])
    left.set_yscale("log")
    left.set_ylabel("RTFx (audio s / wall s)")
    left.set_title("Offline throughput")
    left.legend()
    steps = data.get("steps", [])
    for model in sorted({r["model"] for r in steps}):
        for system, style in (("engine-eager", "--"), ("engine-graphs", "-")):
            points = sorted((r["batch"], r["step_ms"]) for r in steps if r["model"] == model and r["system"] == system)
            if points:
                right.plot(*zip(*points), style, marker="o", label=f"{model} {system}")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("rows in the batch")
    right.set_ylabel("ms per decode step")
    right.set_title("Decode step, eager vs CUDA graph")
    right.legend(fontsize=8)
    fig.suptitle(f"{data.get('device', {}).get('gpu', '')} {data.get('device', {}).get('date', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(json_path: Path, out: Path) -> None:
    data = json.loads(Path(json_path).read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.md").write_text(markdown(data))
    plot(data, out / "gpu.png")


def write_served_report(json_path: Path, out: Path) -> None:
    from bench import served_report

    served_report.write(json_path, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    served = "models" in json.loads(args.json.read_text())  # bench.served's results; bench.gpu's have none
    (write_served_report if served else write_report)(args.json, args.out or args.json.parent)


if __name__ == "__main__":
    main()
