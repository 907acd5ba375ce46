"""Where a window's admission time goes on a GPU: the captured encoder pass (the
encoder and the decoder's cross-attention K/V, as the engine admits clips), per
admission size, per precision, with its achieved TFLOP/s and its kernels by kind.

    python -m bench.encoder_cost --models large-v3 large-v3-turbo --out /tmp/encoder-cost
    python -m bench.encoder_cost --models large-v3-turbo --variants fp8 --sizes 16 24 32 \
        --encoder-attention flashinfer --out /tmp/encoder-cost    # larger passes, as fp8 serves

Random weights of the real shapes (`random:<model>:0`). Variants:
- `float16`: as the engine ships (`Pipeline.load` on a GPU);
- `bfloat16`: the same in bfloat16, what the FP8 variant keeps outside its products;
- `fp8`: `--quantize fp8` (`engine.fp8_linear`).

Each admission size (`--sizes`; the engine captures up to `ENCODER_BUCKETS`) is one
captured graph (`engine.encoder_graphs`), its self-attention through `--encoder-attention`
(SDPA unless named; fp8 serves with FlashInfer's), replayed REPEATS times between two
CUDA events after WARMUP replays. The kernels of one pass of PROFILED clips (or of the
largest size, where PROFILED is not among them) are summed by kind from the PyTorch
profiler. FLOPs count the matrix
products and the attention (multiply-adds as two), as the ceiling in
docs/performance.md does. Writes `<out>/encoder-cost.json` and `.md`.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.markdown import markdown_table
from loadtest.provenance import provenance
from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core.encoder_kernel import EncoderKernel
from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.core.model_facts import ModelDims
from python_backend_lib.core.quantization import Quantization
from python_backend_lib.engine.encoder_graphs import EncoderGraphs
from python_backend_lib.engine.kv_cache import KVSlotPool, PoolShape
from python_backend_lib.engine.model import Whisper

CUDA = torch.device("cuda")
SIZES = (1, 2, 4, 8, 16)
PROFILED = 16  # the pass whose kernels are summed, as the large-models record compares them
WARMUP, REPEATS = 3, 20
VARIANTS = {
    "float16": (torch.float16, Quantization.NONE),
    "bfloat16": (torch.bfloat16, Quantization.NONE),
    "fp8": (torch.bfloat16, Quantization.FP8),
}
# Kernel names to kinds, first match wins (lower-cased substrings).
KINDS = (
    ("fp8 input quantization", ("_quantize_rows",)),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matrix products", ("gemm", "sm90", "cutlass", "matmul", "cublas", "nvjet", "xmma")),
    ("convolutions", ("conv", "implicit_convolve", "winograd")),
    ("layer norms", ("layer_norm", "layernorm")),
)


def window_flops(dims: ModelDims) -> float:
    """Multiply-adds x 2 of one window: the convolutions, every encoder layer's products
    and attention, and the decoder's cross-attention K/V projections."""
    width, positions = dims.n_audio_state, dims.n_audio_ctx
    convolutions = 2 * 3 * (dims.n_mels * width * N_FRAMES + width * width * positions)
    layer = 2 * positions * 12 * width * width + 2 * 2 * positions * positions * width
    cross = dims.n_text_layer * 2 * 2 * positions * width * dims.n_text_state
    return convolutions + dims.n_audio_layer * layer + cross


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    for kind, needles in KINDS:
        if any(needle in name for needle in needles):
            return kind
    return "elementwise and copies"


TOP_KERNELS = 16


def kernel_shares(graphs: EncoderGraphs, batch: int, mel: torch.Tensor) -> tuple[dict[str, float], list[dict]]:
    """Device milliseconds of one pass at `batch`, by kind of kernel; and the
    TOP_KERNELS kernels that took longest (name, launches, milliseconds)."""
    slots = list(range(1, batch + 1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        graphs.run(mel, slots, replay=False)
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    kernels = []
    for event in profile.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us and event.key and not event.key.startswith(("cudaGraph", "Memcpy", "Memset", "aten::")):
            totals[kind_of(event.key)] += device_us / 1e3
            kernels.append({"kernel": event.key[:140], "launches": event.count, "ms": round(device_us / 1e3, 3)})
    kernels.sort(key=lambda k: -k["ms"])
    shares = {kind: round(ms, 3) for kind, ms in sorted(totals.items(), key=lambda item: -item[1])}
    return shares, kernels[:TOP_KERNELS]


def time_sizes(graphs: EncoderGraphs, dims: ModelDims, dtype: torch.dtype) -> list[dict]:
    records = []
    for batch in graphs.buckets:
        mel = torch.randn(batch, dims.n_mels, N_FRAMES, device=CUDA, dtype=dtype)
        slots = list(range(1, batch + 1))
        for _ in range(WARMUP):
            graphs.run(mel, slots)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(REPEATS):
            graphs.run(mel, slots)
        end.record()
        end.synchronize()
        ms = begin.elapsed_time(end) / REPEATS
        records.append({
            "batch": batch, "ms_per_pass": round(ms, 3), "ms_per_window": round(ms / batch, 3),
            "tflops": round(window_flops(dims) * batch / (ms / 1e3) / 1e12, 1),
        })
    return records


def measure(name: str, variant: str, checkpoint, say, sizes: tuple[int, ...] = SIZES,
            kernel: EncoderKernel = EncoderKernel.SDPA) -> dict:
    dtype, quantization = VARIANTS[variant]
    dims = checkpoint.config.dims
    model = Whisper.from_checkpoint(checkpoint, device=CUDA, dtype=dtype, quantization=quantization)
    pool = KVSlotPool(PoolShape.for_model(dims, max(sizes)), device=CUDA, dtype=dtype)
    graphs = EncoderGraphs(model, pool, buckets=sizes, kernel=kernel)
    graphs.capture()
    timed = time_sizes(graphs, dims, dtype)
    profiled = PROFILED if PROFILED in sizes else max(sizes)
    mel = torch.randn(profiled, dims.n_mels, N_FRAMES, device=CUDA, dtype=dtype)
    shares, kernels = kernel_shares(graphs, profiled, mel)
    for record in timed:
        say(f"{name} {variant:8s} batch {record['batch']:2d}: {record['ms_per_pass']:8.3f} ms a pass, "
            f"{record['ms_per_window']:6.3f} ms a window, {record['tflops']:6.1f} TFLOP/s")
    say(f"{name} {variant:8s} kernels at batch {profiled} (ms): {shares}")
    for top in kernels:
        say(f"    {top['ms']:8.3f} ms {top['launches']:5d} x {top['kernel']}")
    del graphs, pool, model
    gc.collect()
    torch.cuda.empty_cache()
    return {"model": name, "variant": variant, "encoder_attention": kernel.value, "sizes": timed,
            "profiled_batch": profiled, "kernels_at_largest_ms": shares, "top_kernels": kernels,
            "gflop_per_window": round(window_flops(dims) / 1e9, 1)}


def write_markdown(out: Path, data: dict) -> None:
    rows = [
        [r["model"], r["variant"], s["batch"], s["ms_per_pass"], s["ms_per_window"], s["tflops"]]
        for r in data["runs"] for s in r["sizes"]
    ]
    kinds = sorted({kind for r in data["runs"] for kind in r["kernels_at_largest_ms"]})
    shares = [[r["model"], r["variant"], r["profiled_batch"], *(r["kernels_at_largest_ms"].get(k, 0.0) for k in kinds)]
              for r in data["runs"]]
    machine = data["provenance"]["machine"]
    text = "\n".join([
        "# The encoder's pass per admission size",
        "",
        f"{machine}; commit {data['provenance']['commit']}; `{data['provenance']['command']}`.",
        "",
        markdown_table(["model", "variant", "clips", "ms a pass", "ms a window", "TFLOP/s"], rows),
        "",
        "Device milliseconds of one profiled pass, by kind of kernel:",
        "",
        markdown_table(["model", "variant", "clips", *kinds], shares),
        "",
    ])
    (out / "encoder-cost.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["large-v3", "large-v3-turbo"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="admission sizes, each one captured pass")
    parser.add_argument("--encoder-attention", default=EncoderKernel.SDPA.value, choices=[k.value for k in EncoderKernel])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    sizes, kernel = tuple(sorted(set(args.sizes))), EncoderKernel(args.encoder_attention)
    start = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {message}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    data = {"provenance": provenance(), "runs": []}
    for name in args.models:
        say(f"{name}: random weights")
        checkpoint = load_checkpoint(f"random:{name}:0")
        for variant in args.variants:
            data["runs"].append(measure(name, variant, checkpoint, say, sizes, kernel))
            (args.out / "encoder-cost.json").write_text(json.dumps(data, indent=1))
    write_markdown(args.out, data)
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
