"""The library's transcript of every benchmark clip, each decoded alone on the benchmark's
device before the servers start: what every served answer is compared with
(`transcripts.TranscriptCheck.reference`)."""

from __future__ import annotations

import dataclasses
import gc
import time

from bench.jobs import Job

REFERENCE_SLOTS = 16  # one clip at a time needs few; the rest of the GPU stays free for the servers


def with_references(jobs: list[Job], checkpoint: str, device: str, say) -> list[Job]:
    """The jobs, each checked against the library's transcript of its clip (real weights only:
    forced lengths of random weights are checked by their token count, free ones by their form)."""
    if any(job.check.expected_tokens is not None or job.check.free_length for job in jobs):
        return jobs
    import torch

    from python_backend_lib.engine.loading import EngineSetup
    from python_backend_lib.transcription.pipeline import Pipeline

    started = time.monotonic()
    pipeline = Pipeline.load(checkpoint, device=device, setup=EngineSetup(slots=REFERENCE_SLOTS))
    try:
        texts = [pipeline.transcribe(job.audio.waveform, job.options).text for job in jobs]
    finally:
        pipeline.close()
        del pipeline
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    say(f"the library's transcripts of {len(jobs)} clips on {device}, one at a time, "
        f"in {time.monotonic() - started:.0f} s")
    return [dataclasses.replace(job, check=dataclasses.replace(job.check, reference=text))
            for job, text in zip(jobs, texts)]
