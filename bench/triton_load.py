"""The Triton part of `bench.gpu`: start `whisper-triton serve` on a random
checkpoint, send LibriSpeech-like clips over HTTP and gRPC at several
concurrencies, record RTFx, requests/s and latency percentiles.

Each client thread holds its own connection and sends one request at a time,
so `concurrency` is the number of requests in flight. Audio goes as 16-bit WAV
files, so the server's audio decoding and log-mel are measured too.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.clips import wav_bytes
from bench.triton_stats import model_stats, stats_delta
from bench.workloads import librispeech_like, noise

DISTINCT_CLIPS = 32
SHORT_CLIP_S = 5.0  # the latency target's clip
TOKENS = 30
REQUESTS_AT = {1: 64, 8: 128, 64: 256, 256: 512}


def repository_with_instances(counts: dict[str, int], directory: Path) -> Path:
    """A copy of the packaged model repository with other instance counts (CPU models only)."""
    import re
    import shutil

    from python_backend_lib.apps.server import packaged_model_repository

    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(packaged_model_repository(), directory, ignore=shutil.ignore_patterns("__pycache__"))
    for model, count in counts.items():
        config = directory / model / "config.pbtxt"
        text, n = re.subn(r"count:\s*\d+", f"count: {count}", config.read_text())
        if n != 1:
            raise ValueError(f"{config}: expected one instance count, found {n}")
        config.write_text(text)
    return directory


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _gpu_memory_used_gib() -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        ).stdout
        return round(float(out.split()[0]) / 1024, 2)
    except Exception:
        return None


class _Load:
    """Requests sent from `concurrency` threads, each with its own client."""

    def __init__(self, url: str, protocol: str, options: dict) -> None:
        self.url, self.protocol, self.options = url, protocol, options
        self._local = threading.local()

    def _client(self):
        from clients.api import WhisperClient

        if not hasattr(self._local, "client"):
            self._local.client = WhisperClient(self.url, self.protocol, timeout_s=600)
        return self._local.client

    def one(self, data: bytes) -> tuple[float, int]:
        """(latency, words in the transcript: one per text token with the served word-level tokenizer)"""
        start = time.perf_counter()
        result = self._client().transcribe(data, **self.options)
        return time.perf_counter() - start, len(result.text.split())

    def run(self, clips: list[tuple[bytes, float]], n: int, concurrency: int) -> dict:
        counter = itertools.count()
        latencies: list[float] = []
        seconds: list[float] = []
        words: list[int] = []
        lock = threading.Lock()

        def worker() -> None:
            while (i := next(counter)) < n:
                data, duration = clips[i % len(clips)]
                latency, n_words = self.one(data)
                with lock:
                    latencies.append(latency)
                    seconds.append(duration)
                    words.append(n_words)

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            for future in [pool.submit(worker) for _ in range(concurrency)]:
                future.result()
        wall = time.perf_counter() - start
        ms = np.array(latencies) * 1e3
        return {
            "requests": n,
            "audio_s": round(float(sum(seconds)), 1),
            "wall_s": round(wall, 3),
            "rtfx": round(float(sum(seconds)) / wall, 1),
            "requests_per_s": round(n / wall, 1),
            "mean_text_tokens": round(float(np.mean(words)), 1),
            **{f"p{q}_ms": round(float(np.percentile(ms, q)), 2) for q in (50, 95, 99)},
        }


def run_triton(args, results, say, *, instances: dict[str, int] | None = None,
               protocols=None, concurrencies=None, threads: int | None = None) -> None:
    """instances: serve a copy of the repository with these instance counts;
    threads: OMP_NUM_THREADS for the server's processes (torch's CPU threads)."""
    model = args.triton_model
    protocols = protocols or args.triton_protocols
    concurrencies = concurrencies or args.triton_concurrency
    label = "as shipped" if not instances else ", ".join(f"{m} x{c}" for m, c in instances.items())
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        label += f", {threads} CPU threads each"
    ports = {"http": _free_port(), "grpc": _free_port(), "metrics": _free_port()}
    log_path = Path(args.profile_dir or args.out) / f"triton-serve-{model}{'-instances' if instances else ''}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    from bench.served_checkpoint import write_served_checkpoint

    source = f"random:{model}:0"  # the weights of the offline runs
    checkpoint = write_served_checkpoint(source, Path("/tmp") / f"served-{model}")
    repository = []
    if instances:
        repository = ["--model-repository", str(repository_with_instances(instances, Path("/tmp/repo-instances")))]
    command = [
        sys.executable, "-m", "python_backend_lib.apps.cli", "serve", "--checkpoint", str(checkpoint), *repository,
        f"--http-port={ports['http']}", f"--grpc-port={ports['grpc']}", f"--metrics-port={ports['metrics']}",
    ]
    say(f"triton: starting {' '.join(command[2:])}")
    started = time.perf_counter()
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        urls = {"http": f"localhost:{ports['http']}", "grpc": f"localhost:{ports['grpc']}"}
        from clients.api import WhisperClient

        first = protocols[0]  # the only client library carried may be this one
        probe = WhisperClient(urls[first], first)
        while not probe.is_ready():
            if server.poll() is not None or time.perf_counter() - started > args.triton_startup_s:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the server did not become ready:\n{tail}")
            time.sleep(0.5)
        ready_s = time.perf_counter() - started
        say(f"triton: ready after {ready_s:.1f} s")

        workload = librispeech_like(DISTINCT_CLIPS, seed=1)
        clips = [(wav_bytes(noise(d, seed=i)), d) for i, d in enumerate(workload.durations)]
        short = [(wav_bytes(noise(SHORT_CLIP_S, seed=99)), SHORT_CLIP_S)]
        # Forced lengths on random weights: no fallback re-decoding of "unlikely" windows.
        options = {"language": "en", "max_new_tokens": TOKENS, "min_new_tokens": TOKENS, "temperature_increment": 0}
        forced = True
        try:
            _Load(urls[first], first, options).one(short[0][0])
        except Exception as error:  # the served parameters may lack min_new_tokens
            say(f"triton: min_new_tokens refused ({error}); lengths are not forced")
            options.pop("min_new_tokens")
            forced = False
            _Load(urls[first], first, options).one(short[0][0])
        common = {"model": model, "repository": label, "checkpoint": f"{source} weights, word-level tokenizer", "forced_tokens": forced, "max_new_tokens": TOKENS, "server_ready_s": round(ready_s, 1)}

        for protocol in protocols:
            load = _Load(urls[protocol], protocol, options)
            load.run(clips, 16, 8)  # warm-up: connections, allocator, every bucket up to 8
            before = model_stats(urls["grpc"])
            record = load.run(short, 64, 1)
            record["models"] = stats_delta(before, model_stats(urls["grpc"]))
            results.add("triton", {**common, "protocol": protocol, "concurrency": 1, "workload": "5s-clip", **record})
            say(f"triton [{label}] {protocol} 5 s clip, concurrency 1: p50 {record['p50_ms']} ms, "
                f"p99 {record['p99_ms']} ms; per model {record['models']}")
            for concurrency in concurrencies:
                n = REQUESTS_AT.get(concurrency, 4 * concurrency)
                before = model_stats(urls["grpc"])
                record = load.run(clips, n, concurrency)
                record["models"] = stats_delta(before, model_stats(urls["grpc"]))
                record["gpu_memory_used_gib"] = _gpu_memory_used_gib()
                results.add("triton", {**common, "protocol": protocol, "concurrency": concurrency,
                                       "workload": "librispeech-like", **record})
                say(f"triton [{label}] {protocol:4s} concurrency {concurrency:3d}: RTFx {record['rtfx']:8.1f} "
                    f"{record['requests_per_s']:7.1f} req/s p50 {record['p50_ms']:8.1f} ms p99 {record['p99_ms']:8.1f} ms; "
                    f"per model {record['models']}")
    finally:
        with_group = os.getpgid(server.pid) if server.poll() is None else None
        if with_group is not None:
            os.killpg(with_group, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(with_group, signal.SIGKILL)
        say(f"triton: server log in {log_path}")
