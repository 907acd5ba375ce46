"""The seeded weights of random checkpoints ("random:<size>[:<seed>]", whose shapes and
configuration `random_shapes` gives), for tests and GPU benchmarks."""

from __future__ import annotations

import math

import torch

from python_backend_lib.core.model_facts import ModelDims

INIT_STD = 0.02


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
