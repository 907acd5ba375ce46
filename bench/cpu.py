"""CPU benchmark: the served path, float32 and int8, against faster-whisper int8, side by side, on the shared clips.

    python -m bench.cpu --out docs/benchmarks

Every system transcribes the recordings of tests/data/audio (manifest.tsv) as
WAV files, audio decoding included, with timestamps on and greedy decoding
(temperature fallback as each ships it), `--rounds` times over, from
`--concurrency` client threads:
- served: `whisper-triton serve` as shipped (packaged tiny.en), gRPC `transcribe`;
- served int8: the same, started with `--quantize int8` (both servers run
  throughout; the one not measured is idle);
- faster-whisper: the same CTranslate2 folder the packaged checkpoint is, int8,
  `WhisperModel.transcribe` (beam_size=1) and `BatchedInferencePipeline`, its
  thread counts and batch size tuned first (one round per setting);
- library: `Pipeline.transcribe` in this process, to tell the engine's cost
  from the server's.
Systems take turns within each of `--repeats` repetitions, so a busy machine
slows them alike; the spread over repetitions is reported. Writes
`<out>/cpu.json` as it goes and `<out>/cpu.md` at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from bench.repository_copy import Instances, add_instances_option, repository_with_instances
from bench.triton_stats import model_stats, stats_delta

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY / "tests"))  # the tests' clips and text normalisation, so WERs match theirs
from reference import Clip, clips, normalize, word_error_rate  # noqa: E402

CONCURRENCY = 4
ROUNDS = 2
REPEATS = 3
STARTUP_TIMEOUT_S = 600.0
# faster-whisper settings tried before the measured repetitions: (cpu_threads, client threads).
FW_THREADS = ((1, 1), (2, 1), (1, 4), (2, 4))
FW_BATCH_SIZES = (1, 2, 4, 8, 16)
FW_DEFAULT_BATCH = 8
# Triton's Python-backend stubs, told apart by the model file they run.
SERVED_MODELS = ("preprocessing", "whisper")
# The served systems: `whisper-triton serve` with these flags.
SERVED_SYSTEMS = {"served": (), "served int8": ("--quantize", "int8")}


_STARTED = time.perf_counter()


def say(message: str) -> None:
    """Progress on stdout, stamped with the seconds since the run started."""
    print(f"[{time.perf_counter() - _STARTED:7.1f} s] {message}", flush=True)


@dataclass(frozen=True)
class Recording:
    clip: Clip
    data: bytes  # the WAV file, as a client would send it


Transcriber = Callable[[Recording], str]


@dataclass
class Measurement:
    system: str
    setting: str
    repeat: int
    audio_s: float
    wall_s: float
    cpu_s: float  # every process that did the work: this one, and the server's
    load_before: float  # 1-minute load average of the machine
    load_after: float
    cpu_by_process: dict[str, float] = field(default_factory=dict)
    triton_models: dict = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)  # file -> transcript of the first round

    @property
    def rtfx(self) -> float:
        return self.audio_s / self.wall_s

    def record(self, references: dict[str, Clip]) -> dict:
        errors, words = corpus_errors(self.texts, references)
        return {
            **asdict(self),
            "rtfx": round(self.rtfx, 2),
            "cpu_s_per_audio_s": round(self.cpu_s / self.audio_s, 4),
            "wer": round(errors / words, 4),
        }


def corpus_errors(texts: dict[str, str], references: dict[str, Clip]) -> tuple[float, int]:
    """Word errors summed over the clips, and the reference words they are out of."""
    errors = words = 0
    for file, text in texts.items():
        reference = normalize(references[file].transcript)
        errors += word_error_rate(normalize(text), reference) * len(reference)
        words += len(reference)
    return round(errors), words


def run_load(transcribe: Transcriber, recordings: list[Recording], rounds: int, concurrency: int) -> tuple[float, dict]:
    """Send every recording `rounds` times from `concurrency` threads; (wall seconds, first round's texts)."""
    work = [r for _ in range(rounds) for r in recordings]
    counter = itertools.count()
    texts: dict[str, str] = {}
    lock = threading.Lock()

    def worker() -> None:
        while (i := next(counter)) < len(work):
            text = transcribe(work[i])
            if i < len(recordings):
                with lock:
                    texts[work[i].clip.file] = text

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    return time.perf_counter() - start, texts


def per_thread(make: Callable[[], Transcriber]) -> Transcriber:
    """A transcriber whose state (a connection) is made once per client thread."""
    local = threading.local()

    def transcribe(recording: Recording) -> str:
        if not hasattr(local, "transcribe"):
            local.transcribe = make()
        return local.transcribe(recording)

    return transcribe


# ------------------------------------------------------------------ served


@dataclass
class Served:
    """A `whisper-triton serve` process and its ports."""

    process: subprocess.Popen
    grpc_url: str
    ready_s: float

    def process_cpu(self) -> dict[str, float]:
        """CPU seconds so far of the launcher, tritonserver, and each model's stub."""
        import psutil

        root = psutil.Process(self.process.pid)
        out: dict[str, float] = {}
        for process in [root, *root.children(recursive=True)]:
            try:
                times, command = process.cpu_times(), " ".join(process.cmdline())
            except psutil.Error:
                continue
            name = next((m for m in SERVED_MODELS if f"/{m}/1/model.py" in command), None)
            name = name or ("tritonserver" if "tritonserver" in command else "launcher")
            out[name] = out.get(name, 0.0) + times.user + times.system
        return out

    def transcriber(self) -> Transcriber:
        from clients.api import Protocol, WhisperClient

        def make() -> Transcriber:
            client = WhisperClient(self.grpc_url, Protocol.GRPC, timeout_s=STARTUP_TIMEOUT_S)
            return lambda recording: client.transcribe(recording.data, timestamps=True).text

        return per_thread(make)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def served(log_path: Path, environment: dict[str, str], instances: dict[str, Instances] | None = None,
           flags: tuple[str, ...] = ()) -> Iterator[Served]:  # fmt: skip
    """`whisper-triton serve` with the packaged checkpoint on free ports and `flags`; the
    packaged repository, or a copy of it with other instance counts."""
    from clients.api import Protocol, WhisperClient

    http, grpc, metrics = _free_port(), _free_port(), _free_port()
    command = [sys.executable, "-m", "whisper_triton.cli", "serve",
               f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}", *flags]  # fmt: skip
    if instances:
        command += ["--model-repository", str(repository_with_instances(instances, log_path.parent / "cpu-repository"))]
    say(f"served: starting {' '.join(command[2:])} (log: {log_path})")
    started = time.perf_counter()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **environment})  # fmt: skip
    try:
        probe = WhisperClient(f"localhost:{grpc}", Protocol.GRPC)
        while not probe.is_ready():
            if process.poll() is not None or time.perf_counter() - started > STARTUP_TIMEOUT_S:
                raise RuntimeError(f"the server did not become ready:\n{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        server = Served(process, f"localhost:{grpc}", time.perf_counter() - started)
        say(f"served: ready after {server.ready_s:.1f} s")
        yield server
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# ------------------------------------------------------------------ faster-whisper and the library


def ctranslate2_folder() -> Path:
    """The CTranslate2 tiny.en folder that the packaged `default` checkpoint is read from."""
    from python_backend_lib.checkpoints.packaged import packaged_model_directory

    return packaged_model_directory()


# faster-whisper's own defaults (temperature fallback, thresholds, conditioning on
# previous text) except beam search, which is greedy here as ours is.
FW_OPTIONS = dict(beam_size=1, language="en", without_timestamps=False)


def faster_whisper_transcriber(cpu_threads: int, workers: int, batch_size: int | None) -> Transcriber:
    """batch_size None: `WhisperModel.transcribe`; else `BatchedInferencePipeline` with its
    default VAD (it cuts long audio only with VAD or given clip times)."""
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    model = WhisperModel(str(ctranslate2_folder()), device="cpu", compute_type="int8",
                         cpu_threads=cpu_threads, num_workers=workers)  # fmt: skip
    if batch_size is None:
        run, extra = model.transcribe, {}
    else:
        run, extra = BatchedInferencePipeline(model).transcribe, {"batch_size": batch_size}

    def transcribe(recording: Recording) -> str:
        segments, _ = run(io.BytesIO(recording.data), **FW_OPTIONS, **extra)
        return "".join(segment.text for segment in segments).strip()

    return transcribe


def library_transcriber(threads: int | None) -> tuple[Transcriber, Callable[[], None]]:
    import torch

    from python_backend_lib.core.options import DecodingOptions, TranscribeOptions
    from python_backend_lib.transcription.pipeline import Pipeline

    if threads:
        torch.set_num_threads(threads)
    pipeline = Pipeline.load("default", device="cpu")
    options = TranscribeOptions(decoding=DecodingOptions(timestamps=True))
    return (lambda recording: pipeline.transcribe(recording.data, options).text), pipeline.close


# ------------------------------------------------------------------ running


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def measure(system: str, setting: str, repeat: int, transcribe: Transcriber, recordings: list[Recording],
            args: argparse.Namespace, server: Served | None = None, rounds: int | None = None) -> Measurement:  # fmt: skip
    rounds = rounds or args.rounds
    load_before = load_average()
    cpu_before = time.process_time()
    processes_before = server.process_cpu() if server else {}
    triton_before = model_stats(server.grpc_url) if server else {}
    wall, texts = run_load(transcribe, recordings, rounds, args.concurrency)
    by_process = {"client" if server else "this process": time.process_time() - cpu_before}
    if server:
        by_process |= {k: v - processes_before.get(k, 0.0) for k, v in server.process_cpu().items()}
    measurement = Measurement(
        system=system, setting=setting, repeat=repeat, audio_s=rounds * sum(r.clip.duration for r in recordings),
        wall_s=wall, cpu_s=sum(by_process.values()), load_before=load_before, load_after=load_average(),
        cpu_by_process={k: round(v, 2) for k, v in by_process.items()},
        triton_models=stats_delta(triton_before, model_stats(server.grpc_url)) if server else {}, texts=texts,
    )  # fmt: skip
    say(f"{system:24s} {setting:38s} RTFx {measurement.rtfx:6.2f}  wall {wall:6.1f} s  CPU {measurement.cpu_s:6.1f} s"
        f"  load {load_before:.1f}->{measurement.load_after:.1f}  {measurement.cpu_by_process}")
    return measurement


def cpu_identity(cpuinfo: str) -> dict:
    """The CPU as /proc/cpuinfo names it. A virtual machine may name only the vendor and
    line ("AMD EPYC"); the family and model tell its generations apart, and AVX-512 is
    what changes both engines' float arithmetic, and so which of two near-tied tokens wins."""
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block names them all
        key, _, value = line.partition(":")
        first[key.strip()] = value.strip()
    return {
        "cpu": first.get("model name") or platform.processor(),
        "cpu_family": first.get("cpu family"),
        "cpu_model": first.get("model"),
        "avx512": "avx512f" in first.get("flags", "").split(),
    }


def machine() -> dict:
    versions = {}
    for package in ("torch", "ctranslate2", "faster-whisper", "nvidia-pytriton"):
        with contextlib.suppress(Exception):
            import importlib.metadata

            versions[package] = importlib.metadata.version(package)
    identity = cpu_identity(Path("/proc/cpuinfo").read_text())
    return {**identity, "cores": os.cpu_count(), "python": platform.python_version(), **versions}


def commit() -> dict:
    def git(*arguments: str) -> str:
        return subprocess.run(["git", *arguments], cwd=REPOSITORY, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


class Results:
    def __init__(self, path: Path, references: dict[str, Clip], header: dict) -> None:
        self.path, self.references = path, references
        self.data: dict = {**header, "tuning": [], "measurements": []}

    def add(self, section: str, measurement: Measurement) -> None:
        self.data[section].append(measurement.record(self.references))
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1))


def tune_faster_whisper(recordings: list[Recording], args: argparse.Namespace, results: Results) -> dict[str, tuple]:
    """One round per setting; the fastest (cpu_threads, workers, batch_size) of each pipeline."""
    best: dict[str, tuple[float, tuple]] = {}

    def trial(system: str, threads: int, workers: int, batch: int | None) -> None:
        transcribe = faster_whisper_transcriber(threads, workers, batch)
        transcribe(recordings[0])  # warm-up
        setting = fw_setting(threads, workers, batch)
        measurement = measure(system, setting, 0, transcribe, recordings,
                              argparse.Namespace(**{**vars(args), "concurrency": workers}), rounds=1)  # fmt: skip
        results.add("tuning", measurement)
        if measurement.rtfx > best.get(system, (0.0, ()))[0]:
            best[system] = (measurement.rtfx, (threads, workers, batch))

    for threads, workers in FW_THREADS:
        trial("faster-whisper", threads, workers, None)
        trial("faster-whisper batched", threads, workers, FW_DEFAULT_BATCH)
    threads, workers, _ = best["faster-whisper batched"][1]
    for batch in FW_BATCH_SIZES:
        if batch != FW_DEFAULT_BATCH:
            trial("faster-whisper batched", threads, workers, batch)
    return {system: setting for system, (_, setting) in best.items()}


def fw_setting(threads: int, workers: int, batch: int | None) -> str:
    text = f"int8, cpu_threads={threads}, {workers} client thread{'s' * (workers > 1)}"
    return text + (f", batch_size={batch}" if batch else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="times every clip is sent per measurement")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="measurements per system, taking turns")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="client threads (served, library)")
    parser.add_argument("--no-library", action="store_true", help="skip the in-process library")
    parser.add_argument("--no-int8", action="store_true", help="skip the server started with --quantize int8")
    parser.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the server (e.g. to try thread settings)")  # fmt: skip
    add_instances_option(parser)
    args = parser.parse_args(argv)

    environment = dict(item.split("=", 1) for item in args.server_env)
    instances = dict(args.instances)
    changes = args.server_env + [f"{model} {group.describe()}" for model, group in instances.items()]
    references = {clip.file: clip for clip in clips()}
    recordings = [Recording(clip, clip.read()) for clip in references.values()]
    audio = sum(c.duration for c in references.values())
    header = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python -m bench.cpu", *(argv or sys.argv[1:])]),
        **commit(), "machine": machine(), "clips": [{"file": c.file, "duration_s": c.duration} for c in references.values()],
        "audio_s_per_round": audio, "rounds": args.rounds, "repeats": args.repeats, "concurrency": args.concurrency,
        "decoding": {"served, served int8 and library": "greedy, timestamps, temperature fallback 0.0-1.0 by 0.2 "
                                                        "(openai-whisper's)",
                     "faster-whisper": f"{FW_OPTIONS} and faster-whisper's defaults otherwise",
                     "faster-whisper batched": "as faster-whisper, its pipeline's defaults: VAD on, no fallback"},
        "server_changes": changes,
    }  # fmt: skip
    results = Results(args.out / "cpu.json", references, header)
    say(f"{len(recordings)} clips, {audio:.1f} s of audio per round; {machine()}; load {load_average()}")

    best = tune_faster_whisper(recordings, args, results)
    say(f"faster-whisper, best settings: {best}")
    systems: list[tuple[str, str, Transcriber]] = []
    for system, (threads, workers, batch) in best.items():
        systems.append((system, fw_setting(threads, workers, batch), faster_whisper_transcriber(threads, workers, batch)))
    closers = []
    if not args.no_library:
        transcribe, close = library_transcriber(None)
        systems.append(("library", f"Pipeline.transcribe, {args.concurrency} threads", transcribe))
        closers.append(close)
    servers: dict[str, Served] = {}
    try:
        with contextlib.ExitStack() as stack:
            changes_text = ", ".join(changes) if changes else "as shipped"
            for position, (system, flags) in enumerate(SERVED_SYSTEMS.items()):
                if flags and args.no_int8:
                    continue
                log = args.out / f"cpu-serve{'-' + '-'.join(f.strip('-') for f in flags) if flags else ''}.log"
                servers[system] = stack.enter_context(served(log, environment, instances, flags))
                setting = " ".join(["whisper-triton serve", *flags]) + f", gRPC, {changes_text}"
                systems.insert(position, (system, setting, servers[system].transcriber()))
            for _, _, transcribe in systems:  # warm-up: connections, first allocations
                run_load(transcribe, recordings[:4], 1, args.concurrency)
            for repeat in range(1, args.repeats + 1):
                for system, setting, transcribe in systems:
                    concurrency = best.get(system, (0, args.concurrency))[1]
                    run_args = argparse.Namespace(**{**vars(args), "concurrency": concurrency})
                    results.add("measurements", measure(system, setting, repeat, transcribe, recordings, run_args,
                                                        servers.get(system)))  # fmt: skip
            results.data["server_ready_s"] = {system: round(server.ready_s, 1) for system, server in servers.items()}
            results.save()
    finally:
        for close in closers:
            close()
    from bench.cpu_report import write_report

    write_report(results.data, args.out)
    say(f"wrote {args.out / 'cpu.json'} and {args.out / 'cpu.md'}")


if __name__ == "__main__":
    main()
