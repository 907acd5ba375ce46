"""Where the time of one ~5 s clip goes at concurrency 1, on a GPU: the engine's parts and the GPU's kernels.

    python -m bench.latency_breakdown --model tiny-random --tokens-per-second 2.732 --out OUT

Runs the latency target's request (the clip nearest 5 s, as `bench.served`
sends it) through the library's engine alone, one at a time, and reports:
- the wall time of a request, and of its parts on the engine thread (the
  admission with its encoder, each decoder step) with the time the thread spent
  waiting for the GPU's picks;
- from `torch.profiler`, every GPU kernel of a few requests: how long the GPU
  was busy per request, how many kernels one decoder step runs and what each costs.
With `--served`, the same request through `whisper-triton serve` (gRPC,
`transcribe`), so the Triton path's share is the difference: each model's
time queued and in `execute` from Triton's statistics, and the request's
timeline from Triton's trace when the server stopped in time to write it. Writes
OUT/latency-breakdown.md and .json, and a gzipped Chrome trace of the profiled requests.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.served import MODELS, STATE_DIR, Settings, latency_job, make_jobs, served_checkpoint
from bench.server_process import checkout_record
from bench.stats import percentile_summary
from bench.triton_trace import Timeline, markdown, read_trace, timeline, trace_files


@dataclass
class Timings:
    """Seconds spent on the engine thread in the instrumented calls, per call."""

    calls: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))

    def wrap(self, owner: type, name: str, label: str) -> None:
        original = getattr(owner, name)
        calls = self.calls[label]

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                calls.append(time.perf_counter() - start)

        setattr(owner, name, timed)

    def reset(self) -> None:
        for calls in self.calls.values():
            calls.clear()

    def per_request(self, requests: int) -> dict[str, dict[str, float]]:
        return {label: {"calls": round(len(c) / requests, 2), "ms": round(1e3 * sum(c) / requests, 3),
                        "ms_per_call": round(1e3 * statistics.mean(c), 4) if c else 0.0}
                for label, c in self.calls.items()}  # fmt: skip


# The engine thread's parts (`instrument`): admission, whose code a change to the decoder's
# steps leaves alone, is what bench.latency_variants measures each step part against.
ADMIT = "admit (encoder launched)"
STEP = "decoder step (on the engine thread)"
STEP_PART = "  step: "  # how the labels of a step's parts begin
# Before each step the engine saves the rows for a rewind; since 2026-12-02 that is also
# where the rows of the step in flight get their states (`Launched.states_before`), which
# a part of the step made before (`remember_before`).
CHECKPOINT = "engine loop: checkpoint the rows"


def instrument() -> Timings:
    from python_backend_lib.engine import batch, cuda_graphs
    from python_backend_lib.engine.batch import DecodeBatch
    from python_backend_lib.engine.cuda_graphs import DecodeGraphs
    from python_backend_lib.engine.graph_io import PendingStep
    from python_backend_lib.engine.overlap import Launched
    from python_backend_lib.engine.scheduler import Engine

    timings = Timings()
    timings.wrap(Engine, "_encode", ADMIT)
    timings.wrap(Engine, "_collect", "engine loop: collect new windows")
    timings.wrap(Engine, "_deliver", "engine loop: deliver finished")
    timings.wrap(DecodeBatch, "checkpoint", CHECKPOINT)
    timings.wrap(DecodeBatch, "step", STEP)
    timings.wrap(batch, "plan_step", STEP_PART + "plan (rows, tokens, facts)")
    timings.wrap(DecodeGraphs, "prepare", STEP_PART + "prepare (page tables, staging)")
    timings.wrap(cuda_graphs, "page_table", "    prepare: page tables (numpy)")
    timings.wrap(cuda_graphs, "pinned", "    prepare: pinned copies")
    timings.wrap(DecodeGraphs, "launch", STEP_PART + "launch (copy in, replay)")
    # Each launch's picks (a run's all at once); earlier libraries had one step's `result`.
    timings.wrap(PendingStep, "results" if hasattr(PendingStep, "results") else "result", STEP_PART + "wait for picks")
    timings.wrap(Launched, "settle", STEP_PART + "settle the fed tokens")
    timings.wrap(DecodeBatch, "_finish", STEP_PART + "handle the picks")
    if hasattr(Launched, "remember_before"):  # an earlier checkout's library (bench.latency_variants)
        timings.wrap(Launched, "remember_before", STEP_PART + "remember the rows")
    return timings


def one_request(pipeline, job) -> tuple[float, float]:
    """Seconds for the log-mel, and for the whole request."""
    start = time.perf_counter()
    features = pipeline.features([job.audio.waveform])[0]
    featured = time.perf_counter()
    pipeline.submit(job.audio.waveform, job.options, features=features).result()
    return featured - start, time.perf_counter() - start


def covered(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: time the GPU ran any kernel."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def kernel_summary(profiler, requests: int, steps: float) -> dict:
    """GPU kernels of the profiled requests: busy time, count per step, the costliest names."""
    from torch.autograd import DeviceType

    kernels = [e for e in profiler.events() if e.device_type == DeviceType.CUDA]
    busy = covered([(e.time_range.start, e.time_range.end) for e in kernels])
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        by_name[e.name].append(e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))
    return {
        "kernels_per_request": round(len(kernels) / requests, 1),
        "kernels_per_step": round(len(kernels) / requests / steps, 1) if steps else None,
        "gpu_busy_ms_per_request": round(busy / requests / 1e3, 3),
        "kernel_ms_per_request": round(sum(e.time_range.end - e.time_range.start for e in kernels) / requests / 1e3, 3),
        "top": [
            {
                "name": name[:90],
                "per_request": round(len(d) / requests, 1),
                "us_each": round(statistics.mean(d), 2),
                "ms_per_request": round(sum(d) / requests / 1e3, 3),
            }
            for name, d in top[:40]
        ],  # fmt: skip
    }


def engine_part(checkpoint: str, job, args, out: Path, say) -> dict:
    import torch

    from python_backend_lib.engine.loading import EngineSetup
    from python_backend_lib.transcription.pipeline import Pipeline

    timings = instrument()
    pipeline = Pipeline.load(checkpoint, device=args.device, setup=EngineSetup(step_kernels=not args.pytorch_step_tail))
    try:
        for _ in range(args.warmup):
            one_request(pipeline, job)
        counts = pipeline.engine.batch.counts
        replays, graph_steps = counts.graph_replays, getattr(counts, "graph_steps", 0)
        timings.reset()
        walls, mels = [], []
        for _ in range(args.requests):
            mel, wall = one_request(pipeline, job)
            mels.append(mel)
            walls.append(wall)
        launches = (counts.graph_replays - replays) / args.requests
        # Earlier libraries took one step a launch and did not count steps apart.
        steps = (getattr(counts, "graph_steps", 0) - graph_steps) / args.requests or launches
        parts = timings.per_request(args.requests)
        say(f"engine alone: p50 {1e3 * statistics.median(walls):.2f} ms, {steps:.1f} graph steps "
            f"in {launches:.1f} launches per request")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if pipeline.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(args.profiled):
                one_request(pipeline, job)
        trace = out / "latency-breakdown-trace.json"
        profiler.export_chrome_trace(str(trace))
        with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
        kernels = kernel_summary(profiler, args.profiled, steps)
    finally:
        pipeline.close()
    return {
        "requests": args.requests,
        "latency_ms": percentile_summary(walls),
        "log_mel_ms": round(1e3 * statistics.median(mels), 3),
        "graph_steps_per_request": steps,
        "graph_launches_per_request": launches,
        "engine_thread": parts,
        "kernels": kernels,
    }


def launches_line(engine: dict) -> str:
    """How many launches took the steps, where runs (`engine.overlap`) took several a launch."""
    launches = engine.get("graph_launches_per_request")
    return "" if launches in (None, engine["graph_steps_per_request"]) else f", in {launches} launches"


def served_part(checkpoint: str, job, args, say) -> dict:
    from bench.latency_rounds import one_clip_rounds

    log = STATE_DIR / "latency-breakdown-server.log"
    trace_file = STATE_DIR / "latency-breakdown-trace.json"
    for old in trace_files(trace_file):
        old.unlink()
    (measured,) = one_clip_rounds(checkpoint, job, log, args.served_seconds, rounds=1, trace_file=trace_file)
    stats = measured.stats
    say(f"served: {stats.goodput_per_s:.1f} req/s, p50 {stats.latency_ms['p50']} ms")
    record = {"requests_per_s": round(stats.goodput_per_s, 2), "latency_ms": stats.latency_ms,
              "models": measured.models, "whisper_phases": measured.phases["whisper"],
              "preprocessing_phases": measured.phases["preprocessing"]}  # fmt: skip
    try:  # the last of them only by a server that stopped within Triton's exit timeout
        record["trace"] = asdict(timeline(read_trace(trace_file), "transcribe", measured.request_ids))
    except FileNotFoundError:
        record["trace_missing"] = f"Triton wrote no trace file at {trace_file} (see {log})"
        say(record["trace_missing"])
    return record


def library_record() -> dict:
    """Which library's engine ran: {} for this repository's; for another checkout's, run from
    that checkout's folder (`cd DIR && PYTHONPATH=REPO python -m bench.latency_breakdown ...`,
    where Python finds DIR's library first), its folder and the commit beside it (COMMIT)."""
    import python_backend_lib
    from loadtest.provenance import REPO_ROOT

    folder = Path(python_backend_lib.__file__).resolve().parents[1]
    return {} if folder == REPO_ROOT else checkout_record(folder)


def models_markdown(models: dict, client_p50_ms: float) -> list[str]:
    """Triton's statistics of the measured window: each model's mean time queued and in execute()."""
    lines = ["Triton's statistics over the measured window (`get_inference_statistics`), per request: "
             "means, where the client's figure is a median.", "",
             "| model | requests | batches | queued ms | execute ms |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {name} | {m['requests']} | {m['executions']} | {m['queue_ms']} | {m['execute_ms']} |"
              for name, m in models.items()]  # fmt: skip
    composing = sum(m["queue_ms"] + m["execute_ms"] for name, m in models.items() if name != "transcribe")
    lines += ["", f"The composing models' queue and execute times add up to {composing:.2f} ms of the client's "
              f"p50 {client_p50_ms} ms. preprocessing and whisper answer from threads of their own after `execute` "
              "returns (the audio decoded and its log-mel made; the window decoded), so the rest holds that work as "
              "well as the hops between the models, the ensemble, the transport and the client: the trace below "
              "places each model's answer by the next model's queueing."]  # fmt: skip
    return lines


def library_line(library: dict) -> list[str]:
    if not library:
        return []
    return ["", f"The engine of another checkout: {library['checkout']}, commit {library.get('checkout_commit', '?')}."]


# Each model's phases as the breakdown's tables show them (`bench.model_phases`).
PHASE_LABELS = {
    "whisper": [("from reaching the model to its answer written", "request_ms"),
                ("a window's way into the decode batch (a slot, its encoder pass started; on the CPU, run)",
                 "queue_wait_ms"),
                ("the answer's way from the engine's result to Triton (a responder's wait, the outputs written, "
                 "the send)", "answer_ms")],
    "preprocessing": [("from execute taking the request to its answer handed to Triton", "request_ms"),
                      ("its file decoded (with the wait for a decoding thread)", "decode_ms"),
                      ("its call's log-mels, from the call's last file decoded", "log_mel_ms"),
                      ("its answer's send, from the log-mel ready", "send_ms")],
}  # fmt: skip


def phases_markdown(phases: dict, model: str = "whisper") -> list[str]:
    """A model's phases over the window (`bench.model_phases`), means per request."""
    lines = [f"Means over the window's {phases['requests']:.0f} requests (`{model}_*` histograms).", "",
             "| phase | ms |", "|---|---|"]  # fmt: skip
    return lines + [f"| {label} | {phases[key]} |" for label, key in PHASE_LABELS[model] if key in phases]


def report(record: dict) -> str:
    engine = record["engine"]
    lines = [
        f"# Latency of one {record['clip_s']} s clip at concurrency 1: `{record['model']}`",
        "",
        f"Commit {record['commit']}, {record['machine']}. Command: `{record['command']}`.",
        *library_line(record.get("library", {})),
        "",
        f"Engine alone ({record.get('step_tail', 'pytorch')} step tail): p50 {engine['latency_ms']['p50']} ms, "
        f"p99 {engine['latency_ms']['p99']} ms over {engine['requests']} requests, "
        f"one at a time; log-mel {engine['log_mel_ms']} ms; {engine['graph_steps_per_request']} graph steps each"
        f"{launches_line(engine)}.",
    ]
    if "served" in record:
        served = record["served"]
        lines.append(f"Served (gRPC, `transcribe`): p50 {served['latency_ms']['p50']} ms, "
                     f"p99 {served['latency_ms']['p99']} ms.")  # fmt: skip
        if "models" in served:
            lines += ["", "## The served request, by Triton's statistics", "",
                      *models_markdown(served["models"], served["latency_ms"]["p50"])]  # fmt: skip
        if served.get("preprocessing_phases", {}).get("requests"):
            lines += ["", "## Inside the preprocessing model, by its own metrics", "",
                      *phases_markdown(served["preprocessing_phases"], "preprocessing")]
        if "whisper_phases" in served:
            lines += ["", "## Inside the whisper model, by its own metrics", "", *phases_markdown(served["whisper_phases"])]
        if "trace" in served:
            line = Timeline.from_record(served["trace"])
            lines += ["", "## The served request, by Triton's trace", "", *markdown(line, served["latency_ms"]["p50"])]
        elif "trace_missing" in served:
            lines += ["", f"No trace: {served['trace_missing']}."]
    lines += ["", "## The engine thread, per request", "", "| part | calls | ms | ms per call |", "|---|---|---|---|"]
    lines += [
        f"| {label} | {v['calls']} | {v['ms']} | {v['ms_per_call']} |" for label, v in engine["engine_thread"].items()
    ]
    k = engine["kernels"]
    lines += ["", "## GPU kernels, per request (torch.profiler)", "",
              f"{k['kernels_per_request']} kernels ({k['kernels_per_step']} per graph step); the GPU busy "
              f"{k['gpu_busy_ms_per_request']} ms (kernel time summed: {k['kernel_ms_per_request']} ms).", "",
              "| kernel | per request | us each | ms per request |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| `{t['name']}` | {t['per_request']} | {t['us_each']} | {t['ms_per_request']} |" for t in k["top"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from loadtest.provenance import provenance

    parser = argparse.ArgumentParser(prog="python -m bench.latency_breakdown", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--tokens-per-second", type=float, help="forced lengths of random-weight models")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--profiled", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    parser.add_argument("--served", action="store_true", help="also measure the request through the server")
    parser.add_argument("--served-seconds", type=float, default=10.0)
    parser.add_argument("--pytorch-step-tail", action="store_true",
                        help="the engine without its fused step kernels (EngineSetup.step_kernels=False), to compare")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    def say(message: str) -> None:
        print(f"[latency-breakdown] {message}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    spec = MODELS[args.model]
    checkpoint = served_checkpoint(spec)
    job = latency_job(make_jobs(spec, checkpoint, args.tokens_per_second, Settings()))
    made = provenance()
    machine = made["machine"]
    record = {
        "model": args.model,
        "clip_s": job.audio.clip.duration_s,
        "commit": (made["commit"] or "?")[:10] + (" (changed)" if made["dirty"] else ""),
        "machine": f"{machine.get('gpu')}, {machine['cpu_count']} CPUs",
        "command": made["command"],
        "step_tail": "pytorch" if args.pytorch_step_tail else "fused",
        "library": library_record(),
        "provenance": made,
        "engine": engine_part(checkpoint, job, args, args.out, say),
    }
    if args.served:
        record["served"] = served_part(checkpoint, job, args, say)
    (args.out / "latency-breakdown.json").write_text(json.dumps(record, indent=1, default=str))
    (args.out / "latency-breakdown.md").write_text(report(record))
    print(report(record))


if __name__ == "__main__":
    main()
