"""Served GPU transcripts against the CPU path, on every shared clip, with each
difference measured against the float16 noise that explains it.

    python -m bench.exactness --out OUT        # on a GPU machine with the tiny.en weights

1. `whisper-triton serve` on the GPU, as shipped, transcribes every clip of
   tests/data/audio over gRPC (verbose_json: the tokens of every segment).
2. The library transcribes the same clips on the GPU (float16, the server's
   engine) and on the CPU (float32), one clip at a time, and records the logits
   of every decoder step (`DecodeBatch.logit_observer`), keyed by the window's
   prompt and the tokens generated before the step.
3. Served GPU tokens must equal the library's GPU tokens (the served path adds
   nothing). Where the GPU's tokens differ from the CPU's, the first differing
   step is looked up in both traces: the CPU's top-two gap between its token and
   the GPU's, against the largest logit difference between the two devices over
   the clip's steps where both chose the same token (same inputs, so that
   difference is the float16 noise). A gap inside that noise explains the difference.

Writes OUT/exactness.json and OUT/exactness.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.server_process import ServeCommand, ServerProcess
from loadtest.provenance import provenance

REPOSITORY = Path(__file__).resolve().parents[1]
TOP_K = 8  # logits kept per step: the two tokens compared are among them where noise explains a difference


def say(message: str) -> None:
    print(f"[bench.exactness {time.strftime('%H:%M:%S')}] {message}", flush=True)


StepKey = tuple[tuple[int, ...], tuple[int, ...]]  # (the window's prompt tokens, the tokens generated before)


class LogitTrace:
    """The top logits of every decoder step, by StepKey (the first decode of a key wins:
    a temperature fallback repeats the prompt with other tokens)."""

    def __init__(self) -> None:
        self.steps: dict[StepKey, dict[int, float]] = {}

    def observe(self, rows, logits: torch.Tensor) -> None:
        values, tokens = logits.float().topk(TOP_K, dim=-1)
        for row, v, t in zip(rows, values.tolist(), tokens.tolist()):
            key = (tuple(row.prompt.tokens), tuple(row.generated))
            self.steps.setdefault(key, dict(zip(t, v)))


@dataclass(frozen=True)
class Divergence:
    step: int  # index into the clip's generated tokens where the devices first differ
    cpu_token: int
    gpu_token: int
    cpu_gap: float | None  # CPU logit of its token minus that of the GPU's (None: not in its top-k)
    gpu_gap: float | None  # GPU logit of its token minus that of the CPU's
    noise: float  # largest |GPU - CPU| logit over the clip's steps where both chose alike, on shared top tokens
    explained: bool


@dataclass(frozen=True)
class ClipResult:
    clip: str
    seconds: float
    served_equals_library_gpu: bool
    gpu_equals_cpu: bool
    tokens: int
    gpu_text: str
    cpu_text: str
    divergence: Divergence | None
    logit_noise: float  # largest |GPU - CPU| logit over the steps both devices decoded alike


def _tokens(document) -> list[int]:
    return [t for s in document.segments for t in s.tokens]


def _window_steps(trace: LogitTrace) -> dict[tuple[int, ...], list[tuple[StepKey, dict[int, float]]]]:
    by_prompt: dict[tuple[int, ...], list] = {}
    for key, top in trace.steps.items():
        by_prompt.setdefault(key[0], []).append((key, top))
    return by_prompt


def logit_noise(cpu: LogitTrace, gpu: LogitTrace) -> float:
    """The largest |GPU - CPU| logit, on tokens both ranked, over the steps that saw
    the same inputs and chose the same token."""
    noise = 0.0
    for key, cpu_top in cpu.steps.items():
        gpu_top = gpu.steps.get(key)
        if gpu_top is not None and max(cpu_top, key=cpu_top.get) == max(gpu_top, key=gpu_top.get):
            noise = max([noise, *(abs(cpu_top[t] - gpu_top[t]) for t in set(cpu_top) & set(gpu_top))])
    return noise


def compare_traces(cpu: LogitTrace, gpu: LogitTrace, cpu_tokens: list[int], gpu_tokens: list[int]) -> Divergence | None:
    """Where the clip's token lists first differ, the two devices' logits at that step."""
    first = next((i for i, (a, b) in enumerate(zip(cpu_tokens, gpu_tokens)) if a != b), None)
    if first is None:
        if len(cpu_tokens) == len(gpu_tokens):
            return None
        first = min(len(cpu_tokens), len(gpu_tokens))
    cpu_token = cpu_tokens[first] if first < len(cpu_tokens) else -1
    gpu_token = gpu_tokens[first] if first < len(gpu_tokens) else -1
    noise = logit_noise(cpu, gpu)
    at = next(
        (
            (cpu_top, gpu.steps[key])
            for key, cpu_top in cpu.steps.items()  # in decoding order
            if key in gpu.steps and max(cpu_top, key=cpu_top.get) != max(gpu.steps[key], key=gpu.steps[key].get)
        ),
        None,
    )
    if at is None:
        return Divergence(first, cpu_token, gpu_token, None, None, noise, explained=False)
    cpu_top, gpu_top = at
    chose_cpu, chose_gpu = max(cpu_top, key=cpu_top.get), max(gpu_top, key=gpu_top.get)
    cpu_gap = cpu_top[chose_cpu] - cpu_top[chose_gpu] if chose_gpu in cpu_top else None
    gpu_gap = gpu_top[chose_gpu] - gpu_top[chose_cpu] if chose_cpu in gpu_top else None
    explained = cpu_gap is not None and gpu_gap is not None and cpu_gap <= noise and gpu_gap <= noise
    return Divergence(first, chose_cpu, chose_gpu, cpu_gap, gpu_gap, round(noise, 4), explained)


def _library_run(device: str, clips, options) -> tuple[list, list[LogitTrace]]:
    from python_backend_lib.audio.decode import decode_audio
    from python_backend_lib.text.formats import Document
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load("default", device=device)
    traces: list[LogitTrace] = []
    documents = []
    try:
        for clip in clips:
            trace = LogitTrace()
            pipeline.engine.batch.logit_observer = trace.observe
            transcript = pipeline.transcribe(decode_audio(clip.read()), options)
            documents.append(Document.from_transcript(transcript, options))
            traces.append(trace)
            pipeline.engine.batch.logit_observer = None
    finally:
        pipeline.close()
    return documents, traces


def run(out: Path, device: str = "cuda") -> dict:
    from clients.api import WhisperClient
    from python_backend_lib.contract.parameters import parse_request_parameters

    sys.path.insert(0, str(REPOSITORY / "tests"))
    from reference import clips as shared_clips

    clips = shared_clips()
    options = parse_request_parameters({}).transcription  # a request's defaults: greedy, timestamps, fallback
    out.mkdir(parents=True, exist_ok=True)
    command = ServeCommand(checkpoint="default")
    say(f"served: {len(clips)} clips through {command.display}")
    with ServerProcess(command, out / "exactness-server.log", startup_timeout_s=300):
        with WhisperClient(f"grpc://{command.grpc_url}") as client:
            served = [client.transcribe_document(clip.read()) for clip in clips]
    say(f"library on {device} (the server's engine: float16 on a GPU)")
    gpu_docs, gpu_traces = _library_run(device, clips, options)
    say("library on the CPU (float32)")
    cpu_docs, cpu_traces = _library_run("cpu", clips, options)
    results = []
    for clip, s, g, c, gt, ct in zip(clips, served, gpu_docs, cpu_docs, gpu_traces, cpu_traces):
        gpu_tokens, cpu_tokens = _tokens(g), _tokens(c)
        divergence = None if gpu_tokens == cpu_tokens else compare_traces(ct, gt, cpu_tokens, gpu_tokens)
        result = ClipResult(
            clip.file,
            clip.duration,
            _tokens(s) == gpu_tokens,
            gpu_tokens == cpu_tokens,
            len(gpu_tokens),
            g.text.strip(),
            c.text.strip(),
            divergence,
            round(logit_noise(ct, gt), 4),
        )
        say(
            f"{clip.file}: served = library GPU {result.served_equals_library_gpu}, GPU = CPU {result.gpu_equals_cpu}"
            + (f", first difference at token {divergence.step}: explained {divergence.explained}" if divergence else "")
        )
        results.append(result)
    record = {"provenance": provenance(" ".join(sys.argv)), "clips": [asdict(r) for r in results]}
    (out / "exactness.json").write_text(json.dumps(record, indent=1))
    (out / "exactness.md").write_text(markdown(record))
    return record


def markdown(record: dict) -> str:
    p = record["provenance"]
    rows = record["clips"]
    lines = [
        "# Exactness on the GPU: served transcripts against the CPU path",
        "",
        f"`python -m bench.exactness` at commit {p.get('commit')}, {p['machine'].get('gpu')}, {p.get('date')}: "
        "packaged tiny.en, every clip of tests/data/audio, default decoding (greedy, timestamps, fallback).",
        "",
        f"- served GPU tokens equal the library's GPU tokens on {sum(r['served_equals_library_gpu'] for r in rows)} "
        f"of {len(rows)} clips;",
        f"- GPU (float16) tokens equal the CPU's (float32) on {sum(r['gpu_equals_cpu'] for r in rows)} of {len(rows)};",
        f"- differences explained by measured float16 noise: "
        f"{sum(bool(r['divergence'] and r['divergence']['explained']) for r in rows)} of "
        f"{sum(not r['gpu_equals_cpu'] for r in rows)}.",
        "",
        "A difference is explained when, at the first step where the devices choose differently, each "
        "device's logit gap between the two tokens is at most the largest GPU/CPU logit difference over the "
        "clip's steps where both chose the same token (same inputs: that difference is float16 noise).",
        "",
        "| clip | s | tokens | served = library GPU | GPU = CPU | largest logit difference | first difference "
        "| CPU gap | GPU gap | explained |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["divergence"] or {}
        lines.append(
            f"| {r['clip']} | {r['seconds']} | {r['tokens']} | {r['served_equals_library_gpu']} | {r['gpu_equals_cpu']} | "
            f"{_fmt(r['logit_noise'])} | {d.get('step', '')} | {_fmt(d.get('cpu_gap'))} | {_fmt(d.get('gpu_gap'))} | "
            f"{d.get('explained', '')} |"
        )
    differing = [r for r in rows if not r["gpu_equals_cpu"]]
    if differing:
        lines += ["", "## The differing transcripts", ""]
        for r in differing:
            lines += [f"- {r['clip']}", f"  - GPU: {r['gpu_text']}", f"  - CPU: {r['cpu_text']}"]
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    return "" if value is None else f"{value:.4f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", help="the served side's library run (cpu: a smoke run of the tool)")
    args = parser.parse_args(argv)
    record = run(args.out, args.device)
    rows = record["clips"]
    explained = all(r["gpu_equals_cpu"] or (r["divergence"] and r["divergence"]["explained"]) for r in rows)
    return 0 if all(r["served_equals_library_gpu"] for r in rows) and explained else 1


if __name__ == "__main__":
    sys.exit(main())
