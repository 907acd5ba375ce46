"""The captured encoder pass held busy: its time alone against back to back, the GPU's
clock and power meanwhile, and the idle time between its kernels.

    python -m bench.encoder_sustained --model large-v3-turbo --out /tmp/encoder-sustained

bench.encoder_cost times a pass as the mean of REPEATS replays in a row, and sums its
kernels by kind from one profiled pass; on the fp8 encoders the sum is about a tenth
short of the time. This says where that tenth goes. Three phases, one captured pass of
`--batch` clips (random weights of the real shapes, `--quantize fp8`, the encoder's
attention through `--encoder-attention`, as fp8 serves):

- alone: `--alone` passes, each after IDLE_S without work, each between its own events;
- sustained: `--passes` replays back to back, each between its own events (an event
  recorded between two replays adds no gap), so the first passes and the last ones show
  whether the pass slows as the GPU heats and draws more power;
- profiled: PROFILED_REPLAYS replays back to back under PyTorch's profiler: per replay,
  its kernels' summed time, the span from its first kernel's start to its last kernel's
  end, and the gaps between consecutive kernels (the largest with the kernels around them).

`nvidia-smi` samples the SM clock, power and the active clock-limit reasons every
SAMPLE_MS through the first two phases, each phase its own samples. Writes
`<out>/encoder-sustained.json` and `.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.markdown import markdown_table
from loadtest.provenance import provenance
from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core.encoder_kernel import EncoderKernel
from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.core.quantization import Quantization
from python_backend_lib.engine.encoder_graphs import EncoderGraphs
from python_backend_lib.engine.kv_cache import KVSlotPool, PoolShape
from python_backend_lib.engine.model import Whisper

CUDA = torch.device("cuda")
IDLE_S = 2.0
WARMUP = 3
PROFILED_REPLAYS = 5
SAMPLE_MS = 50
LARGEST_GAPS = 8
SMI_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")
# The clock-limit reasons' field was renamed in later drivers; the older name is the fallback.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


class Sampler:
    """nvidia-smi in the background, one line every SAMPLE_MS, until `stop`."""

    def __init__(self) -> None:
        query = ",".join((*SMI_FIELDS, reason_field()))
        self._process = subprocess.Popen(
            ["nvidia-smi", "-i", str(torch.cuda.current_device()), f"--query-gpu={query}",
             "--format=csv,noheader,nounits", f"-lms={SAMPLE_MS}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )

    def stop(self) -> dict:
        self._process.terminate()
        out, _ = self._process.communicate(timeout=10)
        rows = [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.count(",") == 3]
        clocks = [float(r[0]) for r in rows if _number(r[0])]
        power = [float(r[1]) for r in rows if _number(r[1])]
        reasons: dict[str, int] = {}
        for r in rows:
            reasons[r[3]] = reasons.get(r[3], 0) + 1
        return {
            "samples": len(rows),
            "sm_clock_mhz": _summary(clocks),
            "power_w": _summary(power),
            "temperature_c": _summary([float(r[2]) for r in rows if _number(r[2])]),
            "limit_reasons": reasons,  # nvidia-smi's bit mask, by how many samples had it
        }


def reason_field() -> str:
    for field in REASON_FIELDS:
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return field
    return REASON_FIELDS[-1]


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _summary(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    return {"min": ordered[0], "median": statistics.median(ordered), "max": ordered[-1]}


def timed(graphs: EncoderGraphs, mel: torch.Tensor, slots: list[int], passes: int, idle_s: float = 0.0) -> list[float]:
    """Milliseconds of each of `passes` replays, each between its own events."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(passes)]
    for begin, end in events:
        if idle_s:
            torch.cuda.synchronize()
            time.sleep(idle_s)
        begin.record()
        graphs.run(mel, slots)
        end.record()
    torch.cuda.synchronize()
    return [round(begin.elapsed_time(end), 3) for begin, end in events]


def kernel_gaps(graphs: EncoderGraphs, mel: torch.Tensor, slots: list[int]) -> dict:
    """PROFILED_REPLAYS replays back to back under the profiler: each one's kernels."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(PROFILED_REPLAYS):
            graphs.run(mel, slots)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        profile.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per_replay = len(kernels) // PROFILED_REPLAYS if kernels else 0
    replays = []
    for i in range(PROFILED_REPLAYS if per_replay else 0):
        chunk = kernels[i * per_replay:(i + 1) * per_replay]
        busy = sum(k["dur"] for k in chunk)
        span = chunk[-1]["ts"] + chunk[-1]["dur"] - chunk[0]["ts"]
        gaps = [(b["ts"] - (a["ts"] + a["dur"]), a["name"], b["name"]) for a, b in zip(chunk, chunk[1:])]
        ordered = sorted(g[0] for g in gaps)
        largest = sorted(gaps, key=lambda g: -g[0])[:LARGEST_GAPS]
        replays.append({
            "kernels": len(chunk), "busy_ms": round(busy / 1e3, 3), "span_ms": round(span / 1e3, 3),
            "idle_ms": round((span - busy) / 1e3, 3),
            "gap_us": {"median": round(statistics.median(ordered), 2), "p90": round(ordered[int(0.9 * len(ordered))], 2),
                       "max": round(ordered[-1], 2)} if ordered else {},
            "largest_gaps": [{"us": round(g, 2), "after": a[:100], "before": b[:100]} for g, a, b in largest],
        })
    return {"kernels_seen": len(kernels), "replays": replays}


def measure(args, say) -> dict:
    checkpoint = load_checkpoint(f"random:{args.model}:0")
    dims = checkpoint.config.dims
    model = Whisper.from_checkpoint(checkpoint, device=CUDA, dtype=torch.bfloat16, quantization=Quantization.FP8)
    pool = KVSlotPool(PoolShape.for_model(dims, args.batch), device=CUDA, dtype=torch.bfloat16)
    graphs = EncoderGraphs(model, pool, buckets=(args.batch,), kernel=EncoderKernel(args.encoder_attention))
    graphs.capture()
    mel = torch.randn(args.batch, dims.n_mels, N_FRAMES, device=CUDA, dtype=torch.bfloat16)
    slots = list(range(1, args.batch + 1))
    timed(graphs, mel, slots, WARMUP)
    say(f"{args.model}: captured a pass of {args.batch}; {args.alone} passes alone, {IDLE_S:g} s apart")
    sampler = Sampler()
    alone = timed(graphs, mel, slots, args.alone, idle_s=IDLE_S)
    alone_gpu = sampler.stop()
    say(f"alone: {alone} ms; SM clock {alone_gpu['sm_clock_mhz']} MHz, power {alone_gpu['power_w']} W")
    sampler = Sampler()
    sustained = timed(graphs, mel, slots, args.passes)
    sustained_gpu = sampler.stop()
    tenth = max(1, args.passes // 10)
    say(f"sustained: first {tenth} {statistics.mean(sustained[:tenth]):.3f} ms, last {tenth} "
        f"{statistics.mean(sustained[-tenth:]):.3f} ms; SM clock {sustained_gpu['sm_clock_mhz']} MHz, "
        f"power {sustained_gpu['power_w']} W, limits {sustained_gpu['limit_reasons']}")
    gaps = kernel_gaps(graphs, mel, slots)
    for replay in gaps["replays"]:
        say(f"profiled replay: {replay['kernels']} kernels, busy {replay['busy_ms']} ms of a span of "
            f"{replay['span_ms']} ms, gaps {replay['gap_us']} us")
    return {
        "model": args.model, "batch": args.batch, "quantize": "fp8", "encoder_attention": args.encoder_attention,
        "alone_ms": alone, "alone_gpu": alone_gpu, "sustained_ms": sustained, "sustained_gpu": sustained_gpu,
        "profiled": gaps,
    }


SUMMARY_HEADER = ["model", "clips", "ms a pass alone", "SM clock alone, MHz", "ms a pass, first tenth back to back",
                  "ms a pass, last tenth", "SM clock held busy, MHz", "power held busy, W", "clock limited by",
                  "kernels busy / span of a profiled replay, ms"]
# nvidia-smi's clock-limit reasons (its bit mask), those a busy encoder can show.
LIMIT_REASONS = {0x1: "idle", 0x4: "the power cap", 0x8: "a hardware slowdown", 0x20: "a slowdown for heat", 0x40: "hardware heat",
                 0x80: "the power brake", 0x100: "the display clock"}


def limits(reasons: dict[str, int]) -> str:
    """The limit reasons nvidia-smi gave over a phase, by their share of its samples."""
    total = sum(reasons.values()) or 1
    named = []
    for mask, count in sorted(reasons.items(), key=lambda item: -item[1]):
        bits = int(mask, 16) if mask.startswith("0x") else 0
        words = [name for bit, name in LIMIT_REASONS.items() if bits & bit] or (["none"] if bits == 0 else [mask])
        named.append(f"{' and '.join(words)} ({count / total:.0%})")
    return ", ".join(named)


def summary_row(run: dict) -> list:
    """One run as SUMMARY_HEADER's row: medians of its phases."""
    tenth = max(1, len(run["sustained_ms"]) // 10)
    replays = run["profiled"]["replays"]
    busy = statistics.median(r["busy_ms"] for r in replays) if replays else None
    span = statistics.median(r["span_ms"] for r in replays) if replays else None
    return [
        run["model"], run["batch"], round(statistics.median(run["alone_ms"]), 2),
        run["alone_gpu"]["sm_clock_mhz"].get("median"), round(statistics.median(run["sustained_ms"][:tenth]), 2),
        round(statistics.median(run["sustained_ms"][-tenth:]), 2), run["sustained_gpu"]["sm_clock_mhz"].get("median"),
        run["sustained_gpu"]["power_w"].get("median"), limits(run["sustained_gpu"]["limit_reasons"]),
        f"{busy:.2f} / {span:.2f}" if replays else "–",
    ]


def write_markdown(out: Path, data: dict) -> None:
    run = data["run"]
    replays = [[i + 1, r["kernels"], r["busy_ms"], r["span_ms"], r["idle_ms"], r["gap_us"].get("median"),
                r["gap_us"].get("max")] for i, r in enumerate(run["profiled"]["replays"])]
    machine = data["provenance"]["machine"]
    text = "\n".join([
        f"# The encoder's pass held busy: {run['model']}, {run['batch']} clips, fp8",
        "",
        f"{machine}; commit {data['provenance']['commit']}; `{data['provenance']['command']}`.",
        "",
        markdown_table(SUMMARY_HEADER, [summary_row(run)]),
        "",
        "Replays back to back under the profiler:",
        "",
        markdown_table(["replay", "kernels", "busy ms", "span ms", "idle ms", "gap us (median)", "gap us (max)"], replays),
        "",
    ])
    (out / "encoder-sustained.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large-v3-turbo")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--alone", type=int, default=5, help="passes timed alone, each after an idle pause")
    parser.add_argument("--passes", type=int, default=100, help="passes timed back to back")
    parser.add_argument("--encoder-attention", default=EncoderKernel.FLASHINFER.value,
                        choices=[k.value for k in EncoderKernel])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    start = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {message}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    data = {"provenance": provenance(), "run": measure(args, say)}
    (args.out / "encoder-sustained.json").write_text(json.dumps(data, indent=1))
    write_markdown(args.out, data)
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
