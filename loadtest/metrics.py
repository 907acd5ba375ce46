"""The models' own metrics (whisper_*, preprocessing_*), read from Triton's metrics endpoint.

Each such series carries its instance's labels: `gpu` (its device, "cpu" on the CPU)
and `instance` (Triton's name for it). The load tools look at the server as a whole,
so they key samples by name and their other labels only, summed over the instances:
`whisper_requests_total{outcome="success"}`, `whisper_requests_in_flight`.
"""

from __future__ import annotations

import re
import urllib.request

ENGINE_LABELS = re.compile(r'(?:gpu|instance)="[^"]*",?')


def whisper_samples(metrics_url: str) -> dict[str, float]:
    """Every whisper_* sample: 'name{other labels}' (or 'name') -> its value summed over the engines."""
    return model_samples(metrics_url, "whisper_")


def model_samples(metrics_url: str, prefix: str) -> dict[str, float]:
    """Every sample whose name starts with `prefix`, as `whisper_samples` reads whisper's."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith(prefix):
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


SAMPLE_LINE = re.compile(r'^(?P<name>whisper_\w+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$')
LABEL = re.compile(r'(\w+)="([^"]*)"')


def per_instance(metrics_url: str, name: str, model: str = "whisper", **match: str) -> dict[str, float]:
    """One whisper_* series per engine of `model` (Triton names its instances
    <model>_<group>_<n>): "gpu<label>/<instance>" -> its value, for the samples of `name`
    whose other labels include `match` (outcome="success", say). A load that looks
    healthy summed over the engines can hide one engine that stopped answering."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        sample = SAMPLE_LINE.match(line)
        if sample is None or sample["name"] != name:
            continue
        labels = dict(LABEL.findall(sample["labels"]))
        instance = labels.get("instance", "")
        if instance.rsplit("_", 2)[0] == model and all(labels.get(k) == v for k, v in match.items()):
            key = f"gpu{labels.get('gpu', '?')}/{instance}"  # Triton reuses instance names on every GPU
            values[key] = values.get(key, 0.0) + float(sample["value"])
    return values
