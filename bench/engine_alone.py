"""The library's engine alone on the benchmark's jobs: `Pipeline.start`, every request at once.

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
    min_requests: int  # the timed run repeats the jobs until at least this many


def run_engine(jobs: list[Job], plan: EnginePlan, say) -> dict:
    import torch

    from python_backend_lib.transcription.pipeline import Pipeline

    started = time.monotonic()
    pipeline = Pipeline.load(plan.checkpoint, device=plan.device)
    load_s = time.monotonic() - started
    say(f"engine: {plan.checkpoint} on {pipeline.device}, {pipeline.engine.slots} slots, loaded in {load_s:.1f} s")
    try:
        warm = _run_all(pipeline, jobs)  # warm-up: every job once
        say(f"engine: warm-up of {len(jobs)} requests in {warm['wall_s']:.2f} s")
        rounds = math.ceil(plan.min_requests / len(jobs))
        on_cuda = pipeline.device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        timed = _run_all(pipeline, jobs * rounds)
        peak = torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None
    finally:
        pipeline.close()
    audio_s = sum(j.audio.clip.duration_s for j in jobs) * rounds
    record = {
        "checkpoint": plan.checkpoint,
        "device": plan.device,
        "slots": pipeline.engine.slots,
        "log_mel": f"included (on the device, in the submitting thread, {FEATURE_BATCH} recordings per pass)",
        "audio_decoding": "excluded (waveforms decoded beforehand)",
        "load_s": round(load_s, 1),
        "requests": len(jobs) * rounds,
        "audio_s": round(audio_s, 1),
        "wall_s": round(timed["wall_s"], 3),
        "rtfx": round(audio_s / timed["wall_s"], 1),
        "requests_per_s": round(len(jobs) * rounds / timed["wall_s"], 2),
        "latency_ms": timed["latency_ms"],
        "mean_tokens": timed["mean_tokens"],
        "tokens_per_audio_s": round(timed["tokens"] / audio_s, 3),
        "fallbacks": timed["fallbacks"],
        "long_samples": timed["long_samples"],
        "bad_transcripts": timed["bad"],
        "problems": timed["problems"],
        "failed": timed["bad"] > 0,
        "peak_memory_gib": round(peak, 2) if peak is not None else None,
    }
    say(f"engine: {record['requests']} requests, RTFx {record['rtfx']}, {record['requests_per_s']} req/s, "
        f"{record['mean_tokens']} tokens per request, {timed['bad']} bad transcripts")
    return record


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

    start = time.monotonic()
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
        "wall_s": wall,
        "latency_ms": percentile_summary([finished_at[i] - start for i in range(len(jobs))]),
        "tokens": tokens,
        "mean_tokens": round(tokens / len(jobs), 2),
        "fallbacks": fallbacks,
        "long_samples": long_samples,
        "bad": bad,
        "problems": problems,
    }
