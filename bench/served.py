"""Issue 9's table for one model, in one run: the ceiling, the served path, the engine alone, transformers.

    python -m bench.served --model tiny --out OUT            # on a GPU machine (scripts/gpu_run.sh served-tiny)
    python -m bench.served --model tiny --quick --device cpu --out /tmp/bench-cpu   # the harness, on a CPU

Phases, in this order (each gets its share of `--budget-s`, split between the
phases asked for; one that fails is recorded and the next one runs):

- ceiling: `whisper-triton serve` on a copy of the model repository whose
  `whisper` is a stand-in that answers at once (`bench.standin`); a
  concurrency sweep through `transcribe` over gRPC.
- served: `whisper-triton serve` as shipped; latency of a ~5 s clip at
  concurrency 1, then the sweep up to twice the concurrency that saturates it.
- engine: the library's `Pipeline` alone on the same clips (`bench.engine_alone`),
  in as many processes as the server runs engines on one GPU (under MPS where
  the server would use it), so that served over engine compares like with like.
- transformers: `generate` over batch sizes 1 to 256 (`bench.transformers_sweep`).

Models: `tiny` is the packaged tiny.en with real decode lengths; `large-v3`
has random weights of the real shapes that decode forced lengths (tiny's
measured text tokens per second of audio, from this results file, times each
clip's length); `tiny-random` does the same with tiny's shapes (a quick check
of the forced-length path on a CPU).

`--parameter beam_size=5` (repeatable) adds a request parameter to every request
of a real-weight model, whose reference transcripts are then decoded with it
too: beam search against greedy is two runs with their own `--results`.

`--instances preprocessing=4` (repeatable; `whisper=1:cpu` also sets the kind)
serves a copy of the repository with other instance groups, for the ceiling and
the served path alike; the run records them.

Everything goes into one JSON file (`--results`), saved after every point and
copied into `--out` with the Markdown table and the plot (`bench.report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import report
from bench.clips import load_clips, nearest
from bench.engine_alone import EnginePlan, run_engine
from bench.host import GpuSampler, ServerProcesses, busy_cores, cpu_times
from bench.jobs import Job, forced_jobs, real_jobs
from bench.load import LoadGenerator, PointPlan, PointResult
from bench.references import with_references
from bench.repository_copy import add_instances_option, repository_with_instances
from bench.server_process import ServeCommand, ServerProcess
from bench.standin import canned_check, write_standin_repository
from bench.stats import PointStats, saturation, sweep_done
from bench.transcripts import REQUEST_PARAMETERS
from bench.transformers_sweep import BATCH_SIZES, TransformersPlan, run_transformers
from bench.triton_stats import model_stats, stats_delta
from loadtest.provenance import provenance
from python_backend_lib.apps.mps import MpsDaemon
from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.contract.parameters import parse_request_parameters
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.quantization import Quantization
from python_backend_lib.serving.settings import auto_instances_per_gpu

PHASES = ("ceiling", "served", "engine", "transformers")
STATE_DIR = Path(os.environ.get("WHISPER_BENCH_STATE", "/tmp/whisper-bench"))
LATENCY_CLIP_S = 5.0  # the latency target is for a ~5 s clip at concurrency 1
POINT_MARGIN_S = 15.0  # a point needs its warm-up and window plus this (drain, statistics)


@dataclass(frozen=True)
class ModelSpec:
    source: str  # checkpoint source: "default" or "random:<size>:<seed>"
    random: bool  # random weights: forced lengths, a served copy with a word-level tokenizer


MODELS = {
    "tiny": ModelSpec("default", random=False),
    "large-v3": ModelSpec("random:large-v3:0", random=True),
    "large-v3-turbo": ModelSpec("random:large-v3-turbo:0", random=True),
    "tiny-random": ModelSpec("random:tiny:0", random=True),
    "base-random": ModelSpec("random:base:0", random=True),
    "small-random": ModelSpec("random:small:0", random=True),
}


@dataclass(frozen=True)
class Settings:
    """How long each part runs; `quick` is the CPU smoke run."""

    warmup_s: float = 2.0
    point_s: float = 6.0
    latency_s: float = 10.0
    timeout_s: float = 60.0
    max_concurrency: int = 2048
    min_top_concurrency: int = 64
    engine_min_requests: int = 2048
    transformers_batches: tuple[int, ...] = BATCH_SIZES
    transformers_budget_s_per_size: float = 25.0
    startup_s: float = 300.0
    # Each phase's share of the time left when the phases start (of those asked for). The
    # served sweep is the longest: tiny's doubles to 1,024 clients or more (about 14 s a point).
    shares: tuple[tuple[str, float], ...] = (("ceiling", 0.23), ("served", 0.42), ("engine", 0.13),
                                             ("transformers", 0.22))

    clip_stride: int = 1  # every clip_stride-th clip ...
    max_clip_s: float | None = None  # ... of at most this length

    @classmethod
    def quick(cls) -> Settings:
        return cls(warmup_s=2.0, point_s=12.0, latency_s=8.0, timeout_s=120.0, max_concurrency=8,
                   clip_stride=4, max_clip_s=8.0,
                   min_top_concurrency=4, engine_min_requests=16, transformers_batches=(1, 2, 4),
                   transformers_budget_s_per_size=20.0, startup_s=240.0)


def say(message: str) -> None:
    print(f"[bench.served {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Results:
    """The run's JSON, saved (atomically) after every change, and copied to `out`."""

    def __init__(self, path: Path, out: Path) -> None:
        self.path, self.out = path, out
        self.data = json.loads(path.read_text()) if path.exists() else {"runs": [], "models": {}}

    def model(self, name: str) -> dict:
        return self.data["models"].setdefault(name, {})

    def save(self) -> None:
        for target in {self.path, self.out / self.path.name}:
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".partial")
            partial.write_text(json.dumps(self.data, indent=1))
            partial.replace(target)


# ------------------------------------------------------------------ the workload


def tokens_per_second_from(results: Results) -> float:
    """tiny's text tokens per second of audio, as this results file measured them (served, else the engine)."""
    tiny = results.data["models"].get("tiny", {})
    rate = tiny.get("tokens_per_audio_s")
    if not rate:
        raise RuntimeError("no tiny results in the results file to take tokens per second of audio from: "
                           "run --model tiny first (into the same --results), or pass --tokens-per-second")
    return float(rate)


def served_checkpoint(spec: ModelSpec) -> str:
    """What `whisper-triton serve --checkpoint` gets: the source, or a written folder for random weights."""
    if not spec.random:
        return spec.source
    from python_backend_lib.checkpoints.served_random import write_served_checkpoint

    folder = STATE_DIR / ("checkpoint-" + spec.source.replace(":", "-"))
    done = folder / "written"
    if not done.exists():
        started = time.monotonic()
        write_served_checkpoint(spec.source, folder, emit_text=True)
        done.write_text(spec.source)
        say(f"wrote {folder} in {time.monotonic() - started:.0f} s")
    return str(folder)


def latency_job(jobs: list[Job]) -> Job:
    """The job of the clip nearest LATENCY_CLIP_S: the latency target's request."""
    short = nearest([j.audio for j in jobs], LATENCY_CLIP_S)
    return next(j for j in jobs if j.audio is short)


def make_jobs(spec: ModelSpec, checkpoint: str, tokens_per_second: float | None, settings: Settings,
              parameters: dict[str, object] | None = None) -> list[Job]:
    from python_backend_lib.checkpoints.configs import load_config

    eot = load_config(checkpoint).special.eot
    clips = [c for c in load_clips() if settings.max_clip_s is None or c.clip.duration_s <= settings.max_clip_s]
    clips = clips[:: settings.clip_stride]
    return forced_jobs(clips, eot, tokens_per_second) if spec.random else real_jobs(clips, eot, parameters)


# ------------------------------------------------------------------ server phases


class PointProbe:
    """Reads the server and the host at a point's window edges: Triton's statistics, the
    host's CPU, the server's processes' CPU by role, the GPUs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.readings: dict[str, object] = {}
        self.sampler: GpuSampler | None = None
        self.processes = ServerProcesses.find(int(url.rpartition(":")[2]))

    def __call__(self, edge: str) -> None:
        if edge == "start":
            self.sampler = GpuSampler().__enter__()
        else:
            self.sampler.__exit__(None, None, None)
        self.readings[edge] = (model_stats(self.url), cpu_times(), self.processes.cpu_seconds(), time.monotonic())

    def record(self) -> dict:
        (stats_before, cpu_before, own_before, started), (stats_after, cpu_after, own_after, ended) = (
            self.readings["start"], self.readings["end"])
        return {"models": stats_delta(stats_before, stats_after),
                "host_busy_cores": busy_cores(cpu_before, cpu_after, os.cpu_count() or 1),
                "server_cores": self.processes.busy(own_before, own_after, ended - started),
                "server_memory_gib": self.processes.memory_gib(),
                **self.sampler.summary()}


def measure_point(load: LoadGenerator, plan: PointPlan, url: str) -> tuple[PointResult, dict]:
    """The point's result, and its record: the load generator's figures with the server's and the host's."""
    probe = PointProbe(url)
    result = load.run(plan, at_window=probe)
    return result, {**result.to_dict(), **probe.record()}


def describe_point(label: str, point: dict) -> str:
    latency = point["latency_ms"]
    refused = {k: v for k, v in point["statuses"].items() if k != "OK"}
    return (f"{label} concurrency {point['concurrency']:5d}: {point['goodput_per_s']:8.1f} good req/s, "
            f"RTFx {point['rtfx']:8.1f}, p50 {latency['p50']} ms, p99 {latency['p99']} ms, "
            f"tokens {point['mean_tokens']}, client CPU {point['client_cpu_cores']} cores, "
            f"host {point['host_busy_cores']} cores" + (f", not OK {refused}" if refused else "")
            + (f" FAILED: {point['problems']}" if point["failed"] else ""))


def sweep(label: str, load: LoadGenerator, server: ServerProcess, settings: Settings, deadline: float,
          section: dict, results: Results) -> None:
    """Doubling concurrency from 1 until twice the saturating concurrency (and at least min_top)."""
    points: list[dict] = section.setdefault("points", [])
    measured: list[PointStats] = []
    concurrency = 1
    while concurrency <= settings.max_concurrency:
        if deadline - time.monotonic() < settings.warmup_s + settings.point_s + POINT_MARGIN_S:
            section["stopped"] = f"out of time before concurrency {concurrency}"
            say(f"{label}: {section['stopped']}")
            break
        plan = PointPlan(concurrency, settings.warmup_s, settings.point_s, settings.timeout_s)
        result, point = measure_point(load, plan, server.command.grpc_url)
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited during the point at concurrency {concurrency}:\n{server.log_tail()}")
        points.append(point)
        measured.append(result.stats)
        found = saturation(measured)
        section["saturation"] = asdict(found) if found else None
        results.save()
        say(describe_point(label, point))
        if sweep_done(measured, settings.min_top_concurrency):
            break
        concurrency *= 2


def server_phase(phase: str, command: ServeCommand, jobs: list[Job], args, settings: Settings, deadline: float,
                 results: Results, section: dict) -> None:
    log_path = args.out / f"{phase}-{args.model}.log"
    startup = max(30.0, min(settings.startup_s, deadline - time.monotonic() - 30))
    say(f"{phase}: starting {command.display}")
    with ServerProcess(command, log_path, startup) as server:
        section["server"] = {"command": command.display, "ready_s": server.ready_s, **server.metadata(),
                             "log": log_path.name}
        say(f"{phase}: ready after {server.ready_s} s ({section['server']['version']})")
        results.save()
        requests = [j.load_request() for j in jobs]
        if phase == "served":
            job = latency_job(jobs)
            with LoadGenerator(command.grpc_url, [job.load_request()], processes=1) as load:
                load.run(PointPlan(1, 0.0, settings.warmup_s, settings.timeout_s))  # warm-up
                plan = PointPlan(1, 0.0, settings.latency_s, settings.timeout_s)
                _, point = measure_point(load, plan, command.grpc_url)
                section["latency_5s"] = {"clip": job.describe(), **point}
            results.save()
            say(describe_point(f"{phase} [{job.audio.clip.name}]", section["latency_5s"]))
        with LoadGenerator(command.grpc_url, requests, processes=args.clients) as load:
            sweep(phase, load, server, settings, deadline, section, results)


# ------------------------------------------------------------------ the run


def phase_budgets(phases: list[str], settings: Settings, seconds: float) -> dict[str, float]:
    """`seconds` split between the phases asked for, by their shares."""
    shares = {phase: share for phase, share in settings.shares if phase in phases}
    return {phase: seconds * share / sum(shares.values()) for phase, share in shares.items()}


def run_phase(phase: str, spec: ModelSpec, checkpoint: str, jobs: list[Job], args, settings: Settings,
              results: Results, run_id: int, budget: float) -> None:
    deadline = min(time.monotonic() + budget, args.deadline)
    section = results.model(args.model)[phase] = {"run": run_id, "budget_s": round(budget)}
    started = time.monotonic()
    try:
        if phase == "ceiling":
            repository = write_standin_repository(STATE_DIR / "ceiling-repository", args.model_repository)
            canned = canned_check(jobs[0].check.eot)  # every answer is the canned transcript
            standin_jobs = [dataclasses.replace(j, check=canned) for j in jobs]
            server_phase(phase, ServeCommand(checkpoint, repository, args.gpus, quantize=args.quantize), standin_jobs, args, settings, deadline, results,
                         section)
        elif phase == "served":
            server_phase(phase, ServeCommand(checkpoint, args.model_repository, args.gpus, quantize=args.quantize), jobs, args, settings, deadline,
                         results, section)
            rate = served_tokens_per_second(section)
            if rate and not spec.random:
                results.model(args.model)["tokens_per_audio_s"] = rate
        elif phase == "engine":
            plan = engine_plan(checkpoint, args, settings)
            section.update(run_engine(jobs, plan, say))
            if not spec.random and "tokens_per_audio_s" not in results.model(args.model):
                results.model(args.model)["tokens_per_audio_s"] = section["tokens_per_audio_s"]
        elif phase == "transformers":
            plan = TransformersPlan(hf_folder(checkpoint), args.device, settings.transformers_batches,
                                    budget_s_per_size=settings.transformers_budget_s_per_size)
            section.update(run_transformers(jobs, plan, say, deadline))
    except Exception as error:  # keep what was measured; the next phase runs
        section["error"] = f"{type(error).__name__}: {error}"
        say(f"{phase} failed: {section['error']}")
        traceback.print_exc()
    finally:
        section["phase_s"] = round(time.monotonic() - started, 1)  # the engine phase keeps its own timed wall_s
        results.save()
        free_gpu_memory()


def engine_plan(checkpoint: str, args, settings: Settings) -> EnginePlan:
    """The engine alone as the server runs it on one GPU: as many engine processes as
    `serve` starts for this checkpoint (`--engine-processes auto`), under CUDA MPS where
    `serve --mps auto` would use it."""
    mps = args.device.startswith("cuda") and MpsDaemon().available
    processes = args.engine_processes
    if processes == "auto":
        processes = auto_instances_per_gpu(load_config(checkpoint).dims, mps).whisper if args.device.startswith("cuda") else 1
    return EnginePlan(checkpoint, args.device, settings.engine_min_requests, processes=int(processes),
                      mps=mps and int(processes) > 1, quantize=args.quantize or "none")


def served_tokens_per_second(section: dict) -> float | None:
    """Text tokens per second of audio over the served sweep's good requests (weighted by requests)."""
    points = [p for p in section.get("points", []) if p.get("tokens_per_audio_s") and not p["failed"]]
    total = sum(p["statuses"].get("OK", 0) for p in points)
    if not total:
        return None
    return round(sum(p["tokens_per_audio_s"] * p["statuses"].get("OK", 0) for p in points) / total, 3)


def hf_folder(checkpoint: str) -> Path:
    """The Hugging Face-format folder transformers loads (the packaged tiny.en is converted on first use)."""
    from python_backend_lib.checkpoints.random_shapes import is_random_source
    from python_backend_lib.checkpoints.weights import hf_directory

    if is_random_source(checkpoint):
        raise ValueError(f"checkpoint {checkpoint!r} has no Hugging Face-format folder for transformers")
    return hf_directory(checkpoint)


def free_gpu_memory() -> None:
    if "torch" in sys.modules:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.served", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--out", type=Path, required=True, help="the JSON, the table, the plot and server logs")
    parser.add_argument("--results", type=Path, help=f"the results JSON, kept between calls (default {STATE_DIR}/served.json)")
    parser.add_argument("--device", default="cuda", help="for the engine and transformers (the server picks its own)")
    parser.add_argument("--quick", action="store_true", help="short points and sweeps: the CPU smoke run")
    parser.add_argument("--clients", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                        help="client processes of the load generator")
    parser.add_argument("--budget-s", type=float, default=570.0, help="the whole run ends its last phase by then")
    parser.add_argument("--model-repository", type=Path,
                        help="serve this repository instead of the packaged one (the ceiling replaces its whisper)")
    add_instances_option(parser)  # for the ceiling and the served phases
    parser.add_argument("--gpus", help="the server's GPUs (`serve --gpus`, e.g. 0 or 0,1); the engine phase uses --device. "
                        "Compare GPU counts with one --results file each")
    parser.add_argument("--engine-processes", default="auto",
                        help="engine processes of the engine phase (auto: as many as `serve` runs on one GPU)")
    parser.add_argument("--quantize", choices=[q.value for q in Quantization],
                        help="`serve --quantize` for the served phases, and the engine phase's (default: exact)")
    parser.add_argument("--tokens-per-second", type=float,
                        help="forced lengths of random-weight models (default: tiny's, from the results file)")
    parser.add_argument("--parameter", action="append", type=request_parameter, default=[], metavar="KEY=VALUE",
                        help="a request parameter for every request (VALUE read as JSON, else as text), e.g. "
                        "beam_size=5; real weights only")  # fmt: skip
    args = parser.parse_args(argv)
    args.parameters = dict(args.parameter)
    if args.parameters:
        if MODELS[args.model].random:
            parser.error("--parameter: random weights decode forced lengths greedily; use --model tiny")
        try:
            parse_request_parameters({**REQUEST_PARAMETERS, **args.parameters})
        except RequestError as error:
            parser.error(f"--parameter: {error}")
    args.results = args.results or STATE_DIR / "served.json"
    args.instances = dict(args.instances)
    args.deadline = time.monotonic() + args.budget_s
    return args


def request_parameter(text: str) -> tuple[str, object]:
    key, equals, value = text.partition("=")
    if not key or not equals:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings.quick() if args.quick else Settings()
    spec = MODELS[args.model]
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    if args.instances:  # the ceiling's stand-in repository is made from this copy
        args.model_repository = repository_with_instances(args.instances, STATE_DIR / "instances-repository",
                                                          args.model_repository)
    results = Results(args.results, args.out)
    run = {"id": len(results.data["runs"]), "model": args.model, "phases": args.phases, "quick": args.quick,
           "settings": asdict(settings), "client_processes": args.clients, "gpus": args.gpus,
           "instances": {model: asdict(group) for model, group in args.instances.items()},
           "added_parameters": args.parameters, "quantize": args.quantize or "none", **provenance()}
    results.data["runs"].append(run)
    say(f"run {run['id']}: commit {run['commit']} (dirty: {run['dirty']}, checked by {run['checked_by']}), "
        f"{run['machine']['gpu'] or 'no GPU'}, {run['machine']['cpu_count']} CPUs")
    model = results.model(args.model)
    checkpoint = served_checkpoint(spec)
    rate = None
    if spec.random:
        rate = args.tokens_per_second or tokens_per_second_from(results)
        model["forced_tokens_per_audio_s"] = rate
    jobs = with_references(make_jobs(spec, checkpoint, rate, settings, args.parameters), checkpoint, args.device, say)
    model.update({"source": spec.source, "checkpoint": checkpoint, "random_weights": spec.random,
                  "request_parameters": "per clip" if spec.random else jobs[0].parameters,
                  "clips": [j.describe() for j in jobs]})
    results.save()
    say(f"{len(jobs)} clips, {sum(j.audio.clip.duration_s for j in jobs):.0f} s of audio"
        + (f", forced at {rate} tokens per second" if rate else ""))
    remaining = [phase for phase in PHASES if phase in args.phases]
    while remaining:  # time a phase leaves unused goes to the ones after it
        phase = remaining[0]
        budget = phase_budgets(remaining, settings, args.deadline - time.monotonic())[phase]
        run_phase(phase, spec, checkpoint, jobs, args, settings, results, run["id"], budget)
        remaining.pop(0)
    report.write_served_report(args.results, args.out)
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
