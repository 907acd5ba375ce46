"""GPU benchmark: transformers' generate against our engine, eager and with
CUDA graphs (the served path end to end is `bench.served`).

    python -m bench.gpu --models tiny large-v3 --sections steps offline encoder --out docs/benchmarks

Writes `<out>/gpu.json` as it goes (each finished measurement is kept if a
later one fails), then `gpu.md` and `gpu.png` (see `bench.report`). Random
weights with the real shapes; every request decodes a forced number of tokens
(min_new_tokens = max_new_tokens), so all systems do the same work.

Offline runs submit every request at time 0 and report, per request, the time
from then to its result. Features (log-mel) are computed beforehand.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import platform
import pstats
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from bench.workloads import Workload, librispeech_like, long_clips, noise
from python_backend_lib.audio.features import window_features
from python_backend_lib.checkpoints.hf_folder import hf_config_json, hf_generation_json
from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core.options import DecodingOptions
from python_backend_lib.engine.batch import DecodeBatch
from python_backend_lib.engine.kv_cache import KVSlotPool, PoolShape
from python_backend_lib.engine.loading import DEFAULT_KV_MEMORY_FRACTION, gpu_slots
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.prompt import initial_tokens
from python_backend_lib.engine.rows import Admission
from python_backend_lib.engine.scheduler import Engine, EngineOptions

CUDA = torch.device("cuda")
DTYPE = torch.float16
DISTINCT_CLIPS = 32  # feature tensors computed per workload, reused in turn
STEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HF_BATCH = 64
ENGINE_MAX_ADMIT = 64  # new requests encoded together


# ------------------------------------------------------------------ plumbing


class Progress:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", flush=True)


say = Progress()


@dataclass
class Results:
    path: Path
    data: dict = field(default_factory=dict)

    def add(self, section: str, record: dict) -> None:
        self.data.setdefault(section, []).append(record)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1))


def latency_summary(latencies_s: list[float]) -> dict:
    ms = np.array(latencies_s) * 1e3
    return {f"p{q}_ms": round(float(np.percentile(ms, q)), 2) for q in (50, 95, 99)}


def gib(n_bytes: float) -> float:
    return round(n_bytes / 2**30, 3)


def device_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gib": gib(props.total_memory),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def forced(tokens: int) -> DecodingOptions:
    return DecodingOptions(language="en", min_new_tokens=tokens, max_new_tokens=tokens)


def clip_features(workload: Workload, n_mels: int) -> list[torch.Tensor]:
    """Log-mel of the first DISTINCT_CLIPS clips (CPU), reused in turn."""
    return [
        window_features(noise(d, seed=i), n_mels).pin_memory()  # as a server's staging buffers would be
        for i, d in enumerate(workload.durations[:DISTINCT_CLIPS])
    ]


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ------------------------------------------------------------------ systems


def make_batch(model: Whisper, config, slots: int, graphs: bool) -> DecodeBatch:
    from python_backend_lib.engine.cuda_graphs import DecodeGraphs
    from python_backend_lib.engine.flashinfer_attention import FlashInferAttention

    pool = KVSlotPool(PoolShape.for_model(config.dims, slots), device=CUDA, dtype=DTYPE)
    attention = FlashInferAttention(pool)
    table = None
    if graphs:
        table = DecodeGraphs(model, config, attention, max_batch=slots)
        table.capture()
        say(f"  captured {len(table.buckets)} graphs up to batch {slots} in {table.capture_seconds:.2f} s, "
            f"{table.capture_bytes / 2**20:.0f} MiB")
    return DecodeBatch(model, config, attention, table)


def run_engine(batch: DecodeBatch, config, workload: Workload, features: list[torch.Tensor]) -> dict:
    engine = Engine(batch, config, None, EngineOptions(max_admit=ENGINE_MAX_ADMIT))
    options = forced(workload.tokens)
    finished = threading.Event()
    latencies: dict[int, float] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def on_done(i: int, start: float, outcome) -> None:
        with lock:
            if isinstance(outcome, BaseException):
                errors.append(outcome)
            elif len(outcome.tokens) != workload.tokens:
                errors.append(RuntimeError(f"request {i} decoded {len(outcome.tokens)} tokens"))
            latencies[i] = time.perf_counter() - start
            if len(latencies) == len(workload):
                finished.set()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(len(workload)):
        engine.submit(features[i % len(features)], options, lambda o, i=i: on_done(i, start, o))
    finished.wait()
    wall = time.perf_counter() - start
    engine.close()
    if errors:
        raise errors[0]
    return {"wall_s": wall, "latencies": [latencies[i] for i in range(len(workload))],
            "peak_memory_gib": gib(torch.cuda.max_memory_allocated())}


def hf_model(checkpoint):
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    config = checkpoint.config
    hf_config = WhisperConfig(**hf_config_json(config.dims, config.special))
    hf_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(hf_config)
    model.load_state_dict({f"model.{k}": v for k, v in checkpoint.state_dict.items()}, strict=False, assign=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(**hf_generation_json(config))
    return model.to(CUDA, DTYPE).eval()


def run_hf(model, workload: Workload, features: list[torch.Tensor]) -> dict:
    n = len(workload)
    latencies = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, n, HF_BATCH):
            rows = range(first, min(n, first + HF_BATCH))
            batch = torch.stack([features[i % len(features)] for i in rows]).to(CUDA, DTYPE)
            out = model.generate(
                batch, language="en", task="transcribe", return_timestamps=False, do_sample=False, num_beams=1,
                min_new_tokens=workload.tokens, max_new_tokens=workload.tokens,
            )
            torch.cuda.synchronize()
            latencies += [time.perf_counter() - start] * len(rows)
    wall = time.perf_counter() - start
    # transformers returns the generated tokens, with or without the 4 prompt tokens by version
    if not workload.tokens <= out.shape[1] <= workload.tokens + 5:
        raise RuntimeError(f"transformers returned {out.shape[1]} positions for {workload.tokens} forced tokens")
    return {"wall_s": wall, "latencies": latencies, "peak_memory_gib": gib(torch.cuda.max_memory_allocated())}


def engine_breakdown(batch: DecodeBatch, config, workload: Workload, features) -> dict:
    """Where an engine run's wall time goes: encoding (admit), steps, and the rest
    (engine loop, callbacks), through the batch's public calls; how the steps ran
    (eager passes, graph replays) from its counts. Admission is timed to a
    synchronize, which the timed runs do not do."""
    spent = {"admit": 0.0, "steps": 0.0}
    counts = {"admit": 0, "steps": 0}

    def timed(name, method, sync=False):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = method(*args, **kwargs)
            if sync:
                torch.cuda.synchronize()
            spent[name] += time.perf_counter() - start
            counts[name] += 1
            return out
        return wrapper

    batch.admit = timed("admit", batch.admit, sync=True)
    batch.step = timed("steps", batch.step)
    before = replace(batch.counts)
    try:
        run = run_engine(batch, config, workload, features)
    finally:
        for name in ("admit", "step"):
            del batch.__dict__[name]
    record = {
        "wall_s": round(run["wall_s"], 3),
        "eager_passes": batch.counts.eager_passes - before.eager_passes,
        "graph_replays": batch.counts.graph_replays - before.graph_replays,
    }
    for name in spent:
        record[f"{name}_s"] = round(spent[name], 3)
        record[f"{name}_calls"] = counts[name]
    record["other_s"] = round(run["wall_s"] - sum(spent.values()), 3)
    return record


def summarize(system: str, model: str, workload: Workload, run: dict, **extra) -> dict:
    wall = run["wall_s"]
    record = {
        "system": system,
        "model": model,
        "workload": workload.name,
        "requests": len(workload),
        "tokens_per_request": workload.tokens,
        "audio_s": round(workload.audio_seconds, 1),
        "wall_s": round(wall, 3),
        "rtfx": round(workload.audio_seconds / wall, 1),
        "requests_per_s": round(len(workload) / wall, 1),
        **latency_summary(run["latencies"]),
        "peak_memory_gib": run.get("peak_memory_gib"),
        **extra,
    }
    say(f"  {system:14s} {model:9s} {workload.name:17s} RTFx {record['rtfx']:8.1f}  "
        f"{record['requests_per_s']:7.1f} req/s  p50 {record['p50_ms']:8.1f} ms  p99 {record['p99_ms']:8.1f} ms")
    return record


# ------------------------------------------------------------------ sections


def time_steps(batch: DecodeBatch, config, features, n_rows: int, steps: int) -> dict:
    """Mean wall time of a decode step over n_rows rows (host work and the
    token readback included), and for graphs the GPU time of a replay alone."""
    options = forced(400)
    prompt = initial_tokens(config, options, None)
    batch.admit([Admission(("step", i), features[i % len(features)], options, prompt) for i in range(n_rows)])
    for _ in range(3):  # the prompt step, then decode steps
        batch.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        batch.step()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    record = {"batch": n_rows, "step_ms": round(wall_ms, 4)}
    if batch.graphs is not None:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(steps):
            batch.graphs.replay(n_rows)
        end.record()
        end.synchronize()
        record["replay_gpu_ms"] = round(begin.elapsed_time(end) / steps, 4)
    for row in list(batch.rows):
        batch.drop(row.tag)
    return record


def profile_graph_steps(batch: DecodeBatch, config, features, n_rows: int, out: Path, name: str) -> None:
    options = forced(400)
    prompt = initial_tokens(config, options, None)
    batch.admit([Admission(("prof", i), features[i % len(features)], options, prompt) for i in range(n_rows)])
    for _ in range(3):
        batch.step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(50):
        batch.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    with open(out, "a") as f:
        f.write(f"{name}: 50 graph decode steps of {n_rows} rows, sorted by own time\n{text.getvalue()}\n")
    for row in list(batch.rows):
        batch.drop(row.tag)


def model_sections(name: str, args, results: Results) -> None:
    say(f"model {name}: building random weights")
    checkpoint = load_checkpoint(f"random:{name}:0")
    config = checkpoint.config
    model = Whisper.from_checkpoint(checkpoint, device=CUDA, dtype=DTYPE)
    slots = gpu_slots(config.dims, DTYPE, CUDA, DEFAULT_KV_MEMORY_FRACTION)
    if args.quick:
        slots = min(slots, 64)
    scale = 0.25 if args.quick else 1.0
    workloads = [
        librispeech_like(int((512 if name == "tiny" else 256) * scale)),
        long_clips(int((256 if name == "tiny" else 128) * scale)),
    ]
    features = {w.name: clip_features(w, config.dims.n_mels) for w in workloads}
    say(f"model {name}: {slots} KV slots, {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters")

    if "offline" in args.sections:
        say(f"model {name}: transformers generate (fp16, sdpa, batches of {HF_BATCH})")
        hf = hf_model(checkpoint)
        run_hf(hf, Workload("warm-up", (5.0,) * 4, 4), features[workloads[0].name])
        for w in workloads:
            results.add("offline", summarize("hf-generate", name, w, run_hf(hf, w, features[w.name]), batch=HF_BATCH))
        del hf
        free_cuda()

    for graphs in (False, True):
        system = "engine-graphs" if graphs else "engine-eager"
        say(f"model {name}: {system}")
        batch = make_batch(model, config, slots, graphs)
        run_engine(batch, config, Workload("warm-up", (5.0,) * 8, 4), features[workloads[0].name])
        if "offline" in args.sections:
            for w in workloads:
                run = run_engine(batch, config, w, features[w.name])
                results.add("offline", summarize(system, name, w, run, slots=slots))
        if "offline" in args.sections:
            w = workloads[0]
            record = engine_breakdown(batch, config, w, features[w.name])
            results.add("breakdown", {"model": name, "system": system, "workload": w.name, **record})
            say(f"  breakdown {system} {w.name}: {record}")
        if "steps" in args.sections:
            f = features[workloads[0].name]
            for n_rows in [b for b in STEP_BATCHES if b <= slots]:
                record = time_steps(batch, config, f, n_rows, steps=10 if args.quick else 30)
                results.add("steps", {"model": name, "system": system, **record})
                say(f"  step {system:13s} batch {n_rows:4d}: {record['step_ms']:.3f} ms"
                    + (f" (replay on the GPU {record['replay_gpu_ms']:.3f} ms)" if "replay_gpu_ms" in record else ""))
            if graphs and args.profile_dir:
                profile_graph_steps(batch, config, f, min(64, slots), Path(args.profile_dir) / "profile.txt", name)
        if graphs:
            results.add("memory", {
                "model": name, "slots": slots,
                "kv_pool_gib": gib(PoolShape.for_model(config.dims, slots).bytes_per_slot(DTYPE) * (slots + 1)),
                "graphs_mib": round(batch.graphs.capture_bytes / 2**20, 1),
                "capture_s": round(batch.graphs.capture_seconds, 2),
                "buckets": list(batch.graphs.buckets),
                "weights_gib": gib(sum(p.numel() * p.element_size() for p in model.parameters())),
            })
        del batch
        free_cuda()

    if "encoder" in args.sections:
        encoder_kernels(name, config, results)
    del model
    free_cuda()


def encoder_kernels(name: str, config, results: Results) -> None:
    """The encoder's non-causal self-attention: SDPA against FlashInfer's ragged prefill."""
    from python_backend_lib.core.encoder_kernel import EncoderKernel
    from python_backend_lib.engine.flashinfer_attention import FlashInferAttention

    pool = KVSlotPool(PoolShape.for_model(config.dims, 1), device=CUDA, dtype=DTYPE)
    heads, head_dim = config.dims.n_audio_head, config.dims.n_audio_state // config.dims.n_audio_head
    for batch in (8, 32):
        q, k, v = (torch.randn(batch, config.dims.n_audio_ctx, heads, head_dim, device=CUDA, dtype=DTYPE) for _ in range(3))
        reference = None
        for kernel in (EncoderKernel.SDPA, EncoderKernel.FLASHINFER):
            attention = FlashInferAttention(pool, encoder=kernel)
            start = time.perf_counter()
            out = attention.encoder_attention(q, k, v)  # JIT on first use
            torch.cuda.synchronize()
            first_s = time.perf_counter() - start
            reference = out if reference is None else reference
            error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(20):
                attention.encoder_attention(q, k, v)
            end.record()
            end.synchronize()
            record = {"model": name, "kernel": kernel.value, "batch": batch, "heads": heads,
                      "ms": round(begin.elapsed_time(end) / 20, 4), "first_call_s": round(first_s, 2),
                      "relative_error_vs_sdpa": float(f"{error:.2e}")}
            results.add("encoder_attention", record)
            say(f"  encoder attention {name} batch {batch} {kernel.value:10s}: {record['ms']:.3f} ms "
                f"(first call {first_s:.1f} s, rel. error vs SDPA {error:.1e})")
            del attention
    free_cuda()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "large-v3"])
    parser.add_argument("--sections", nargs="+", default=["steps", "offline"],
                        choices=["steps", "offline", "encoder"])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--append", action="store_true", help="add to the JSON already in --out")
    parser.add_argument("--quick", action="store_true", help="fewer requests and slots: a smoke run")
    parser.add_argument("--profile-dir", type=Path, help="write a cProfile of graph decode steps here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu needs a CUDA GPU", file=sys.stderr)
        return 2
    path = args.out / "gpu.json"
    results = Results(path, json.loads(path.read_text()) if args.append and path.exists() else {})
    results.data["device"] = device_info()
    results.data["command"] = " ".join(sys.argv)
    for name in args.models:
        if set(args.sections) & {"steps", "offline", "encoder"}:
            try:
                model_sections(name, args, results)
            except Exception as error:  # keep what was measured; report the failure
                say(f"model {name} failed: {type(error).__name__}: {error}")
                results.add("failures", {"model": name, "error": f"{type(error).__name__}: {error}"})
                import traceback

                traceback.print_exc()
                free_cuda()
    from bench.report import write_report

    with contextlib.suppress(Exception):
        write_report(path, args.out)
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
