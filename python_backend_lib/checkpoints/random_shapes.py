"""Random checkpoints, "random:<size>[:<seed>]": the real shapes of tiny ...
large-v3-turbo, and the configuration of each; `random_weights` makes the seeded
tensors. No torch."""

from __future__ import annotations

from dataclasses import dataclass

from python_backend_lib.core.geometry import N_AUDIO_CTX
from python_backend_lib.core.model_facts import ModelConfig, ModelDims, SpecialTokens
from python_backend_lib.core.options import MAX_TEXT_POSITIONS

RANDOM_PREFIX = "random:"


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
