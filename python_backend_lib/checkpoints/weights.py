"""A checkpoint's tensors, from any source `configs` names.

Every source ends in the same place: a `ModelConfig` (`core.model_facts`) and a
state dict keyed by the Hugging Face parameter names, which `engine.model.Whisper`
loads directly. A CTranslate2 folder (the default one too) is converted once to a
cached Hugging Face-format folder (`ctranslate2_conversion`), which is also what
transformers reads (`hf_directory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from python_backend_lib.checkpoints import ctranslate2_folder, hf_folder, random_shapes, random_weights
from python_backend_lib.checkpoints.configs import DEFAULT_SOURCE, source_folder
from python_backend_lib.checkpoints.ctranslate2_conversion import convert_ctranslate2
from python_backend_lib.core.model_facts import ModelConfig


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face names, without the "model." prefix


def load_checkpoint(source: str = DEFAULT_SOURCE) -> Checkpoint:
    if random_shapes.is_random_source(source):
        parsed = random_shapes.parse_random_source(source)
        config = random_shapes.random_config(parsed.size, source)
        return Checkpoint(config, random_weights.random_state_dict(config.dims, parsed.seed))
    directory = hf_directory(source)
    return Checkpoint(hf_folder.read_config(directory, source), hf_folder.read_tensors(directory))


def hf_directory(source: str) -> Path:
    """The Hugging Face-format folder of a (not random) source, converted once if needed."""
    folder = source_folder(source)
    if ctranslate2_folder.holds_checkpoint(folder):
        return convert_ctranslate2(folder)
    return folder
