"""The library's engine alone on the benchmark's jobs: `Pipeline.start`, every request at once.

As many engine processes as the server runs on the GPU (`EnginePlan.processes`,
under CUDA MPS where the server uses it), so that "served over the engine alone"
compares like with like: each process loads its own `Pipeline` sized for that
many engines sharing the device, warms up, waits for the others, and runs the
jobs; the wall is from the first process's start to the last one's end.

What it includes: the log-mel (computed on the model's device in the
submitting thread, FEATURE_BATCH recordings per pass, as the served path's
preprocessing computes it), long-form bookkeeping and decoding (the whisper
model's part). What it leaves out: WAV decoding (the waveforms are decoded
beforehand), Triton, and the transcript's text and formats (postprocessing's
part, done here after the timing). Each answer is judged as a served one is
(`bench.transcripts`), from the same verbose_json record.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from bench.jobs import Job
from bench.stats import percentile_summary
from bench.transcripts import judge
from python_backend_lib.text.formats import Document

# Recordings per log-mel pass, as the preprocessing model gets them in one execute call
# at most (its max_batch_size): one request at a time would launch the STFT's kernels
# 2,000 times from the one submitting thread, and measure that thread.
FEATURE_BATCH = 64


@dataclass(frozen=True)
class EnginePlan:
    checkpoint: str
    device: str
    min_requests: int  # each process's timed run repeats the jobs until at least this many
    processes: int = 1  # engine processes on the device, each with its own Pipeline (as the server's instances)
    mps: bool = False  # run them under a CUDA MPS daemon of their own (as `serve --mps on` does)
    quantize: str = "none"  # `serve --quantize`'s value (`core.quantization`)


def run_engine(jobs: list[Job], plan: EnginePlan, say) -> dict:
    rounds = math.ceil(plan.min_requests / len(jobs))  # per process: each one as long as one engine alone
    if plan.processes == 1 and not plan.mps:
        parts = [_engine_process(jobs, plan, rounds, None)]
    else:
        parts = _in_processes(jobs, plan, rounds, say)
    for i, part in enumerate(parts):
        say(f"engine process {i}: {part['slots']} slots, loaded in {part['load_s']} s, "
            f"{part['requests']} requests in {part['wall_s']:.2f} s")
    wall = max(p["ended"] for p in parts) - min(p["started"] for p in parts)
    requests = sum(p["requests"] for p in parts)
    audio_s = sum(p["audio_s"] for p in parts)
    tokens = sum(p["tokens"] for p in parts)
    bad = sum(p["bad"] for p in parts)
    record = {
        "checkpoint": plan.checkpoint,
        "device": plan.device,
        "processes": plan.processes,
        "mps": plan.mps,
        "slots": parts[0]["slots"],  # per process
        "log_mel": f"included (on the device, in the submitting thread, {FEATURE_BATCH} recordings per pass)",
        "audio_decoding": "excluded (waveforms decoded beforehand)",
        "load_s": max(p["load_s"] for p in parts),
        "requests": requests,
        "audio_s": round(audio_s, 1),
        "wall_s": round(wall, 3),
        "rtfx": round(audio_s / wall, 1),
        "requests_per_s": round(requests / wall, 2),
        "latency_ms": parts[0]["latency_ms"],  # process 0's: from its first submission to each result
        "mean_tokens": round(tokens / requests, 2),
        "tokens_per_audio_s": round(tokens / audio_s, 3),
        "fallbacks": sum(p["fallbacks"] for p in parts),
        "long_samples": sum(p["long_samples"] for p in parts),
        "bad_transcripts": bad,
        "problems": [problem for p in parts for problem in p["problems"]][:5],
        "failed": bad > 0,
        "peak_memory_gib": max((p["peak_memory_gib"] for p in parts if p["peak_memory_gib"] is not None),
                               default=None),  # per process
    }
    say(f"engine: {plan.processes} process(es), {record['requests']} requests, RTFx {record['rtfx']}, "
        f"{record['requests_per_s']} req/s, {record['mean_tokens']} tokens per request, {bad} bad transcripts")
    return record


def _in_processes(jobs: list[Job], plan: EnginePlan, rounds: int, say) -> list[dict]:
    """`plan.processes` engine processes (spawned, as Triton's instances are separate processes),
    started together after every one has loaded and warmed up."""
    import multiprocessing
    import os

    from python_backend_lib.apps.mps import daemon_for

    daemon = daemon_for(True, 1, say) if plan.mps else None
    saved = dict(os.environ)
    try:
        if daemon is not None:
            os.environ.update(daemon.environ())  # the children connect to this daemon
        context = multiprocessing.get_context("spawn")
        ready, results = context.Barrier(plan.processes), context.Queue()
        workers = [context.Process(target=_report_engine_process, args=(i, jobs, plan, rounds, ready, results))
                   for i in range(plan.processes)]
        for worker in workers:
            worker.start()
        parts = dict(results.get() for _ in workers)
        for worker in workers:
            worker.join()
        failed = [part for part in parts.values() if isinstance(part, str)]
        if failed:
            raise RuntimeError(f"an engine process failed: {failed[0]}")
        return [parts[i] for i in range(plan.processes)]
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if daemon is not None:
            daemon.stop()


def _report_engine_process(index: int, jobs: list[Job], plan: EnginePlan, rounds: int, ready, results) -> None:
    try:
        results.put((index, _engine_process(jobs, plan, rounds, ready)))
    except BaseException as error:  # the parent raises it; the other processes are not left at the barrier
        ready.abort()
        results.put((index, f"{type(error).__name__}: {error}"))


def _engine_process(jobs: list[Job], plan: EnginePlan, rounds: int, ready) -> dict:
    """One engine: load, warm up on every job once, wait for the others (`ready`), run the jobs `rounds` times."""
    import torch

    from python_backend_lib.core.quantization import Quantization
    from python_backend_lib.devices.placement import single_threaded_host
    from python_backend_lib.engine.loading import EngineSetup
    from python_backend_lib.transcription.pipeline import Pipeline

    if ready is not None:
        single_threaded_host()  # as each served engine process runs
    started = time.monotonic()
    pipeline = Pipeline.load(plan.checkpoint, device=plan.device,
                             setup=EngineSetup(engines_on_device=plan.processes, quantization=Quantization(plan.quantize)))
    load_s = time.monotonic() - started
    try:
        _run_all(pipeline, jobs)  # warm-up: every job once
        on_cuda = pipeline.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        if ready is not None:
            ready.wait()
        timed = _run_all(pipeline, jobs * rounds)
        peak = torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None
    finally:
        pipeline.close()
    return {
        **timed,
        "slots": pipeline.engine.slots,
        "load_s": round(load_s, 1),
        "requests": len(jobs) * rounds,
        "audio_s": sum(j.audio.clip.duration_s for j in jobs) * rounds,
        "peak_memory_gib": round(peak, 2) if peak is not None else None,
    }


def _run_all(pipeline, jobs: list[Job]) -> dict:
    """Submit every job at once; wait for all. Latency: from the first submission to each result."""
    done = threading.Event()
    finished_at: dict[int, float] = {}
    lock = threading.Lock()

    def on_done(i: int, future) -> None:
        with lock:
            finished_at[i] = time.monotonic()
            if len(finished_at) == len(jobs):
                done.set()

    start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
    futures = []
    for first in range(0, len(jobs), FEATURE_BATCH):
        batch = jobs[first : first + FEATURE_BATCH]
        all_features = pipeline.features([job.audio.waveform for job in batch])
        for i, (job, features) in enumerate(zip(batch, all_features), start=first):
            future = pipeline.submit_decoded(features, len(job.audio.waveform), job.options)
            future.add_done_callback(lambda f, i=i: on_done(i, f))
            futures.append(future)
    done.wait()
    wall = max(finished_at.values()) - start
    tokens = fallbacks = long_samples = bad = 0
    problems: list[str] = []
    for job, future in zip(jobs, futures):  # the transcripts are written after the timing, as postprocessing would
        record = Document.from_transcript(pipeline.assemble(future.result()), job.options).verbose_record()
        verdict = judge(record, job.check)
        tokens += verdict.tokens
        fallbacks += verdict.fallback
        long_samples += verdict.long_sample
        if not verdict.ok:
            bad += 1
            if len(problems) < 5:
                problems.append(f"{job.audio.clip.name}: {verdict.problem}")
    return {
        "started": start,
        "ended": start + wall,
        "wall_s": wall,
        "latency_ms": percentile_summary([finished_at[i] - start for i in range(len(jobs))]),
        "tokens": tokens,
        "mean_tokens": round(tokens / len(jobs), 2),
        "fallbacks": fallbacks,
        "long_samples": long_samples,
        "bad": bad,
        "problems": problems,
    }
