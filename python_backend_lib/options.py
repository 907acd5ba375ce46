"""What a caller may ask of one transcription, and what it gets back.

Options are frozen and checked once, when they are made: a bad option raises
`ValueError` naming the problem, long before any audio is decoded.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

# Whisper's decoder has 448 learned positions; the previous-text prompt may use
# at most half of them (openai-whisper's rule), minus the <|startofprev|> token.
MAX_TEXT_POSITIONS = 448
MAX_PROMPT_TOKENS = MAX_TEXT_POSITIONS // 2 - 1
# The first timestamp may be at most this far into the window.
DEFAULT_MAX_INITIAL_TIMESTAMP_S = 1.0


class Task(str, enum.Enum):
    TRANSCRIBE = "transcribe"
    TRANSLATE = "translate"


@dataclass(frozen=True)
class DecodingOptions:
    """How to decode one 30 s window.

    language: ISO code such as "en"; None lets a multilingual model detect it
        (English-only models ignore it).
    timestamps: emit <|t|> tokens and so segments with times.
    prompt: previous text to condition on (openai-whisper's initial_prompt);
        refused when longer than MAX_PROMPT_TOKENS.
    previous_tokens: earlier windows' tokens to condition on in long audio;
        only the last MAX_PROMPT_TOKENS are used. Takes the place of `prompt`.
    max_new_tokens: cap on generated tokens; None fills the 448 positions.
    min_new_tokens: <|endoftext|> is suppressed until this many tokens exist
        (as in transformers; benchmarks use it to force decode lengths).
    temperature: 0 is greedy; above 0 samples from softmax(logits / t).
    """

    task: Task = Task.TRANSCRIBE
    language: str | None = None
    timestamps: bool = False
    prompt: str | None = None
    previous_tokens: tuple[int, ...] = ()
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    temperature: float = 0.0
    suppress_blank: bool = True
    max_initial_timestamp: float = DEFAULT_MAX_INITIAL_TIMESTAMP_S

    def __post_init__(self) -> None:
        if not isinstance(self.task, Task):
            try:
                object.__setattr__(self, "task", Task(self.task))
            except ValueError:
                raise ValueError(
                    f"task must be one of {[t.value for t in Task]}, got {self.task!r}"
                ) from None
        if self.language is not None and (
            not isinstance(self.language, str) or not self.language.strip()
        ):
            raise ValueError(f"language must be a language code such as 'en', got {self.language!r}")
        if self.max_new_tokens is not None and (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or not 1 <= self.max_new_tokens <= MAX_TEXT_POSITIONS
        ):
            raise ValueError(
                f"max_new_tokens must be an integer from 1 to {MAX_TEXT_POSITIONS}, got {self.max_new_tokens!r}"
            )
        if (
            isinstance(self.min_new_tokens, bool)
            or not isinstance(self.min_new_tokens, int)
            or not 0 <= self.min_new_tokens <= (self.max_new_tokens or MAX_TEXT_POSITIONS)
        ):
            raise ValueError(
                f"min_new_tokens must be an integer from 0 to max_new_tokens, got {self.min_new_tokens!r}"
            )
        if not isinstance(self.temperature, (int, float)) or not (
            math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0
        ):
            raise ValueError(f"temperature must be a number from 0 to 2, got {self.temperature!r}")
        if not isinstance(self.max_initial_timestamp, (int, float)) or not (
            0.0 <= self.max_initial_timestamp <= 30.0
        ):
            raise ValueError(
                f"max_initial_timestamp must be from 0 to 30 seconds, got {self.max_initial_timestamp!r}"
            )
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"prompt must be text, got {type(self.prompt).__name__}")


@dataclass(frozen=True)
class DecodingResult:
    """The outcome of decoding one window.

    tokens: the generated tokens, timestamps included, without the prompt and
        without the final <|endoftext|>.
    """

    tokens: tuple[int, ...]
    language: str | None
    avg_logprob: float
    no_speech_prob: float
    temperature: float
    finished: bool = True  # False when stopped by max_new_tokens or the 448 positions
    prompt_tokens: tuple[int, ...] = field(default=(), repr=False)
    language_probability: float | None = None  # set when the language was detected
