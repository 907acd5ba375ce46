"""The CTranslate2 checkpoint format (faster-whisper's): a folder with model.bin,
config.json and tokenizer.json.

`convert_ctranslate2` turns such a folder into a cached Hugging Face-format
folder once (float32 weights, fused projections split, variables renamed), so
loading it later is loading that folder.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from python_backend_lib.checkpoints.hf_folder import WEIGHTS_FILE, write_hf_folder
from python_backend_lib.core.cache import cache_root
from python_backend_lib.core.model_facts import ModelConfig, ModelDims, SpecialTokens, is_multilingual_vocab

MODEL_FILE = "model.bin"
CONVERSION_VERSION = 2  # part of the cache key: bump when the converted folder changes
CT2_BINARY_VERSION = 6
CT2_SPEC = "WhisperSpec"
CT2_SPEC_REVISION = 3
# CTranslate2's variable type ids, in its own order.
CT2_DTYPES = (torch.float32, torch.int8, torch.int16, torch.int32, torch.float16, torch.bfloat16)


def holds_checkpoint(folder: Path) -> bool:
    """Whether `folder` looks like a CTranslate2 checkpoint."""
    return (folder / MODEL_FILE).exists()


def read_ctranslate2(path: Path) -> dict[str, torch.Tensor]:
    """Parse a CTranslate2 `model.bin`: header, named tensors, then aliases."""
    data = path.read_bytes()
    offset = 0

    def unpack(fmt: str):
        nonlocal offset
        (value,) = struct.unpack_from("<" + fmt, data, offset)
        offset += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal offset
        length = unpack("H")  # includes the trailing NUL
        text = data[offset : offset + length - 1].decode("utf-8")
        offset += length
        return text

    version = unpack("I")
    spec = string()
    revision = unpack("I")
    if (version, spec, revision) != (CT2_BINARY_VERSION, CT2_SPEC, CT2_SPEC_REVISION):
        raise ValueError(
            f"{path}: expected CTranslate2 {CT2_SPEC} revision {CT2_SPEC_REVISION} "
            f"(binary version {CT2_BINARY_VERSION}), found {spec} revision {revision} (version {version})"
        )
    variables: dict[str, torch.Tensor] = {}
    for _ in range(unpack("I")):
        name = string()
        shape = [unpack("I") for _ in range(unpack("B"))]
        dtype = CT2_DTYPES[unpack("B")]
        n_bytes = unpack("I")
        raw = bytearray(data[offset : offset + n_bytes])
        offset += n_bytes
        variables[name] = torch.frombuffer(raw, dtype=dtype).reshape(shape)
    for _ in range(unpack("I")):
        alias, target = string(), string()
        variables[alias] = variables[target]
    return variables


def _layer_count(variables: dict[str, torch.Tensor], side: str) -> int:
    """Layers of the "encoder" or "decoder": one feed-forward input projection each."""
    return sum(1 for k in variables if k.startswith(f"{side}/layer_") and k.endswith("ffn/linear_0/weight"))


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
        for i in range(_layer_count(variables, side)):
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


def _ctranslate2_config(variables: dict[str, torch.Tensor], ct2_config: dict, source: str) -> ModelConfig:
    n_vocab, width = variables["decoder/embeddings/weight"].shape
    dims = ModelDims(
        n_mels=variables["encoder/conv1/weight"].shape[1],
        n_audio_ctx=variables["encoder/position_encodings/encodings"].shape[0],
        n_audio_state=width,
        n_audio_head=int(variables["encoder/num_heads"]),
        n_audio_layer=_layer_count(variables, "encoder"),
        n_vocab=n_vocab,
        n_text_ctx=variables["decoder/position_encodings/encodings"].shape[0],
        n_text_state=width,
        n_text_head=int(variables["decoder/num_heads"]),
        n_text_layer=_layer_count(variables, "decoder"),
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
        directory=None,
    )


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
    config_path = folder / "config.json"
    ct2_config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config = _ctranslate2_config(variables, ct2_config, str(folder))
    state = {k: v.float() for k, v in ctranslate2_to_hf(variables).items()}
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        write_hf_folder(config, state, staging)
        if (folder / "tokenizer.json").exists():
            shutil.copy(folder / "tokenizer.json", staging / "tokenizer.json")
        try:
            staging.rename(target)
        except OSError:
            if not (target / WEIGHTS_FILE).exists():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
