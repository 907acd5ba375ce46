"""The CTranslate2 checkpoint format (faster-whisper's): a folder with model.bin,
config.json and tokenizer.json.

What the folder holds is read here without its tensors (the index of model.bin,
its config.json) and without torch, so that the models that only write text know
the checkpoint; `ctranslate2_conversion` reads the tensors and converts the folder
to the Hugging Face format once.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from python_backend_lib.core.model_facts import ModelConfig, ModelDims, SpecialTokens, is_multilingual_vocab

MODEL_FILE = "model.bin"
CONFIG_FILE = "config.json"
CT2_BINARY_VERSION = 6
CT2_SPEC = "WhisperSpec"
CT2_SPEC_REVISION = 3
# CTranslate2's variable type ids, in its own order, as struct formats (float types unread here).
CT2_DTYPE_NAMES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
_INTEGER_FORMATS = {"int8": "<b", "int16": "<h", "int32": "<i"}


@dataclass(frozen=True)
class Variable:
    """One variable of model.bin: its shape, type and where its bytes are."""

    shape: tuple[int, ...]
    dtype: str  # a CT2_DTYPE_NAMES entry
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class Ct2Index:
    """model.bin's variables by name, aliases resolved to the variable they name."""

    path: Path
    variables: dict[str, Variable]

    def integer(self, name: str) -> int:
        """A scalar integer variable's value (such as "encoder/num_heads")."""
        variable = self.variables[name]
        with self.path.open("rb") as file:
            file.seek(variable.offset)
            (value,) = struct.unpack(_INTEGER_FORMATS[variable.dtype], file.read(variable.n_bytes))
        return value


def holds_checkpoint(folder: Path) -> bool:
    """Whether `folder` looks like a CTranslate2 checkpoint."""
    return (folder / MODEL_FILE).exists()


def read_index(path: Path) -> Ct2Index:
    """Parse a CTranslate2 `model.bin`'s header and the index of its variables, skipping their bytes."""
    with path.open("rb") as file:

        def unpack(fmt: str):
            (value,) = struct.unpack("<" + fmt, file.read(struct.calcsize(fmt)))
            return value

        def string() -> str:
            length = unpack("H")  # includes the trailing NUL
            return file.read(length)[:-1].decode("utf-8")

        version, spec, revision = unpack("I"), string(), unpack("I")
        if (version, spec, revision) != (CT2_BINARY_VERSION, CT2_SPEC, CT2_SPEC_REVISION):
            raise ValueError(
                f"{path}: expected CTranslate2 {CT2_SPEC} revision {CT2_SPEC_REVISION} "
                f"(binary version {CT2_BINARY_VERSION}), found {spec} revision {revision} (version {version})"
            )
        variables: dict[str, Variable] = {}
        for _ in range(unpack("I")):
            name = string()
            shape = tuple(unpack("I") for _ in range(unpack("B")))
            dtype = CT2_DTYPE_NAMES[unpack("B")]
            n_bytes = unpack("I")
            variables[name] = Variable(shape, dtype, file.tell(), n_bytes)
            file.seek(n_bytes, 1)
        for _ in range(unpack("I")):
            alias, target = string(), string()
            variables[alias] = variables[target]
    return Ct2Index(path, variables)


def layer_count(names, side: str) -> int:
    """Layers of the "encoder" or "decoder": one feed-forward input projection each."""
    return sum(1 for k in names if k.startswith(f"{side}/layer_") and k.endswith("ffn/linear_0/weight"))


def read_config(folder: Path, source: str) -> ModelConfig:
    """The configuration of a CTranslate2 folder, from model.bin's index and config.json;
    `directory` is the folder (its tokenizer.json)."""
    index = read_index(folder / MODEL_FILE)
    config_path = folder / CONFIG_FILE
    ct2_config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return config_from(index, ct2_config, source, directory=folder)


def config_from(index: Ct2Index, ct2_config: dict, source: str, directory: Path | None) -> ModelConfig:
    variables = index.variables
    n_vocab, width = variables["decoder/embeddings/weight"].shape
    dims = ModelDims(
        n_mels=variables["encoder/conv1/weight"].shape[1],
        n_audio_ctx=variables["encoder/position_encodings/encodings"].shape[0],
        n_audio_state=width,
        n_audio_head=index.integer("encoder/num_heads"),
        n_audio_layer=layer_count(variables, "encoder"),
        n_vocab=n_vocab,
        n_text_ctx=variables["decoder/position_encodings/encodings"].shape[0],
        n_text_state=width,
        n_text_head=index.integer("decoder/num_heads"),
        n_text_layer=layer_count(variables, "decoder"),
    )
    multilingual = is_multilingual_vocab(n_vocab)
    special = SpecialTokens.for_vocab(n_vocab, multilingual)
    return ModelConfig(
        dims=dims,
        special=special,
        multilingual=multilingual,
        suppress_tokens=tuple(ct2_config.get("suppress_ids", ())),
        begin_suppress_tokens=tuple(ct2_config.get("suppress_ids_begin", special.default_begin_suppress)),
        alignment_heads=tuple(tuple(h) for h in ct2_config.get("alignment_heads", ())),
        source=source,
        directory=directory,
    )
