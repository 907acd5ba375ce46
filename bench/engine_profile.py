"""Where a saturated GPU engine's time goes: the encoder's pass, the decoder's steps by
kind of kernel, both at once, and the GPU idle, from one profiled run.

    python -m bench.engine_profile --model large-v3 --quantize fp8 --tokens-per-second 2.728 --out OUT

The library's engine alone (`Pipeline`, no Triton) gets the benchmark's 96 clips
(random weights, forced lengths, as `bench.served` sends them) `--repeat` times over,
`--concurrency` requests kept in flight: once unprofiled, once under PyTorch's
profiler with CUDA kernels recorded (after a warm-up on the 96). The kernels' timeline is then cut by stream: admissions
encode on the side stream (`engine.side_encoding`: the encoder and each window's
cross-attention K/V), decoder steps on the engine thread's stream. Reported, as
shares of the profiled run's wall time:
- the time each stream had a kernel running, the time both had, and the time neither
  had (the GPU idle: the engine thread's host work and waits not hidden behind kernels);
- each stream's kernel time by kind (the decoder's attention split into self- and
  cross-attention by order: each layer runs FlashInfer's decode kernel for its
  self-attention, then for its cross-attention);
- decoder steps counted from those kernels, and the mean rows a step (each request
  feeds its prompt and its forced tokens one a step);
- each stream's kernels that took longest, with their launches and time a launch
  (in the JSON).
The profiler slows the host a little: the run's RTFx is reported beside the same
run unprofiled. Writes `<out>/engine-profile.json` and `.md`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.clips import load_clips
from bench.encoder_cost import kind_of as encoder_kind
from bench.engine_alone import FEATURE_BATCH
from bench.jobs import PROMPT_TOKENS, Job, forced_jobs
from bench.markdown import markdown_table
from bench.served import MODELS, served_checkpoint
from loadtest.provenance import provenance
from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.core.encoder_kernel import EncoderKernel
from python_backend_lib.core.quantization import Quantization
from python_backend_lib.engine import cuda_graphs, fp8_linear
from python_backend_lib.engine.fp8_linear import GeluForm

# Kernel names to the decoder step's kinds, first match wins (lower-cased substrings).
DECODER_KINDS = (
    ("attention", ("batchdecode", "batchprefill", "mergestate", "flash", "attention")),
    ("matrix products", ("gemm", "sm90", "cutlass", "matmul", "cublas", "nvjet", "xmma")),
    ("layer norms", ("layer_norm", "layernorm")),
)
DECODE_ATTENTION = "batchdecode"  # FlashInfer's decode kernel: self-, then cross-attention in each layer
TOP_KERNELS = 12  # kernels named per stream, longest first


def decoder_kind(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, needles in DECODER_KINDS if any(n in name for n in needles)), "elementwise and other")


def run_jobs(pipeline, jobs: list[Job], features: list[torch.Tensor], concurrency: int) -> float:
    """Submit `jobs` (their log-mel `features`, computed beforehand) with at most
    `concurrency` in flight; the wall seconds until the last answer."""
    slots = threading.Semaphore(concurrency)
    left = [len(jobs)]
    done = threading.Event()
    lock = threading.Lock()

    def finished(future) -> None:
        future.result()  # a failure fails the run
        slots.release()
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    start = time.monotonic()
    for job, feature in zip(jobs, features):
        slots.acquire()
        pipeline.submit_decoded(feature, len(job.audio.waveform), job.options).add_done_callback(finished)
    done.wait()
    return time.monotonic() - start


def kernel_events(trace: Path) -> list[dict]:
    """The CUDA kernels of a Chrome trace the profiler wrote: name, stream, start and duration (us)."""
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    return sorted(({"name": e["name"], "stream": e["args"].get("stream"), "ts": float(e["ts"]), "dur": float(e["dur"])}
                   for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by (start, end) intervals sorted by start."""
    total, end = 0.0, float("-inf")
    for start, stop in intervals:
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def intersection_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Microseconds covered by both interval lists (each sorted by start)."""
    return union_us(a) + union_us(b) - union_us(sorted(a + b))


def timeline(kernels: list[dict], decode_stream: int, n_layers: int) -> dict:
    """The profiled run's kernels cut by stream and kind."""
    wall = max(k["ts"] + k["dur"] for k in kernels) - kernels[0]["ts"]
    decode = [k for k in kernels if k["stream"] == decode_stream]
    side = [k for k in kernels if k["stream"] != decode_stream]
    spans = {name: [(k["ts"], k["ts"] + k["dur"]) for k in part] for name, part in (("decode", decode), ("side", side))}
    both = intersection_us(spans["decode"], spans["side"])
    busy = union_us(sorted(spans["decode"] + spans["side"]))
    by_kind: dict[str, dict[str, float]] = {"side": defaultdict(float), "decode": defaultdict(float)}
    for k in side:
        by_kind["side"][encoder_kind(k["name"])] += k["dur"]
    decode_attention = 0
    for k in decode:
        kind = decoder_kind(k["name"])
        if DECODE_ATTENTION in k["name"].lower():
            kind = "self-attention" if decode_attention % 2 == 0 else "cross-attention"
            decode_attention += 1
        by_kind["decode"][kind] += k["dur"]

    def share(us: float) -> float:
        return round(100 * us / wall, 1)

    return {
        "wall_ms": round(wall / 1e3, 1),
        "percent_of_wall": {
            "decoder steps (any kernel on the decoding stream)": share(union_us(spans["decode"])),
            "admissions (any kernel on the side stream)": share(union_us(spans["side"])),
            "both at once": share(both),
            "the GPU idle": share(wall - busy),
        },
        "kernel_ms": {part: {kind: round(us / 1e3, 1) for kind, us in sorted(kinds.items(), key=lambda i: -i[1])}
                      for part, kinds in by_kind.items()},
        "decode_steps": decode_attention // (2 * n_layers),
        "top_kernels": {"side": top_kernels(side), "decode": top_kernels(decode)},
    }


def top_kernels(kernels: list[dict], count: int = TOP_KERNELS) -> list[dict]:
    """The `count` kernels that took longest in all: name (cut to 140 characters),
    launches, milliseconds and microseconds a launch."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        total = totals[k["name"][:140]]
        total[0] += 1
        total[1] += k["dur"]
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:count]
    return [{"kernel": name, "launches": launches, "ms": round(us / 1e3, 2), "us_each": round(us / launches, 2)}
            for name, (launches, us) in ranked]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large-v3", choices=[m for m, spec in MODELS.items() if spec.random])
    parser.add_argument("--quantize", default="fp8", choices=[q.value for q in Quantization])
    parser.add_argument("--tokens-per-second", type=float, default=2.728)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--fp8-cross-kv", action=argparse.BooleanOptionalAction, default=None,
                        help="keep the cross-attention K/V in FP8 or not (EngineSetup.fp8_cross_kv; "
                             "default: as the quantization ships, in FP8 with fp8)")
    parser.add_argument("--gelu", choices=[form.name for form in GeluForm],
                        help="how fp8's quantization of fc2's input computes GELU (fp8_linear.GELU; "
                             "default: as shipped)")
    parser.add_argument("--encoder-attention", choices=[k.value for k in EncoderKernel],
                        help="the kernel of the encoder's self-attention (EngineSetup.encoder_kernel; "
                             "default: as shipped, FlashInfer's with fp8)")
    parser.add_argument("--whole-slot-cross-rows", type=int, metavar="ROWS",
                        help="decode graphs of at most ROWS rows read each slot's cross-attention K/V as "
                             "one page (cuda_graphs.WHOLE_SLOT_CROSS_ROWS; default: as shipped)")
    parser.add_argument("--repeat", type=int, default=4,
                        help="the clips this many times over, so that the run holds a steady state")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def say(message: str) -> None:
        print(f"[bench.engine_profile {time.perf_counter() - started:6.1f} s] {message}", flush=True)

    from python_backend_lib.engine.loading import EngineSetup
    from python_backend_lib.transcription.pipeline import Pipeline

    checkpoint = served_checkpoint(MODELS[args.model])
    config = load_config(checkpoint)
    jobs = forced_jobs(load_clips(), config.special.eot, args.tokens_per_second) * args.repeat
    audio_s = sum(j.audio.clip.duration_s for j in jobs)
    row_steps = sum(j.check.expected_tokens + PROMPT_TOKENS for j in jobs)
    if args.gelu:
        fp8_linear.GELU = GeluForm[args.gelu]  # before loading: the captured graphs keep the form
    if args.whole_slot_cross_rows is not None:
        cuda_graphs.WHOLE_SLOT_CROSS_ROWS = args.whole_slot_cross_rows  # planned at capture, like GELU's form
    setup = EngineSetup(quantization=Quantization(args.quantize), fp8_cross_kv=args.fp8_cross_kv,
                        encoder_kernel=args.encoder_attention and EncoderKernel(args.encoder_attention))
    pipeline = Pipeline.load(checkpoint, device="cuda", setup=setup)
    try:
        say(f"{args.model} ({args.quantize}) loaded, {pipeline.engine.slots} slots; {len(jobs)} clips, "
            f"{audio_s:.0f} s of audio, concurrency {args.concurrency}")
        clips = jobs[: len(jobs) // args.repeat]
        features = [f for first in range(0, len(clips), FEATURE_BATCH)
                    for f in pipeline.features([j.audio.waveform for j in clips[first:first + FEATURE_BATCH]])]
        features *= args.repeat
        run_jobs(pipeline, clips, features, args.concurrency)  # warm-up
        plain = run_jobs(pipeline, jobs, features, args.concurrency)
        say(f"unprofiled: {plain:.3f} s, RTFx {audio_s / plain:.1f}")
        with tempfile.TemporaryDirectory() as folder:
            trace = Path(folder) / "trace.json"
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                profiled = run_jobs(pipeline, jobs, features, args.concurrency)
                torch.cuda.synchronize()
            profile.export_chrome_trace(str(trace))
            kernels = kernel_events(trace)
    finally:
        pipeline.close()
    say(f"profiled: {profiled:.3f} s, RTFx {audio_s / profiled:.1f}, {len(kernels)} kernels")
    streams = defaultdict(int)
    for k in kernels:
        streams[k["stream"]] += 1
    # The kineto trace names streams by its own numbers: the decoding stream is the one
    # with FlashInfer's decode kernels.
    decode_stream = next(k["stream"] for k in kernels if DECODE_ATTENTION in k["name"].lower())
    cut = timeline(kernels, decode_stream, config.dims.n_text_layer)
    cut["mean_rows_a_step"] = round(row_steps / max(1, cut["decode_steps"]), 1)
    quantize = args.quantize + (", FP8 cross K/V" if setup.cross_kv_in_fp8 else "")
    if args.gelu:
        quantize += f", GELU {args.gelu}"
    if args.encoder_attention:
        quantize += f", encoder attention {setup.encoder_attention.value}"
    if args.whole_slot_cross_rows is not None:
        quantize += f", whole-slot cross pages up to {args.whole_slot_cross_rows} rows"
    record = {"provenance": provenance(), "model": args.model, "quantize": quantize,
              "concurrency": args.concurrency, "clips": len(jobs), "audio_s": round(audio_s, 1),
              "rtfx_unprofiled": round(audio_s / plain, 1), "rtfx_profiled": round(audio_s / profiled, 1),
              "kernels_by_stream": dict(streams), **cut}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine-profile.json").write_text(json.dumps(record, indent=1))
    (args.out / "engine-profile.md").write_text(render(record))
    say(json.dumps(cut))
    return 0


def render(record: dict) -> str:
    m = record["provenance"].get("machine", {})
    machine = f"{m.get('gpu')}, {m.get('cpu_count')} CPUs ({m.get('cpu')}), torch {m.get('torch')}"
    lines = [f"# Where the engine's time goes: {record['model']} ({record['quantize']}), concurrency "
             f"{record['concurrency']}", "",
             f"{machine}; {record['clips']} clips ({record['audio_s']} s of audio); RTFx {record['rtfx_unprofiled']} "
             f"unprofiled, {record['rtfx_profiled']} profiled; wall {record['wall_ms']} ms; "
             f"{record['decode_steps']} decoder steps, {record['mean_rows_a_step']} rows a step.", ""]
    lines.append(markdown_table(["share of the wall", "%"], [[k, v] for k, v in record["percent_of_wall"].items()]))
    lines.append("")
    rows = [[part, kind, ms] for part, kinds in record["kernel_ms"].items() for kind, ms in kinds.items()]
    lines.append(markdown_table(["stream", "kernels", "ms"], rows))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
