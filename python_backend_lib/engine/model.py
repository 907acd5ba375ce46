"""Whisper's encoder and decoder in PyTorch, with attention delegated to a backend.

Parameter names follow the Hugging Face checkpoints (`encoder.layers.0.self_attn.q_proj`
...), so their state dicts load without a mapping. Pre-norm transformer blocks,
exact GELU, query scale head_dim^-0.5 applied by the attention kernels, output
projection tied to the token embedding.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from python_backend_lib.checkpoints.weights import Checkpoint
from python_backend_lib.core.model_facts import ModelDims
from python_backend_lib.core.quantization import Quantization
from python_backend_lib.engine import cpu_int8, cpu_linear, fp8_linear
from python_backend_lib.engine.attention import AttentionBackend, EncoderAttention, StepLayout
from python_backend_lib.engine.residual_norm import add_norm


class Projections(nn.Module):
    """q, k, v and output projections of one attention (Whisper's k has no bias)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

        self.fused = False  # `fuse_qkv` ran: fused_qkv_weight [3 * width, width] and fused_qkv_bias exist
        self.fp8_qkv: nn.Module | None = None  # `quantize_fp8` ran: q, k and v in one FP8 product

    def fuse_qkv(self) -> None:
        """q, k and v from one matrix product (k's bias zero): two launches fewer. The
        three projections' weights become views of the fused one (until the model is
        moved or cast), so changing them in place changes it too, and no memory is added."""
        width = self.q_proj.weight.shape[0]
        weight, bias = self._stacked_qkv()
        for i, projection in enumerate((self.q_proj, self.k_proj, self.v_proj)):
            projection.weight.data = weight[i * width : (i + 1) * width]
        self.register_buffer("fused_qkv_bias", bias, persistent=False)
        self.register_buffer("fused_qkv_weight", weight, persistent=False)
        self.fused = True

    def _stacked_qkv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q's, k's and v's weights stacked [3 * width, width], and biases [3 * width] (k's zero)."""
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()
        bias = torch.cat([self.q_proj.bias, torch.zeros_like(self.q_proj.bias), self.v_proj.bias]).detach()
        return weight, bias

    def quantize_fp8(self) -> None:
        """q, k and v from one FP8 product, and the output projection in FP8 (`fp8_linear`)."""
        self.fp8_qkv = fp8_linear.Fp8Linear(*self._stacked_qkv())
        self.out_proj = fp8_linear.Fp8Linear.of(self.out_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def qkv(
        self, x: torch.Tensor | fp8_linear.QuantizedInput, n_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., width] (quantized once `quantize_fp8` ran) -> q, k, v each [..., heads, head_dim]"""
        if self.fp8_qkv is not None:
            return tuple(_heads(part, n_heads) for part in self.fp8_qkv(x).chunk(3, dim=-1))
        if self.fused:
            fused = F.linear(x, self.fused_qkv_weight, self.fused_qkv_bias)  # [..., 3 * width]
            return tuple(_heads(part, n_heads) for part in fused.chunk(3, dim=-1))
        return tuple(_heads(proj(x), n_heads) for proj in (self.q_proj, self.k_proj, self.v_proj))


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[..., width] -> [..., heads, head_dim]"""
    return x.unflatten(-1, (n_heads, -1))


class EncodingStopped(Exception):
    """An encoder pass given up between two layers: nobody waits for its audio any more.

    On a CPU one pass can outlast the second within which a cancelled request must
    be answered; the layers are where it can stop without leaving anything half written."""


class EncoderLayer(nn.Module):
    def __init__(self, width: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.self_attn_layer_norm = nn.LayerNorm(width)
        self.self_attn = Projections(width)
        self.final_layer_norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(
        self, x: torch.Tensor, branch: torch.Tensor | None, attention: EncoderAttention
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer over x + branch (the layer before's residual sum, not yet added; None:
        x alone) -> its own output, likewise as a sum and its branch still to add."""
        if isinstance(self.fc2, fp8_linear.Fp8Linear):
            return self._forward_fp8(x, branch, attention)
        if branch is not None:
            x = x + branch
        q, k, v = self.self_attn.qkv(self.self_attn_layer_norm(x), self.n_heads)
        x = x + self.self_attn.out_proj(attention.encoder_attention(q, k, v).flatten(-2))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x)))), None

    def _forward_fp8(
        self, x: torch.Tensor, branch: torch.Tensor | None, attention: EncoderAttention
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with its products in FP8: each layer norm hands the product
        after it a quantized input, adding the residual branch before it as it goes
        (the layer before's fc2, then the attention's), and the GELU is computed inside
        the quantization of fc2's input. fc2's output is left for the next layer's norm
        to add: an addition over every position less a layer."""
        x, normed = fp8_linear.norm_quantize(x, self.self_attn_layer_norm, branch)
        q, k, v = self.self_attn.qkv(normed, self.n_heads)
        attended = self.self_attn.out_proj(attention.encoder_attention(q, k, v).flatten(-2))
        x, normed = fp8_linear.norm_quantize(x, self.final_layer_norm, attended)
        return x, self.fc2.of_gelu(self.fc1(normed))


def unfilled_embedding(rows: int, width: int) -> nn.Embedding:
    """An embedding left as allocated, without nn.Embedding's random initialisation: the
    checkpoint fills it (`Whisper.from_checkpoint`). On the meta device, where the model
    is built, the first random fill of a process loads PyTorch's Python meta kernels,
    which slowed the start of every model process."""
    return nn.Embedding(rows, width, _weight=torch.empty(rows, width))


class Encoder(nn.Module):
    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        width = dims.n_audio_state
        self.conv1 = nn.Conv1d(dims.n_mels, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1)
        self.embed_positions = unfilled_embedding(dims.n_audio_ctx, width)
        self.layers = nn.ModuleList(EncoderLayer(width, dims.n_audio_head) for _ in range(dims.n_audio_layer))
        self.layer_norm = nn.LayerNorm(width)

    def forward(
        self, mel: torch.Tensor, attention: EncoderAttention, stop: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """mel [B, n_mels, 3000] -> audio features [B, 1500, width]; EncodingStopped
        between two layers once `stop()` says so."""
        x = F.gelu(self.conv1(mel))
        # [B, 1500, width], made contiguous once: the transposed layout would otherwise
        # carry through every residual addition, and every layer norm would copy it.
        x = (F.gelu(self.conv2(x)).transpose(1, 2) + self.embed_positions.weight).contiguous()
        branch = None
        for layer in self.layers:
            if stop is not None and stop():
                raise EncodingStopped
            x, branch = layer(x, branch, attention)
        return self.layer_norm(x if branch is None else x + branch)


class DecoderLayer(nn.Module):
    def __init__(self, index: int, width: int, n_heads: int) -> None:
        super().__init__()
        self.index = index
        self.n_heads = n_heads
        self.self_attn_layer_norm = nn.LayerNorm(width)
        self.self_attn = Projections(width)
        self.encoder_attn_layer_norm = nn.LayerNorm(width)
        self.encoder_attn = Projections(width)
        self.final_layer_norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(
        self, x: torch.Tensor, normed: torch.Tensor, next_norm: nn.LayerNorm, attention: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, width] (rows flattened as the step's layout says) and its
        self-attention layer norm -> the layer's output and its norm by `next_norm`
        (the next layer's first, or the decoder's last): each residual sum is written
        with the norm that reads it (`residual_norm`)."""
        q, k, v = self.self_attn.qkv(normed, self.n_heads)
        attended = self.self_attn.out_proj(attention.self_attention(self.index, q, k, v).flatten(-2))
        x, h = add_norm(x, attended, self.encoder_attn_layer_norm)
        c = self.encoder_attn
        crossed = c.out_proj(attention.cross_attention(self.index, _heads(c.q_proj(h), self.n_heads)).flatten(-2))
        x, h = add_norm(x, crossed, self.final_layer_norm)
        return add_norm(x, self.fc2(F.gelu(self.fc1(h))), next_norm)

    def cross_kv(self, audio_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """audio features [B, 1500, width] -> K, V [B, 1500, heads, head_dim], computed once per request."""
        c = self.encoder_attn
        return _heads(c.k_proj(audio_features), self.n_heads), _heads(c.v_proj(audio_features), self.n_heads)


class Decoder(nn.Module):
    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        width = dims.n_text_state
        self.embed_tokens = unfilled_embedding(dims.n_vocab, width)
        self.embed_positions = unfilled_embedding(dims.n_text_ctx, width)
        self.layers = nn.ModuleList(DecoderLayer(i, width, dims.n_text_head) for i in range(dims.n_text_layer))
        self.layer_norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend) -> torch.Tensor:
        """tokens, positions [tokens] -> hidden states [tokens, width]"""
        x = self.embed_tokens(tokens) + self.embed_positions(positions)
        normed = self.layers[0].self_attn_layer_norm(x)
        norms_after = [layer.self_attn_layer_norm for layer in self.layers[1:]] + [self.layer_norm]
        for layer, next_norm in zip(self.layers, norms_after):
            x, normed = layer(x, normed, next_norm, attention)
        return normed


class Whisper(nn.Module):
    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.dims = dims
        self.encoder = Encoder(dims)
        self.decoder = Decoder(dims)
        # hidden [N, width] -> logits [N, vocab]: the tied projection as `pack_for_cpu`
        # or `quantize_for_cpu` prepared it; None: a product with the embedding.
        self.cpu_output: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Checkpoint,
        *,
        device: torch.device,
        dtype: torch.dtype,
        quantization: Quantization = Quantization.NONE,
    ) -> "Whisper":
        """ValueError for a `quantization` that cannot run on `device` or with `dtype`."""
        problem = None
        if quantization is Quantization.INT8:
            problem = cpu_int8.problem(device, dtype)
        elif quantization is Quantization.FP8:
            problem = fp8_linear.problem(device, dtype)
        if problem is not None:
            raise ValueError(problem)
        with torch.device("meta"):
            model = cls(checkpoint.config.dims)
        state = {k: v for k, v in checkpoint.state_dict.items() if k != "proj_out.weight"}
        model.load_state_dict(state, strict=True, assign=True)
        model = model.to(device=device, dtype=dtype).eval()
        if quantization is Quantization.INT8:
            model.quantize_for_cpu()
        elif quantization is Quantization.FP8:
            model.quantize_fp8()
        elif cpu_linear.can_pack(device, dtype):
            model.pack_for_cpu()
        if device.type == "cuda":  # a decoder step launches two matrix products fewer per layer
            for layer in model.decoder.layers:
                layer.self_attn.fuse_qkv()
        return model

    def pack_for_cpu(self) -> None:
        """Run every linear layer, and the output projection, through oneDNN (`cpu_linear`)."""
        cpu_linear.pack_linears(self)
        packed = cpu_linear.pack(self.decoder.embed_tokens.weight)
        self.cpu_output = partial(cpu_linear.packed_linear, packed=packed, bias=None)

    def quantize_for_cpu(self) -> None:
        """Run every linear layer, and the output projection, in int8 (`cpu_int8`)."""
        cpu_int8.quantize_linears(self)
        packed = cpu_int8.pack(self.decoder.embed_tokens.weight, None)
        self.cpu_output = partial(cpu_int8.int8_linear, packed=packed)

    def quantize_fp8(self, *, keep_encoder_layers: frozenset[int] = frozenset(), cross_kv: bool = True) -> None:
        """Run the products over the encoder's positions in FP8 (`fp8_linear`): every
        encoder layer's, and the decoder's cross-attention K/V projections. What
        bench.fp8_accuracy's variants leave in the model's dtype: `keep_encoder_layers`
        (their indices), and the cross K/V projections unless `cross_kv`."""
        for index, layer in enumerate(self.encoder.layers):
            if index in keep_encoder_layers:
                continue
            layer.self_attn.quantize_fp8()
            layer.fc1, layer.fc2 = fp8_linear.Fp8Linear.of(layer.fc1), fp8_linear.Fp8Linear.of(layer.fc2)
        for layer in self.decoder.layers if cross_kv else ():
            cross = layer.encoder_attn
            cross.k_proj, cross.v_proj = fp8_linear.Fp8Linear.of(cross.k_proj), fp8_linear.Fp8Linear.of(cross.v_proj)

    def encode(
        self, mel: torch.Tensor, attention: EncoderAttention, stop: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        return self.encoder(mel, attention, stop)

    def cross_kv(self, audio_features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if isinstance(self.decoder.layers[0].encoder_attn.k_proj, fp8_linear.Fp8Linear):
            # quantized once for every layer's K and V projections
            audio_features = fp8_linear.QuantizedInput.of(audio_features)
        return [layer.cross_kv(audio_features) for layer in self.decoder.layers]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, width] -> logits [N, vocab] in float32 (tied output projection)."""
        if self.cpu_output is not None:
            return self.cpu_output(hidden).float()
        return self.raw_logits(hidden).float()

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, width] -> logits [N, vocab] in the model's dtype, for kernels that
        read them as float32 themselves (`step_kernels`); not on the CPU's prepared paths."""
        return hidden @ self.decoder.embed_tokens.weight.T

    def decode_step(
        self, tokens: torch.Tensor, layout: StepLayout, attention: AttentionBackend, logit_index: torch.Tensor
    ) -> torch.Tensor:
        """Run the step's new tokens (rows flattened, as `layout` says) through the
        decoder, writing their K/V to the cache; return the logits at the
        flattened token positions `logit_index`: [len(logit_index), vocab]."""
        attention.begin_step(layout)
        hidden = self.decoder(tokens, layout.positions(tokens.device), attention)
        return self.logits(hidden[logit_index])
