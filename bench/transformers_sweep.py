"""transformers' `WhisperForConditionalGeneration.generate` on the benchmark's jobs, batch sizes 1 to 256.

Half precision with PyTorch SDPA attention on a GPU (float32 on the CPU, where
half precision is not what anyone runs), greedy, without temperature
fallback, with timestamp tokens as the jobs ask (real weights: on, as served;
forced lengths: off). The jobs are taken in order, repeated as needed, in
batches of each size; each batch is timed in two parts: feature extraction
(`WhisperFeatureExtractor` with its `device` option, which runs the STFT on the
GPU: the fastest way transformers offers) and `generate`. A batch size reports
both "with feature extraction" and "generate alone". Forced lengths (random
weights): each batch decodes the longest forced length among its rows, as
static batching does with real speech, whose batch runs until its longest
transcript ends. A batch size that runs out of GPU memory is recorded and
ends the sweep.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from bench.jobs import Job
from python_backend_lib.core.geometry import SAMPLE_RATE

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WARMUP_NEW_TOKENS = 4  # a short generate at each batch size first: kernels and allocator warm


@dataclass(frozen=True)
class TransformersPlan:
    checkpoint_dir: Path  # a Hugging Face-format folder
    device: str
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    min_batches: int = 2
    budget_s_per_size: float = 30.0  # stop a size after this long (at least one batch is timed)


def run_transformers(jobs: list[Job], plan: TransformersPlan, say, deadline: float) -> dict:
    import torch
    import transformers
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    on_cuda = plan.device.startswith("cuda")
    dtype = torch.float16 if on_cuda else torch.float32
    model = WhisperForConditionalGeneration.from_pretrained(
        plan.checkpoint_dir, dtype=dtype, attn_implementation="sdpa"
    ).to(plan.device).eval()
    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    multilingual = bool(getattr(model.generation_config, "is_multilingual", False))
    eot = model.generation_config.eos_token_id
    rows = []
    for size in plan.batch_sizes:
        if time.monotonic() >= deadline:
            say(f"transformers: out of time before batch {size}")
            break
        try:
            row = _run_size(model, extractor, jobs, size, plan, multilingual, eot, dtype, deadline)
        except torch.cuda.OutOfMemoryError as error:
            row = {"batch": size, "error": f"out of memory: {str(error).splitlines()[0]}"}
        rows.append(row)
        say(f"transformers: batch {size}: " + (row.get("error") or
            f"RTFx {row['rtfx']} with feature extraction, {row['generate_rtfx']} generate alone, "
            f"{row['requests']} requests, {row['mean_tokens']} tokens per request"))
        if "error" in row:
            break
        if on_cuda:
            torch.cuda.empty_cache()
    measured = [r for r in rows if "error" not in r]
    best = max(measured, key=lambda r: r["rtfx"], default=None)
    best_generate = max(measured, key=lambda r: r["generate_rtfx"], default=None)
    return {
        "transformers": transformers.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "attention": "sdpa",
        "feature_extraction": f"WhisperFeatureExtractor(device={plan.device.split(':')[0]!r})",
        "decoding": f"greedy, timestamps {'on' if jobs[0].options.decoding.timestamps else 'off'}, no fallback"
        + ("; language en" if multilingual else ""),
        "rows": rows,
        "best": {"batch": best["batch"], "rtfx": best["rtfx"]} if best else None,
        "best_generate": {"batch": best_generate["batch"], "rtfx": best_generate["generate_rtfx"]}
        if best_generate else None,
    }


def _run_size(model, extractor, jobs, size, plan, multilingual, eot, dtype, deadline) -> dict:
    import torch

    def sync() -> None:
        if plan.device.startswith("cuda"):
            torch.cuda.synchronize()

    def batch_of(first: int) -> list[Job]:
        return [jobs[(first + i) % len(jobs)] for i in range(size)]

    def features(batch: list[Job]):
        out = extractor([j.audio.waveform for j in batch], sampling_rate=SAMPLE_RATE, return_tensors="pt",
                        device=plan.device.split(":")[0])
        return out.input_features.to(plan.device, dtype)

    def generate(inputs, batch: list[Job], forced_cap: int | None = None):
        forced = [j.check.expected_tokens for j in batch if j.check.expected_tokens is not None]
        lengths = {}
        if forced:
            n = max(forced) if forced_cap is None else min(max(forced), forced_cap)
            lengths = {"min_new_tokens": n, "max_new_tokens": n}
        elif forced_cap is not None:
            lengths = {"max_new_tokens": forced_cap}
        language = {"language": "en", "task": "transcribe"} if multilingual else {}
        with torch.inference_mode():
            return model.generate(inputs, return_timestamps=timestamps, do_sample=False, num_beams=1,
                                  **language, **lengths)

    timestamps = jobs[0].options.decoding.timestamps  # as the server decodes them
    batches = max(plan.min_batches, math.ceil(len(jobs) / size))
    if plan.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    generate(features(batch_of(0)), batch_of(0), forced_cap=WARMUP_NEW_TOKENS)
    sync()
    feature_s = generate_s = audio_s = 0.0
    requests = tokens = 0
    started = time.monotonic()
    for b in range(batches):
        batch = batch_of(b * size)
        t0 = time.monotonic()
        inputs = features(batch)
        sync()
        t1 = time.monotonic()
        out = generate(inputs, batch)
        sync()
        t2 = time.monotonic()
        feature_s += t1 - t0
        generate_s += t2 - t1
        audio_s += sum(j.audio.clip.duration_s for j in batch)
        requests += len(batch)
        sequences = out.sequences if hasattr(out, "sequences") else out
        tokens += int((sequences < eot).sum())
        now = time.monotonic()
        if now - started > plan.budget_s_per_size or now >= deadline:
            break
    return {
        "batch": size,
        "requests": requests,
        "audio_s": round(audio_s, 1),
        "feature_s": round(feature_s, 3),
        "generate_s": round(generate_s, 3),
        "rtfx": round(audio_s / (feature_s + generate_s), 1),
        "generate_rtfx": round(audio_s / generate_s, 1),
        "requests_per_s": round(requests / (feature_s + generate_s), 2),
        "mean_tokens": round(tokens / requests, 2),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if plan.device.startswith("cuda") else None,
    }
