"""The Hugging Face checkpoint format: a folder with config.json, an optional
generation_config.json, *.safetensors and usually tokenizer.json.

Every other format is converted to this one (`ctranslate2_conversion`), and
`transformers.WhisperForConditionalGeneration.from_pretrained` reads what
`write_hf_folder` writes, which the tests use as their reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from python_backend_lib.core.geometry import SECONDS_PER_POSITION
from python_backend_lib.core.model_facts import ModelConfig, ModelDims, SpecialTokens, is_multilingual_vocab
from python_backend_lib.core.options import DEFAULT_MAX_INITIAL_TIMESTAMP_S

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"  # what we write; any *.safetensors is read
PARAMETER_PREFIX = "model."  # Hugging Face's names start with it; our state dicts do not

if TYPE_CHECKING:  # the tensors' functions import torch's side of safetensors when called; the rest needs no torch
    import torch


def holds_checkpoint(folder: Path) -> bool:
    """Whether `folder` looks like a Hugging Face checkpoint."""
    return (folder / CONFIG_FILE).exists() and any(folder.glob("*.safetensors"))


def read_config(directory: Path, source: str) -> ModelConfig:
    config = json.loads((directory / CONFIG_FILE).read_text())
    generation_path = directory / GENERATION_FILE
    generation = json.loads(generation_path.read_text()) if generation_path.exists() else {}
    dims = ModelDims(
        n_mels=config["num_mel_bins"],
        n_audio_ctx=config["max_source_positions"],
        n_audio_state=config["d_model"],
        n_audio_head=config["encoder_attention_heads"],
        n_audio_layer=config["encoder_layers"],
        n_vocab=config["vocab_size"],
        n_text_ctx=config["max_target_positions"],
        n_text_state=config["d_model"],
        n_text_head=config["decoder_attention_heads"],
        n_text_layer=config["decoder_layers"],
    )
    multilingual = generation.get("is_multilingual", is_multilingual_vocab(dims.n_vocab))
    special = SpecialTokens.for_vocab(dims.n_vocab, multilingual)
    suppress = generation.get("suppress_tokens", config.get("suppress_tokens")) or []
    begin_suppress = generation.get("begin_suppress_tokens", config.get("begin_suppress_tokens"))
    return ModelConfig(
        dims=dims,
        special=special,
        multilingual=multilingual,
        suppress_tokens=tuple(suppress),
        begin_suppress_tokens=special.default_begin_suppress if begin_suppress is None else tuple(begin_suppress),
        alignment_heads=tuple(tuple(h) for h in generation.get("alignment_heads", [])),
        source=source,
        directory=directory,
    )


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every *.safetensors file's tensors, named without the "model." prefix."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            state[name.removeprefix(PARAMETER_PREFIX)] = tensor
    return state


def hf_config_json(dims: ModelDims, special: SpecialTokens) -> dict:
    return {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "vocab_size": dims.n_vocab,
        "num_mel_bins": dims.n_mels,
        "d_model": dims.n_text_state,
        "encoder_layers": dims.n_audio_layer,
        "encoder_attention_heads": dims.n_audio_head,
        "encoder_ffn_dim": 4 * dims.n_audio_state,
        "decoder_layers": dims.n_text_layer,
        "decoder_attention_heads": dims.n_text_head,
        "decoder_ffn_dim": 4 * dims.n_text_state,
        "max_source_positions": dims.n_audio_ctx,
        "max_target_positions": dims.n_text_ctx,
        "activation_function": "gelu",
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "pad_token_id": special.eot,
        "bos_token_id": special.eot,
        "eos_token_id": special.eot,
        "decoder_start_token_id": special.sot,
        "torch_dtype": "float32",
    }


def hf_generation_json(config: ModelConfig) -> dict:
    special = config.special
    # transformers detects the language whenever a `lang_to_id` map exists, so an
    # English-only checkpoint must not have one.
    multilingual = (
        {
            "lang_to_id": {f"<|{c}|>": special.language_token(c) for c in special.language_codes},
            "task_to_id": {"transcribe": special.transcribe, "translate": special.translate},
        }
        if config.multilingual
        else {}
    )
    return {
        **multilingual,
        "alignment_heads": [list(h) for h in config.alignment_heads],
        "begin_suppress_tokens": list(config.begin_suppress_tokens),
        "suppress_tokens": list(config.suppress_tokens),
        "bos_token_id": special.eot,
        "eos_token_id": special.eot,
        "pad_token_id": special.eot,
        "decoder_start_token_id": special.sot,
        "is_multilingual": config.multilingual,
        "max_initial_timestamp_index": round(DEFAULT_MAX_INITIAL_TIMESTAMP_S / SECONDS_PER_POSITION),
        "max_length": config.dims.n_text_ctx,
        "no_timestamps_token_id": special.no_timestamps,
        "prev_sot_token_id": special.startofprev,
        "return_timestamps": False,
    }


def write_hf_folder(config: ModelConfig, state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    """Write a Hugging Face-format folder that both our loader and
    `transformers.WhisperForConditionalGeneration.from_pretrained` read."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config_json(config.dims, config.special), indent=2))
    (directory / GENERATION_FILE).write_text(json.dumps(hf_generation_json(config), indent=2))
    tensors = {f"{PARAMETER_PREFIX}{k}": v.contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
