"""Variants of the model repository for a benchmark: a copy, with a model replaced
(bench.standin) or other instance counts (--instances of bench.cpu and bench.served)."""

from __future__ import annotations

import argparse
import re
import shutil
from dataclasses import dataclass
from pathlib import Path


def copy_repository(directory: Path, source: Path | None = None) -> Path:
    """Copy the model repository `source` (default: the packaged one) to `directory`, emptied first."""
    from python_backend_lib.apps.server import packaged_model_repository

    source = source or packaged_model_repository()
    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(source, directory, ignore=shutil.ignore_patterns("__pycache__"))
    return directory


KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU", "auto": "KIND_AUTO"}


@dataclass(frozen=True)
class Instances:
    """A model's instance group in a repository copy: how many, and where (None: as configured)."""

    count: int
    kind: str | None = None  # a key of KINDS

    def describe(self) -> str:
        return f"x{self.count}" + (f" on {self.kind}" if self.kind else "")


def instance_group(item: str) -> tuple[str, Instances]:
    """One --instances item, `MODEL=COUNT[:KIND]` (e.g. preprocessing=4 or whisper=1:cpu), as argparse's `type`."""
    model, _, group = item.partition("=")
    count, _, kind = group.partition(":")
    if not model or not count.isdigit() or int(count) < 1 or (kind and kind not in KINDS):
        raise argparse.ArgumentTypeError(
            f"expected MODEL=COUNT[:KIND], with a count of 1 or more and a kind from {sorted(KINDS)}, "
            f"e.g. preprocessing=4 or whisper=1:cpu; got {item!r}"
        )
    return model, Instances(int(count), kind or None)


def add_instances_option(parser: argparse.ArgumentParser) -> None:
    """--instances, repeatable; `dict(args.instances)` is then {model: Instances}."""
    parser.add_argument("--instances", action="append", type=instance_group, default=[], metavar="MODEL=COUNT[:KIND]",
                        help="serve a copy of the repository with this many instances of a model, on KIND (cpu, gpu, "
                        "auto; default: as configured)")  # fmt: skip


def repository_with_instances(groups: dict[str, Instances], directory: Path, source: Path | None = None) -> Path:
    """A copy of the repository where each named model has the instance group given."""
    from python_backend_lib.apps.repository import InstanceGroup, read_instance_group, with_instance_group

    copy_repository(directory, source)
    for model, group in groups.items():
        config = directory / model / "config.pbtxt"
        text = config.read_text()
        kind = KINDS[group.kind] if group.kind else read_instance_group(text).kind
        config.write_text(with_instance_group(text, InstanceGroup(group.count, kind)))
    return directory


def with_parameter(config: str, key: str, value: str) -> str:
    """config.pbtxt text with the string parameter `key` set to `value`; ValueError if it has none."""
    pattern = rf'(key:\s*"{re.escape(key)}"\s*value:\s*\{{\s*string_value:\s*)"[^"]*"'
    text, count = re.subn(pattern, rf'\g<1>"{value}"', config)
    if count != 1:
        raise ValueError(f"expected one parameter {key!r}, found {count}")
    return text


def set_parameters(directory: Path, parameters: dict[str, dict[str, str]]) -> None:
    """In a repository copy, set each model's string parameters ({model: {key: value}})."""
    for model, values in parameters.items():
        config = directory / model / "config.pbtxt"
        text = config.read_text()
        for key, value in values.items():
            text = with_parameter(text, key, value)
        config.write_text(text)
