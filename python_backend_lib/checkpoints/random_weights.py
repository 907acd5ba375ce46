"""Random checkpoints, "random:<size>[:<seed>]": the real shapes of tiny ...
large-v3-turbo with seeded weights, for tests and GPU benchmarks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from python_backend_lib.core.geometry import N_AUDIO_CTX
from python_backend_lib.core.model_facts import ModelConfig, ModelDims, SpecialTokens
from python_backend_lib.core.options import MAX_TEXT_POSITIONS

RANDOM_PREFIX = "random:"
INIT_STD = 0.02


@dataclass(frozen=True)
class RandomSize:
    """The shapes of one of Whisper's published sizes."""

    width: int
    heads: int
    encoder_layers: int
    decoder_layers: int
    n_mels: int
    n_vocab: int


RANDOM_SIZES: dict[str, RandomSize] = {
    "tiny": RandomSize(384, 6, 4, 4, 80, 51865),
    "base": RandomSize(512, 8, 6, 6, 80, 51865),
    "small": RandomSize(768, 12, 12, 12, 80, 51865),
    "medium": RandomSize(1024, 16, 24, 24, 80, 51865),
    "large-v3": RandomSize(1280, 20, 32, 32, 128, 51866),
    "large-v3-turbo": RandomSize(1280, 20, 32, 4, 128, 51866),
}


@dataclass(frozen=True)
class RandomSource:
    """A parsed "random:<size>[:<seed>]"."""

    size: str
    seed: int


def is_random_source(source: str) -> bool:
    return source.startswith(RANDOM_PREFIX)


def parse_random_source(source: str) -> RandomSource:
    """"random:tiny:3" -> RandomSource("tiny", 3); the seed defaults to 0."""
    size, _, seed = source[len(RANDOM_PREFIX) :].partition(":")
    if size not in RANDOM_SIZES:
        raise ValueError(f"unknown random model size {size!r}; choose from {sorted(RANDOM_SIZES)}")
    try:
        return RandomSource(size, int(seed) if seed else 0)
    except ValueError:
        raise ValueError(f"random model seed must be an integer, got {seed!r}") from None


def random_config(size: str, source: str) -> ModelConfig:
    """A multilingual configuration of `size`'s shapes; alignment heads: the last decoder layer's."""
    shapes = RANDOM_SIZES[size]
    dims = ModelDims(
        n_mels=shapes.n_mels,
        n_audio_ctx=N_AUDIO_CTX,
        n_audio_state=shapes.width,
        n_audio_head=shapes.heads,
        n_audio_layer=shapes.encoder_layers,
        n_vocab=shapes.n_vocab,
        n_text_ctx=MAX_TEXT_POSITIONS,
        n_text_state=shapes.width,
        n_text_head=shapes.heads,
        n_text_layer=shapes.decoder_layers,
    )
    special = SpecialTokens.for_vocab(shapes.n_vocab, multilingual=True)
    suppress = (
        special.sot, special.translate, special.transcribe, special.startoflm, special.startofprev, special.nospeech
    )
    return ModelConfig(
        dims=dims,
        special=special,
        multilingual=True,
        suppress_tokens=suppress,
        begin_suppress_tokens=special.default_begin_suppress,
        alignment_heads=tuple((shapes.decoder_layers - 1, h) for h in range(shapes.heads)),
        source=source,
        directory=None,
    )


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's fixed encoder position embedding: [length, channels], sin then cos."""
    log_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2, dtype=torch.float32))
    scaled = torch.arange(length, dtype=torch.float32)[:, None] * inv_timescales[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


def random_state_dict(dims: ModelDims, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded weights of the real shapes. Norms get gains near one so activations
    stay in range through 32 layers and the logits are not degenerate."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = INIT_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    state: dict[str, torch.Tensor] = {}

    def linear(name: str, n_out: int, n_in: int, bias: bool = True) -> None:
        state[f"{name}.weight"] = normal(n_out, n_in)
        if bias:
            state[f"{name}.bias"] = normal(n_out)

    def norm(name: str, width: int) -> None:
        state[f"{name}.weight"] = 1.0 + normal(width, std=0.1)
        state[f"{name}.bias"] = normal(width)

    def attention(name: str, width: int) -> None:
        linear(f"{name}.q_proj", width, width)
        linear(f"{name}.k_proj", width, width, bias=False)
        linear(f"{name}.v_proj", width, width)
        linear(f"{name}.out_proj", width, width)

    def block(name: str, width: int, cross: bool) -> None:
        norm(f"{name}.self_attn_layer_norm", width)
        attention(f"{name}.self_attn", width)
        if cross:
            norm(f"{name}.encoder_attn_layer_norm", width)
            attention(f"{name}.encoder_attn", width)
        norm(f"{name}.final_layer_norm", width)
        linear(f"{name}.fc1", 4 * width, width)
        linear(f"{name}.fc2", width, 4 * width)

    width = dims.n_audio_state
    state["encoder.conv1.weight"] = normal(width, dims.n_mels, 3, std=0.1)
    state["encoder.conv1.bias"] = normal(width)
    state["encoder.conv2.weight"] = normal(width, width, 3)
    state["encoder.conv2.bias"] = normal(width)
    state["encoder.embed_positions.weight"] = sinusoids(dims.n_audio_ctx, width)
    for i in range(dims.n_audio_layer):
        block(f"encoder.layers.{i}", width, cross=False)
    norm("encoder.layer_norm", width)
    state["decoder.embed_tokens.weight"] = normal(dims.n_vocab, dims.n_text_state, std=1.0)
    state["decoder.embed_positions.weight"] = normal(dims.n_text_ctx, dims.n_text_state)
    for i in range(dims.n_text_layer):
        block(f"decoder.layers.{i}", dims.n_text_state, cross=True)
    norm("decoder.layer_norm", dims.n_text_state)
    return state
