"""transformers' `WhisperForConditionalGeneration.generate` on the benchmark's jobs, as a competent user runs it.

Half precision with PyTorch SDPA attention on a GPU (float32 on the CPU, where
half precision is not what anyone runs), greedy, without temperature fallback.
What a user who wants throughput does, each tried and each reported:
- clips sorted by length and batched in that order, so that a batch's
  transcripts end close together (static batching runs until its longest ends);
- features on the GPU (`WhisperFeatureExtractor(device="cuda")`, which runs the
  STFT there: the fastest feature path transformers offers), timed with the batch;
- timestamps on (as the server answers) and off, each a variant of its own;
- a static KV cache with `torch.compile` (`reduce-overhead`: CUDA graphs), at
  `compile_sizes` only, since each batch size compiles again;
- at least `min_batches` timed batches per size, after a warm-up batch.
A variant's rows report "with feature extraction" and "generate alone"; its
best is quoted. Forced lengths (random weights): each batch decodes the longest
forced length among its rows. A batch size that runs out of GPU memory is
recorded and ends that variant's sweep.
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
MIN_TIMED_BATCHES = 5


@dataclass(frozen=True)
class TransformersPlan:
    checkpoint_dir: Path  # a Hugging Face-format folder
    device: str
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    min_batches: int = MIN_TIMED_BATCHES
    budget_s_per_size: float = 30.0  # stop a size after this long (at least one batch is timed)
    compile_sizes: tuple[int, ...] = (64, 256)  # static cache + torch.compile at these sizes (GPU only)


@dataclass(frozen=True)
class Variant:
    """One way of calling `generate`."""

    timestamps: bool
    compile_mode: str | None = None  # a static cache and torch.compile(mode=...); None: eager, dynamic cache

    @property
    def name(self) -> str:
        cache = f"static cache + torch.compile({self.compile_mode})" if self.compile_mode else "dynamic cache, eager"
        return f"{cache}, timestamps {'on' if self.timestamps else 'off'}"


def variants_for(jobs: list[Job], plan: TransformersPlan) -> list[Variant]:
    """Timestamps as the server decodes them first, then the other way (real weights only: forced
    lengths do not depend on them); on a GPU, compiled without timestamps (the faster setting),
    with CUDA graphs and without."""
    served = jobs[0].options.decoding.timestamps
    forced = jobs[0].check.expected_tokens is not None
    variants = [Variant(served)] + ([] if forced else [Variant(not served)])
    if plan.device.startswith("cuda") and plan.compile_sizes:
        variants += [Variant(False, "reduce-overhead"), Variant(False, "default")]
    return variants


def sorted_by_length(jobs: list[Job]) -> list[Job]:
    return sorted(jobs, key=lambda j: j.audio.clip.duration_s)


def run_transformers(jobs: list[Job], plan: TransformersPlan, say, deadline: float) -> dict:
    import torch
    import transformers

    rows = []
    for variant in variants_for(jobs, plan):
        if time.monotonic() >= deadline:
            say(f"transformers: out of time before {variant.name}")
            break
        # torch.compile of generate can crash the interpreter: a compiled variant runs in a process of its own
        run = _variant_in_child if variant.compile_mode else _variant_rows
        rows += run(jobs, plan, variant, say, deadline)
    measured = [r for r in rows if "error" not in r]
    best = max(measured, key=lambda r: r["rtfx"], default=None)
    best_generate = max(measured, key=lambda r: r["generate_rtfx"], default=None)
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float16" if plan.device.startswith("cuda") else "float32",
        "attention": "sdpa",
        "feature_extraction": f"WhisperFeatureExtractor(device={plan.device.split(':')[0]!r})",
        "decoding": "greedy, no fallback, clips sorted by length into batches",
        "variants": [v.name for v in variants_for(jobs, plan)],
        "rows": rows,
        "best": {"batch": best["batch"], "variant": best["variant"], "rtfx": best["rtfx"]} if best else None,
        "best_generate": {"batch": best_generate["batch"], "variant": best_generate["variant"],
                          "rtfx": best_generate["generate_rtfx"]} if best_generate else None,
    }


def _variant_rows(jobs: list[Job], plan: TransformersPlan, variant: Variant, say, deadline: float) -> list[dict]:
    """One variant over its batch sizes (the compiled ones at `plan.compile_sizes` only)."""
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    on_cuda = plan.device.startswith("cuda")
    dtype = torch.float16 if on_cuda else torch.float32
    model = WhisperForConditionalGeneration.from_pretrained(
        plan.checkpoint_dir, dtype=dtype, attn_implementation="sdpa"
    ).to(plan.device).eval()
    if variant.compile_mode:
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, mode=variant.compile_mode, fullgraph=True)
    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    multilingual = bool(getattr(model.generation_config, "is_multilingual", False))
    eot = model.generation_config.eos_token_id
    ordered = sorted_by_length(jobs)
    rows = []
    for size in [s for s in plan.batch_sizes if not variant.compile_mode or s in plan.compile_sizes]:
        if time.monotonic() >= deadline:
            say(f"transformers: out of time before {variant.name}, batch {size}")
            break
        try:
            row = _run_size(model, extractor, ordered, size, plan, multilingual, eot, dtype, deadline,
                            variant.timestamps)
        except torch.cuda.OutOfMemoryError as error:
            row = {"batch": size, "error": f"out of memory: {str(error).splitlines()[0]}"}
        except Exception as error:  # a compiled variant that fails is recorded; the others stand
            if not variant.compile_mode:
                raise
            row = {"batch": size, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        row = {"variant": variant.name, **row}
        rows.append(row)
        say(f"transformers ({variant.name}): batch {size}: " + (row.get("error") or
            f"RTFx {row['rtfx']} with feature extraction, {row['generate_rtfx']} generate alone, "
            f"{row['batches']} batches, {row['mean_tokens']} tokens per request"))
        if "error" in row:
            break
    del model
    if on_cuda:
        torch.cuda.empty_cache()
    return rows


def _variant_in_child(jobs: list[Job], plan: TransformersPlan, variant: Variant, say, deadline: float) -> list[dict]:
    """`_variant_rows` in a spawned process (`say` is passed by reference: a module's function); a crash
    or a hang past the deadline becomes an error row."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_report_variant, args=(jobs, plan, variant, say, deadline, results))
    child.start()
    try:
        return results.get(timeout=max(1.0, deadline - time.monotonic()))
    except Exception:  # queue.Empty: it died or ran out of time
        child.kill()
        child.join()
        row = {"variant": variant.name, "batch": plan.compile_sizes[0],
               "error": f"the process ended without results (exit code {child.exitcode})"}
        say(f"transformers ({variant.name}): {row['error']}")
        return [row]
    finally:
        child.join(timeout=10)


def _report_variant(jobs: list[Job], plan: TransformersPlan, variant: Variant, say, deadline: float,
                    results) -> None:
    results.put(_variant_rows(jobs, plan, variant, say, deadline))


def _run_size(model, extractor, jobs, size, plan, multilingual, eot, dtype, deadline, timestamps: bool) -> dict:
    """`plan.min_batches` or more batches of `size` consecutive jobs (in the order given, wrapping around)."""
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

    batches = max(plan.min_batches, math.ceil(len(jobs) / size))
    if plan.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if getattr(model.generation_config, "cache_implementation", None) == "static":
        for _ in range(2):  # compiled: the first full batch compiles, the second records the CUDA graphs
            generate(features(batch_of(0)), batch_of(0))
    else:
        generate(features(batch_of(0)), batch_of(0), forced_cap=WARMUP_NEW_TOKENS)
    sync()
    feature_s = generate_s = audio_s = 0.0
    requests = tokens = 0
    started = time.monotonic()
    timed = 0
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
        timed += 1
        sequences = out.sequences if hasattr(out, "sequences") else out
        tokens += int((sequences < eot).sum())
        now = time.monotonic()
        if (timed >= plan.min_batches and now - started > plan.budget_s_per_size) or now >= deadline:
            break
    return {
        "batch": size,
        "batches": timed,
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
