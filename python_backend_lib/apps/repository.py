"""The model repository `whisper-triton serve` hands to Triton: the one given, or a
copy in which the `whisper`, `preprocessing` and `postprocessing` models run other
instance counts.

An engine is one instance of the `whisper` model: one process with its own
Python interpreter, decoding with continuous batching. On a GPU, a small
checkpoint's engine is bound by that process's host work (its threads share one
GIL) while the GPU is mostly idle, so several engines on one GPU serve more, and
more preprocessing instances keep up with them; a large checkpoint keeps the GPU
busy with one (`settings.auto_instances_per_gpu`). `postprocessing` runs on the
CPU, one instance per engine of the whole server (at least the four written):
with four of them for sixteen engines on four GPUs, its queue filled and Triton
refused requests the engines had decoded. Triton takes an instance count
only from config.pbtxt, so counts other than the repository's mean a copy: a
temporary folder of links to the given models, with the changed models'
config.pbtxt rewritten.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from python_backend_lib.contract import tensor_names
from python_backend_lib.serving.settings import (
    AUTO,
    CHECKPOINT_ENV,
    DEFAULT_CHECKPOINT,
    STALL_TIMEOUT_ENV,
    GpuInstances,
    LogMelOutput,
    auto_instances_per_gpu,
    log_mel_handover,
)

# Settings start their line in config.pbtxt; comments may name them too.
_COUNT = re.compile(r"^(\s*)count:\s*(\d+)", re.M)
_KIND = re.compile(r"^(\s*)kind:\s*(KIND_\w+)", re.M)


@dataclass(frozen=True)
class InstanceGroup:
    """A model's one instance group: how many instances (per GPU, for GPU kinds), and where."""

    count: int
    kind: str  # KIND_AUTO, KIND_GPU or KIND_CPU


# What the packaged repository's models say: one engine, on each GPU or on the CPU,
# four preprocessing instances, likewise, and four postprocessing instances on the CPU.
SHIPPED_WHISPER_GROUP = InstanceGroup(1, "KIND_AUTO")
SHIPPED_PREPROCESSING_GROUP = InstanceGroup(4, "KIND_AUTO")
SHIPPED_POSTPROCESSING_GROUP = InstanceGroup(4, "KIND_CPU")


def read_instance_group(config: str) -> InstanceGroup:
    """The instance group of a config.pbtxt holding exactly one; ValueError otherwise."""
    counts, kinds = _COUNT.findall(config), _KIND.findall(config)
    if len(counts) != 1 or len(kinds) != 1:
        raise ValueError(f"expected one instance group, found {len(counts)} counts and {len(kinds)} kinds")
    return InstanceGroup(int(counts[0][1]), kinds[0][1])


def with_instance_group(config: str, group: InstanceGroup) -> str:
    """config.pbtxt text with its one instance group replaced by `group`."""
    read_instance_group(config)  # exactly one, or ValueError
    config = _COUNT.sub(rf"\g<1>count: {group.count}", config)
    return _KIND.sub(rf"\g<1>kind: {group.kind}", config)


def whisper_config(repository: Path) -> Path:
    return model_config(repository, tensor_names.WHISPER_NAME)


def stall_timeout_s(repository: Path, environ: dict[str, str]) -> float | None:
    """The whisper model's stall bound as its engines read it: the environment's
    (STALL_TIMEOUT_ENV), else its config's `stall_timeout_s`; None for "auto" or unreadable."""
    text = environ.get(STALL_TIMEOUT_ENV)
    if not text:
        config = whisper_config(repository)
        text = config_parameter(config.read_text(), "stall_timeout_s") if config.exists() else None
    try:
        return float(text) if text and text != AUTO else None
    except ValueError:
        return None  # the engines refuse it at start, naming it


def model_config(repository: Path, model: str) -> Path:
    return repository / model / "config.pbtxt"


def configured_checkpoint(config: str, environ: dict[str, str]) -> str:
    """The checkpoint the whisper model (its config.pbtxt text) will load: the environment's, else its config's."""
    if environ.get(CHECKPOINT_ENV):
        return environ[CHECKPOINT_ENV]
    return config_parameter(config, "checkpoint") or DEFAULT_CHECKPOINT


def log_mel_output(preprocessing_config: str, gpus: int) -> LogMelOutput | None:
    """How the preprocessing model of this config.pbtxt text hands LOG_MEL on from a GPU
    on a server of `gpus` GPUs (`log_mel_handover`); None for a value it would refuse."""
    value = config_parameter(preprocessing_config, "log_mel_output") or AUTO
    try:
        return log_mel_handover(None if value == AUTO else LogMelOutput(value), gpus)
    except ValueError:
        return None


def config_parameter(config: str, key: str) -> str | None:
    """A string parameter's value in config.pbtxt text, None when it has none."""
    found = re.search(rf'key:\s*"{re.escape(key)}"\s*value:\s*\{{\s*string_value:\s*"([^"]*)"', config)
    return found.group(1) if found else None


def engines_to_serve(config: str, requested: int | None, gpus: int, checkpoint: str, mps: bool = False) -> int | None:
    """How many engines per device a repository whose whisper model has this
    config.pbtxt text should be served with; None: as it is written.

    requested: a number asked for (`serve --engines N`), or None for auto: on a host
        with GPUs, `auto_instances_per_gpu` of the checkpoint, if the repository's
        whisper model has the shipped instance group (another one was chosen by
        its owner and is served as written); on the CPU, one.
    gpus: GPUs Triton will see.
    mps: whether the GPUs' processes share them under CUDA MPS.
    """
    group = read_instance_group(config)
    if requested is not None:
        return None if requested == group.count else requested
    if gpus == 0 or group != SHIPPED_WHISPER_GROUP:
        return None
    engines = _auto(checkpoint, mps).whisper
    return None if engines == group.count else engines


def preprocessing_to_serve(config: str, gpus: int, checkpoint: str, mps: bool) -> int | None:
    """Preprocessing instances per GPU for a repository whose preprocessing model has
    this config.pbtxt text; None: as written (on the CPU, or an owner's own group)."""
    group = read_instance_group(config)
    if gpus == 0 or group != SHIPPED_PREPROCESSING_GROUP:
        return None
    count = _auto(checkpoint, mps).preprocessing
    return None if count == group.count else count


def postprocessing_to_serve(config: str, engines_per_gpu: int, gpus: int) -> int | None:
    """Postprocessing instances for a repository whose postprocessing model has this
    config.pbtxt text, on a server of `gpus` GPUs with `engines_per_gpu` engines on
    each: one per engine, at least as many as written; None: as written (on the CPU,
    or an owner's own group)."""
    group = read_instance_group(config)
    if gpus == 0 or group != SHIPPED_POSTPROCESSING_GROUP:
        return None
    count = max(group.count, engines_per_gpu * gpus)
    return None if count == group.count else count


def _auto(checkpoint: str, mps: bool) -> GpuInstances:
    from python_backend_lib.checkpoints.configs import load_config

    return auto_instances_per_gpu(load_config(checkpoint).dims, mps)


def serving_copy(
    source: Path, requested: int | None, gpus: int, environ: dict[str, str], mps: bool = False
) -> Path | None:
    """The copy of `source` to serve (`engines_to_serve`, `preprocessing_to_serve`,
    `postprocessing_to_serve`), or None to serve it as written."""
    try:
        config = whisper_config(source).read_text()
        checkpoint = configured_checkpoint(config, environ)
        engines = engines_to_serve(config, requested, gpus, checkpoint, mps)
        counts = {tensor_names.WHISPER_NAME: engines}
        preprocessing = model_config(source, tensor_names.PREPROCESSING_NAME)
        if preprocessing.exists():
            count = preprocessing_to_serve(preprocessing.read_text(), gpus, checkpoint, mps)
            counts[tensor_names.PREPROCESSING_NAME] = count
        postprocessing = model_config(source, tensor_names.POSTPROCESSING_NAME)
        if postprocessing.exists():
            per_gpu = engines if engines is not None else read_instance_group(config).count
            count = postprocessing_to_serve(postprocessing.read_text(), per_gpu, gpus)
            counts[tensor_names.POSTPROCESSING_NAME] = count
    except Exception as error:  # a checkpoint that cannot be read: the models report it as they load
        print(f"whisper-triton: serving {source} as written: {error}", file=sys.stderr)
        return None
    changed = {model: count for model, count in counts.items() if count is not None}
    return repository_with_counts(source, changed) if changed else None


def repository_with_engines(source: Path, engines: int) -> Path:
    """`repository_with_counts` of the whisper model alone."""
    return repository_with_counts(source, {tensor_names.WHISPER_NAME: engines})


def repository_with_counts(source: Path, counts: dict[str, int]) -> Path:
    """A temporary copy of `source` in which each model named in `counts` runs that many
    instances per device: links to every model and file, the named models' config.pbtxt
    rewritten. The caller removes it (`remove_copy`)."""
    copy = Path(tempfile.mkdtemp(prefix="whisper-triton-repository-"))
    for entry in source.iterdir():
        if entry.name not in counts:
            (copy / entry.name).symlink_to(entry.resolve())
            continue
        (copy / entry.name).mkdir()
        for part in entry.iterdir():
            if part.name != "config.pbtxt":
                (copy / entry.name / part.name).symlink_to(part.resolve())
        config = model_config(source, entry.name).read_text()
        kind = read_instance_group(config).kind
        model_config(copy, entry.name).write_text(with_instance_group(config, InstanceGroup(counts[entry.name], kind)))
    return copy


def remove_copy(copy: Path) -> None:
    """Remove a copy made by `repository_with_engines` (its links, not what they point at)."""
    shutil.rmtree(copy, ignore_errors=True)


# Triton's CUDA memory pool holds the tensors that travel between models in GPU memory:
# with log_mel_output "device", every LOG_MEL waiting for the whisper model (its queue
# holds up to WHISPER_QUEUE requests) is there. Sized for a full queue of 30 s windows
# of 128 bins; the default pool (64 MiB) would hold about 60 of them.
WHISPER_QUEUE = 1024
LOG_MEL_BYTES = 128 * 3000 * 4


def cuda_pool_flags(repository: Path, gpus: int) -> tuple[str, ...]:
    """tritonserver's --cuda-memory-pool-byte-size for each of `gpus` GPUs, when the repository's
    preprocessing hands LOG_MEL on in GPU memory; none otherwise (the default pool)."""
    config = model_config(repository, tensor_names.PREPROCESSING_NAME)
    if not config.exists() or log_mel_output(config.read_text(), gpus) is not LogMelOutput.DEVICE:
        return ()
    return tuple(f"--cuda-memory-pool-byte-size={gpu}:{WHISPER_QUEUE * LOG_MEL_BYTES}" for gpu in range(gpus))
