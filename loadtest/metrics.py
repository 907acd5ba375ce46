"""The whisper model's own metrics (whisper_*), read from Triton's metrics endpoint.

Each whisper_* series carries its engine's labels: `gpu` (its device, "cpu" on
the CPU) and `instance` (Triton's name for it). The load tools look at the
server as a whole, so they key samples by name and their other labels only,
summed over the engines: `whisper_requests_total{outcome="success"}`,
`whisper_requests_in_flight`.
"""

from __future__ import annotations

import re
import urllib.request

ENGINE_LABELS = re.compile(r'(?:gpu|instance)="[^"]*",?')


def whisper_samples(metrics_url: str) -> dict[str, float]:
    """Every whisper_* sample: 'name{other labels}' (or 'name') -> its value summed over the engines."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("whisper_"):
            name, _, value = line.rpartition(" ")
            name = ENGINE_LABELS.sub("", name).replace(",}", "}").removesuffix("{}")
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def whisper_gauge(metrics_url: str, name: str) -> float:
    """One whisper_* gauge; ValueError when the endpoint has none of that name."""
    samples = whisper_samples(metrics_url)
    if name not in samples:
        raise ValueError(f"no {name} at {metrics_url}")
    return samples[name]
