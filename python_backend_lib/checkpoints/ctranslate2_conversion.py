"""A CTranslate2 folder's tensors (`ctranslate2_folder` reads the format's index and
configuration), and its conversion into a cached Hugging Face-format folder, once
(float32 weights, fused projections split, variables renamed), so that loading it
later is loading that folder.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from python_backend_lib.checkpoints.ctranslate2_folder import (
    CONFIG_FILE,
    MODEL_FILE,
    config_from,
    layer_count,
    read_index,
)
from python_backend_lib.checkpoints.hf_folder import WEIGHTS_FILE, write_hf_folder
from python_backend_lib.core.cache import cache_root, staged_folder

CONVERSION_VERSION = 2  # part of the cache key: bump when the converted folder changes
CT2_DTYPES = {  # CTranslate2's type names (`ctranslate2_folder.CT2_DTYPE_NAMES`) as torch's
    "float32": torch.float32, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "float16": torch.float16, "bfloat16": torch.bfloat16,
}


def read_ctranslate2(path: Path) -> dict[str, torch.Tensor]:
    """Every variable of a CTranslate2 `model.bin` as a tensor; an alias is the same tensor as its target."""
    index = read_index(path)
    data = path.read_bytes()
    tensors: dict[int, torch.Tensor] = {}  # by offset: aliases share their target's tensor
    variables: dict[str, torch.Tensor] = {}
    for name, variable in index.variables.items():
        if variable.offset not in tensors:
            raw = bytearray(data[variable.offset : variable.offset + variable.n_bytes])
            tensors[variable.offset] = torch.frombuffer(raw, dtype=CT2_DTYPES[variable.dtype]).reshape(variable.shape)
        variables[name] = tensors[variable.offset]
    return variables


def ctranslate2_to_hf(variables: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename CTranslate2's Whisper variables to Hugging Face's names, splitting the
    fused projections. Weights stay in their stored dtype."""
    state: dict[str, torch.Tensor] = {}

    def linear(hf: str, ct2: str) -> None:
        state[f"{hf}.weight"] = variables[f"{ct2}/weight"]
        state[f"{hf}.bias"] = variables[f"{ct2}/bias"]

    def norm(hf: str, ct2: str) -> None:
        state[f"{hf}.weight"] = variables[f"{ct2}/gamma"]
        state[f"{hf}.bias"] = variables[f"{ct2}/beta"]

    def fused(hf_prefix: str, ct2: str, names: tuple[str, ...]) -> None:
        weights = torch.chunk(variables[f"{ct2}/weight"], len(names), dim=0)  # stacked by rows
        biases = torch.chunk(variables[f"{ct2}/bias"], len(names), dim=0)
        for name, weight, bias in zip(names, weights, biases):
            state[f"{hf_prefix}.{name}.weight"] = weight
            if name == "k_proj":
                # Whisper's key projections have no bias; CTranslate2 stores zeros there.
                if torch.count_nonzero(bias):
                    raise ValueError(f"{ct2}: the key bias should be zero")
            else:
                state[f"{hf_prefix}.{name}.bias"] = bias

    def ffn(hf: str, ct2: str) -> None:
        norm(f"{hf}.final_layer_norm", f"{ct2}/ffn/layer_norm")
        linear(f"{hf}.fc1", f"{ct2}/ffn/linear_0")
        linear(f"{hf}.fc2", f"{ct2}/ffn/linear_1")

    for side in ("encoder", "decoder"):
        state[f"{side}.embed_positions.weight"] = variables[f"{side}/position_encodings/encodings"]
        norm(f"{side}.layer_norm", f"{side}/layer_norm")
        for i in range(layer_count(variables, side)):
            hf, ct2 = f"{side}.layers.{i}", f"{side}/layer_{i}"
            norm(f"{hf}.self_attn_layer_norm", f"{ct2}/self_attention/layer_norm")
            fused(f"{hf}.self_attn", f"{ct2}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
            linear(f"{hf}.self_attn.out_proj", f"{ct2}/self_attention/linear_1")
            if side == "decoder":
                norm(f"{hf}.encoder_attn_layer_norm", f"{ct2}/attention/layer_norm")
                linear(f"{hf}.encoder_attn.q_proj", f"{ct2}/attention/linear_0")
                fused(f"{hf}.encoder_attn", f"{ct2}/attention/linear_1", ("k_proj", "v_proj"))
                linear(f"{hf}.encoder_attn.out_proj", f"{ct2}/attention/linear_2")
            ffn(hf, ct2)
    for conv in ("conv1", "conv2"):
        linear(f"encoder.{conv}", f"encoder/{conv}")
    state["decoder.embed_tokens.weight"] = variables["decoder/embeddings/weight"]
    return state


def convert_ctranslate2(folder: Path) -> Path:
    """Convert a CTranslate2 Whisper folder to a cached Hugging Face-format folder
    (float32 weights) and return it. Idempotent and safe across processes."""
    model_bin = folder / MODEL_FILE
    stat = model_bin.stat()
    identity = f"{CONVERSION_VERSION}:{model_bin.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    target = cache_root() / "checkpoints" / f"{folder.name}-{key}"
    if (target / WEIGHTS_FILE).exists():
        return target
    variables = read_ctranslate2(model_bin)
    config_path = folder / CONFIG_FILE
    ct2_config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config = config_from(read_index(model_bin), ct2_config, str(folder), directory=None)
    state = {k: v.float() for k, v in ctranslate2_to_hf(variables).items()}
    with staged_folder(target, WEIGHTS_FILE) as staging:
        write_hf_folder(config, state, staging)
        if (folder / "tokenizer.json").exists():
            shutil.copy(folder / "tokenizer.json", staging / "tokenizer.json")
    return target
