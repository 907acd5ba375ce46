"""The log-mel of several clips as one CUDA graph replay (`FeatureGraphs`).

Eagerly, `audio.features.features_for_many` launches about twenty PyTorch
operations per call. At one clip their host time (`execute`'s share before the
engine has the request) is latency, and under
load it holds the GIL that the engine thread needs. Clips of up to 30 s all
become one 30 s window, so the same operations are captured once per bucket of
clips (`BUCKETS`) and replayed: the host writes the clips end to end into pinned
memory, one copy takes them to the device, and the graph pads each to 30 s
(zeros after its own samples, as `pad_or_trim` does) and computes its log-mel.
Longer recordings keep the eager path. The features equal `features_for`'s, bit
for bit (tests/gpu/test_gpu_features.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np
import torch

from python_backend_lib.audio.features import features_for, log_mel_spectrogram
from python_backend_lib.core.geometry import N_SAMPLES
from python_backend_lib.devices.buckets import bucket_sizes, choose_bucket
from python_backend_lib.devices.graph_capture import CapturedGraph, capture_graphs
from python_backend_lib.devices.placement import on_device
from python_backend_lib.devices.transfers import PinnedRing

log = logging.getLogger(__name__)

# Clips per captured replay; a call with more clips replays the largest in turns.
# The graphs' memory grows with the largest (the STFT's complex spectrum above all);
# `capture` logs it.
BUCKETS = (1, 2, 4, 8, 16)
OFFSET, LENGTH = 0, 1  # rows of a bucket's [2, clips] metadata: where each clip starts, its samples


class _Bucket:
    """One captured replay's buffers for `clips` clips: its static input and metadata."""

    def __init__(self, clips: int, device: torch.device) -> None:
        self.clips = clips
        self.samples = torch.zeros(clips * N_SAMPLES, dtype=torch.float32, device=device)
        self.meta = torch.zeros(2, clips, dtype=torch.long, device=device)
        self.staged_samples = PinnedRing((clips * N_SAMPLES,), torch.float32, depth=2)
        self.staged_meta = PinnedRing((2, clips), torch.long, depth=2)


class FeatureGraphs:
    """Captured log-mel passes for up to max(BUCKETS) clips of up to 30 s at a time, on one GPU."""

    def __init__(self, n_mels: int, device: torch.device, buckets: Sequence[int] = BUCKETS) -> None:
        self.n_mels = n_mels
        self.device = device
        self.buckets = bucket_sizes(max(buckets), buckets)
        self._columns = torch.arange(N_SAMPLES, device=device)
        self._by_clips: dict[int, CapturedGraph[_Bucket, torch.Tensor]] = {}
        self._lock = threading.Lock()  # one replay at a time: the buckets' buffers are shared
        self.capture_bytes = 0

    def capture(self) -> None:
        """Capture every bucket (`devices.graph_capture`)."""
        with on_device(self.device):
            self._by_clips, cost = capture_graphs(
                self.buckets, lambda clips: _Bucket(clips, self.device), self._forward, self.device
            )
        self.capture_bytes = cost.bytes
        log.info("captured the log-mel for %s clips, holding %.1f MiB", self.buckets, self.capture_bytes / 2**20)

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        """The captured work: [clips, N_SAMPLES] zero-padded clips -> their log-mel
        [clips, n_mels, N_FRAMES], rewritten by every replay."""
        offsets, lengths = bucket.meta[OFFSET], bucket.meta[LENGTH]
        index = (offsets[:, None] + self._columns).clamp(max=bucket.samples.numel() - 1)  # [clips, N_SAMPLES]
        padded = torch.where(self._columns < lengths[:, None], bucket.samples[index], 0.0)
        return log_mel_spectrogram(padded, self.n_mels)

    def features(self, waveforms: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Each recording's log-mel, as `audio.features.features_for` gives it, on the
        device, without waiting for it (the copies come from pinned memory); from any thread."""
        with on_device(self.device):  # the replays go to the current device's stream
            return self._features(waveforms)

    def _features(self, waveforms: Sequence[np.ndarray]) -> list[torch.Tensor]:
        results: list[torch.Tensor | None] = [None] * len(waveforms)
        short = []
        for i, waveform in enumerate(waveforms):
            if len(waveform) <= N_SAMPLES:
                short.append(i)
            else:
                results[i] = features_for(waveform, self.n_mels, self.device)
        largest = self.buckets[-1]
        for start in range(0, len(short), largest):
            chunk = short[start : start + largest]
            for i, item in zip(chunk, self._replay([waveforms[i] for i in chunk])):
                results[i] = item
        return results

    def _replay(self, waveforms: Sequence[np.ndarray]) -> torch.Tensor:
        """[len(waveforms), n_mels, N_FRAMES]: one replay of the smallest bucket that holds them."""
        n = len(waveforms)
        captured = self._by_clips[choose_bucket(self.buckets, n)]
        bucket = captured.buffers
        arrays = [np.asarray(w, dtype=np.float32).reshape(-1) for w in waveforms]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        total = int(lengths.sum())
        with self._lock:
            samples, meta = bucket.staged_samples.take(), bucket.staged_meta.take()
            np.concatenate(arrays, out=samples.buffer.numpy()[:total])
            staged = meta.buffer.numpy()
            staged[:, n:] = 0  # padding clips: no samples
            staged[OFFSET, :n] = np.cumsum(lengths) - lengths
            staged[LENGTH, :n] = lengths
            bucket.samples[:total].copy_(samples.buffer[:total], non_blocking=True)
            bucket.staged_samples.queued(samples)
            bucket.meta.copy_(meta.buffer, non_blocking=True)
            bucket.staged_meta.queued(meta)
            return captured.replay()[:n].clone()  # the next replay rewrites the graph's output
