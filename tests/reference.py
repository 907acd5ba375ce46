"""Shared helpers for tests that compare us with an independent reference."""

from __future__ import annotations

import csv
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from python_backend_lib.core.options import DecodingOptions

DATA = Path(__file__).parent / "data" / "audio"

_SMALL_NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_ABBREVIATIONS = {"mr": "mister", "mrs": "missus", "dr": "doctor"}


@dataclass(frozen=True)
class Clip:
    file: str
    duration: float
    transcript: str

    @property
    def path(self) -> Path:
        return DATA / self.file

    def read(self) -> bytes:
        return self.path.read_bytes()


def clips() -> list[Clip]:
    with open(DATA / "manifest.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return [Clip(r["file"], float(r["duration_s"]), r["transcript"]) for r in rows]


def _number_words(digits: str) -> list[str]:
    value = int(digits)
    if len(digits) > 2 or value >= 100:  # read long numbers digit by digit, as the references do
        return [_SMALL_NUMBERS[int(d)] for d in digits]
    if value < 20:
        return [_SMALL_NUMBERS[value]]
    tens, units = divmod(value, 10)
    return [_TENS[tens]] + ([_SMALL_NUMBERS[units]] if units else [])


def normalize(text: str) -> list[str]:
    """Lower case, no punctuation, hyphens split, numbers and titles spelled out."""
    words = []
    for word in re.sub(r"[-–]", " ", text.lower()).split():
        word = re.sub(r"[^a-z0-9']", "", word).strip("'")
        if not word:
            continue
        if word.isdigit():
            words.extend(_number_words(word))
        else:
            words.append(_ABBREVIATIONS.get(word, word))
    return words


def word_error_rate(hypothesis: list[str], reference: list[str]) -> float:
    """Word-level edit distance over the reference length."""
    previous = list(range(len(reference) + 1))
    for i, word in enumerate(hypothesis, 1):
        current = [i]
        for j, ref in enumerate(reference, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (word != ref)))
        previous = current
    return previous[-1] / len(reference)


def hf_model(directory: Path):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(str(directory), attn_implementation="sdpa").eval()


def hf_model_from_state(config, state: dict[str, torch.Tensor]):
    """transformers' Whisper with exactly our weights (for random checkpoints)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from python_backend_lib.checkpoints.hf_folder import hf_config_json

    hf_config = WhisperConfig(**hf_config_json(config.dims, config.special))
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(hf_config)
    missing, unexpected = model.load_state_dict(
        {f"model.{k}": v for k, v in state.items()}, strict=False, assign=True
    )
    assert not unexpected, unexpected
    assert set(missing) <= {"proj_out.weight"}, missing
    model.tie_weights()
    return model.eval()


# Our (Hugging Face) parameter names to openai-whisper's.
_OPENAI_NAMES = [
    ("encoder.embed_positions.weight", "encoder.positional_embedding"),
    ("decoder.embed_positions.weight", "decoder.positional_embedding"),
    ("decoder.embed_tokens", "decoder.token_embedding"),
    ("encoder.layer_norm", "encoder.ln_post"),
    ("decoder.layer_norm", "decoder.ln"),
    (".layers.", ".blocks."),
    ("self_attn_layer_norm", "attn_ln"),
    ("encoder_attn_layer_norm", "cross_attn_ln"),
    ("final_layer_norm", "mlp_ln"),
    ("self_attn.", "attn."),
    ("encoder_attn.", "cross_attn."),
    ("q_proj", "query"),
    ("k_proj", "key"),
    ("v_proj", "value"),
    ("out_proj", "out"),
    ("fc1", "mlp.0"),
    ("fc2", "mlp.2"),
]


def openai_model(config, state: dict[str, torch.Tensor]):
    """openai-whisper's own model with exactly our weights."""
    import whisper

    renamed = {}
    for name, tensor in state.items():
        for ours, theirs in _OPENAI_NAMES:
            name = name.replace(ours, theirs)
        renamed[name] = tensor.float()
    model = whisper.model.Whisper(whisper.model.ModelDimensions(**vars(config.dims)))
    model.load_state_dict(renamed, strict=True)
    heads = torch.zeros(config.dims.n_text_layer, config.dims.n_text_head, dtype=torch.bool)
    for layer, head in config.alignment_heads:
        heads[layer, head] = True
    model.register_buffer("alignment_heads", heads.to_sparse(), persistent=False)
    return model.eval()


def hf_processors(config, prompt_length: int, options: DecodingOptions):
    """transformers' processors for one row, in the order its generate() applies them."""
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor,
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    special = config.special
    processors = [
        MinNewTokensLengthLogitsProcessor(prompt_length, options.min_new_tokens, special.eot),
        SuppressTokensAtBeginLogitsProcessor(list(config.begin_suppress_tokens), prompt_length),
        SuppressTokensLogitsProcessor(list(config.suppress_tokens)),
    ]
    if options.timestamps:
        generation = GenerationConfig(
            eos_token_id=special.eot,
            no_timestamps_token_id=special.no_timestamps,
            max_initial_timestamp_index=round(options.max_initial_timestamp / 0.02),
        )
        processors.append(WhisperTimeStampLogitsProcessor(generation, begin_index=prompt_length))
    return processors


def random_history(rng: random.Random, config, timestamps: bool) -> list[int]:
    """Any mix of text and timestamp tokens: the rules must agree on every history."""
    special = config.special
    n = rng.choice([0, 0, 1, 2, 3, 5, 9])
    history = []
    for _ in range(n):
        if timestamps and rng.random() < 0.4:
            history.append(special.timestamp_begin + rng.randrange(0, 1501))
        else:
            history.append(rng.randrange(0, special.eot))
    return history
