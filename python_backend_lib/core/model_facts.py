"""What a Whisper checkpoint is, apart from its tensors: its dimensions, its
control tokens, and the decoding facts its configuration carries (no torch).

Every checkpoint format (`checkpoints`) ends in a `ModelConfig`; the engine
reads its dimensions, the tokenizer and the decoding rules its special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.geometry import CHUNK_SECONDS, SECONDS_PER_POSITION
from python_backend_lib.core.languages import LANGUAGE_CODES

# Token-id layout. English-only vocabularies end <|endoftext|> at 50256, multilingual
# ones put it at 50257; the control tokens then sit just below the timestamp tokens
# <|0.00|> ... <|30.00|>, so everything is derived from the vocabulary size.
ENGLISH_EOT = 50256
MULTILINGUAL_EOT = 50257
# One timestamp token per encoder position of a window, both ends included: 1,501.
N_TIMESTAMP_TOKENS = round(CHUNK_SECONDS / SECONDS_PER_POSITION) + 1
# English-only vocabularies have 51,864 tokens, multilingual ones 51,865 (51,866 from large-v3).
MIN_MULTILINGUAL_VOCAB = 51865
SPACE_TOKEN = 220  # " " in both GPT-2 based vocabularies


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


def is_multilingual_vocab(n_vocab: int) -> bool:
    """What a checkpoint that does not say is taken to be, from its vocabulary size."""
    return n_vocab >= MIN_MULTILINGUAL_VOCAB


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
    def for_vocab(cls, n_vocab: int, multilingual: bool) -> SpecialTokens:
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
            language_codes=LANGUAGE_CODES[:n_languages],
        )

    def language_token(self, code: str) -> int:
        """The token of a request's language; RequestError for one this checkpoint lacks."""
        try:
            return self.sot + 1 + self.language_codes.index(code)
        except ValueError:
            raise RequestError(f"unknown language code {code!r}") from None

    @property
    def language_tokens(self) -> tuple[int, ...]:
        return tuple(range(self.sot + 1, self.sot + 1 + len(self.language_codes)))

    @property
    def default_begin_suppress(self) -> tuple[int, ...]:
        """What may not start a transcript when a checkpoint does not say: a space, or the end."""
        return (SPACE_TOKEN, self.eot)


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's configuration. directory: its Hugging Face-format folder,
    when there is one (the tokenizer lives there); source: the name it was loaded by."""

    dims: ModelDims
    special: SpecialTokens
    multilingual: bool
    suppress_tokens: tuple[int, ...]
    begin_suppress_tokens: tuple[int, ...]
    alignment_heads: tuple[tuple[int, int], ...]
    source: str
    directory: Path | None

    @property
    def tokenizer_path(self) -> Path | None:
        if self.directory is None:
            return None
        path = self.directory / "tokenizer.json"
        return path if path.exists() else None
