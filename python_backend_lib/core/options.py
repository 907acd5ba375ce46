"""What a caller may ask of one transcription, and what it gets back.

Options are frozen and checked once, when they are made: a bad option raises
`RequestError` (the caller's mistake) naming the problem, long before any audio is decoded.
"""

from __future__ import annotations

import enum
import math
import sys
from dataclasses import dataclass, field
from typing import TypeVar

from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.languages import requested_language

# Whisper's decoder has 448 learned positions; the previous-text prompt may use
# at most half of them (openai-whisper's rule), minus the <|startofprev|> token.
MAX_TEXT_POSITIONS = 448
MAX_PROMPT_TOKENS = MAX_TEXT_POSITIONS // 2 - 1
# The first timestamp may be at most this far into the window.
DEFAULT_MAX_INITIAL_TIMESTAMP_S = 1.0
# Draws at a temperature follow a seed (`DecodingOptions.seed`): a fixed one by default, so the
# same request gives the same transcript each time; the `seed` request parameter picks others.
DEFAULT_SEED = 0
MAX_SEED = 2**32 - 1


# openai-whisper's defaults.
DEFAULT_TEMPERATURE_INCREMENT = 0.2
MAX_TEMPERATURE = 1.0
DEFAULT_COMPRESSION_RATIO_THRESHOLD = 2.4
DEFAULT_LOGPROB_THRESHOLD = -1.0
DEFAULT_NO_SPEECH_THRESHOLD = 0.6
# The temperatures a window may be decoded at, its first included: each is a whole decode
# of up to 448 tokens, so a tiny increment would hold the engine on one window for hours
# (openai-whisper's default ladder has 6; an increment of 0.1 from 0 gives 11).
MAX_TEMPERATURES = 11
# Each beam (or best_of sample) is a row of the engine's batch, with its own KV slot.
MAX_BEAM_SIZE = 16


Choice = TypeVar("Choice", bound=enum.Enum)


def choice(kind: type[Choice], value: object, name: str) -> Choice:
    """`value` as a member of the enum `kind` (a member, or its value);
    RequestError naming `name` and the choices otherwise."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        raise RequestError(f"{name} must be one of {[member.value for member in kind]}, got {value!r}") from None


class Task(str, enum.Enum):
    TRANSCRIBE = "transcribe"
    TRANSLATE = "translate"


@dataclass(frozen=True)
class DecodingOptions:
    """How to decode one 30 s window.

    language: ISO code such as "en" (a name such as "English" is taken for its
        code); None lets a multilingual model detect it (English-only models ignore it).
    timestamps: emit <|t|> tokens and so segments with times.
    prompt: previous text to condition on (openai-whisper's initial_prompt);
        refused when longer than MAX_PROMPT_TOKENS.
    previous_tokens: earlier windows' tokens to condition on in long audio;
        only the last MAX_PROMPT_TOKENS are used. Takes the place of `prompt`.
    max_new_tokens: cap on generated tokens; None fills the 448 positions.
    min_new_tokens: <|endoftext|> is suppressed until this many tokens exist
        (as in transformers; benchmarks use it to force decode lengths).
    temperature: 0 is greedy; above 0 samples from softmax(logits / t).
    beam_size: at temperature 0, beam search with this many beams (None or 1: greedy).
    best_of: above temperature 0, draw this many samples and keep the best (None or 1: one).
    patience: beam search stops once round(beam_size * patience) candidates
        have ended (None: 1.0).
    length_penalty: how candidates are ranked (beams and best_of samples alike):
        None divides the summed log-probability by the length; a number alpha
        divides it by ((5 + length) / 6) ** alpha instead.
    seed: what a draw at a temperature depends on, with the window and the fallback
        attempt (`engine.draws`): the same request draws the same tokens each time.
        An integer from 0 to 2**32 - 1; DEFAULT_SEED unless asked.
    Beams apply at temperature 0 and samples above it, so the temperature
    fallback switches from one to the other (openai-whisper's and faster-whisper's rule).
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
    beam_size: int | None = None
    best_of: int | None = None
    patience: float | None = None
    length_penalty: float | None = None
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        object.__setattr__(self, "task", choice(Task, self.task, "task"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise RequestError(f"seed must be an integer from 0 to {MAX_SEED}, got {self.seed!r}")
        _check_search(self)
        if self.language is not None:
            if not isinstance(self.language, str) or not self.language.strip():
                raise RequestError(
                    f"language must be a language code such as 'en' or a name such as 'English', got {self.language!r}"
                )
            object.__setattr__(self, "language", requested_language(self.language))  # "English" is "en"
        if self.max_new_tokens is not None and (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or not 1 <= self.max_new_tokens <= MAX_TEXT_POSITIONS
        ):
            raise RequestError(
                f"max_new_tokens must be an integer from 1 to {MAX_TEXT_POSITIONS}, got {self.max_new_tokens!r}"
            )
        if (
            isinstance(self.min_new_tokens, bool)
            or not isinstance(self.min_new_tokens, int)
            or not 0 <= self.min_new_tokens <= (self.max_new_tokens or MAX_TEXT_POSITIONS)
        ):
            raise RequestError(
                f"min_new_tokens must be an integer from 0 to max_new_tokens, got {self.min_new_tokens!r}"
            )
        if not isinstance(self.temperature, (int, float)) or not (
            math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0
        ):
            raise RequestError(f"temperature must be a number from 0 to 2, got {self.temperature!r}")
        if not isinstance(self.max_initial_timestamp, (int, float)) or not (
            0.0 <= self.max_initial_timestamp <= 30.0
        ):
            raise RequestError(
                f"max_initial_timestamp must be from 0 to 30 seconds, got {self.max_initial_timestamp!r}"
            )
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise RequestError(f"prompt must be text, got {type(self.prompt).__name__}")


def _check_search(options: DecodingOptions) -> None:
    """beam_size, best_of, patience and length_penalty, each None or in range."""
    for name in ("beam_size", "best_of"):
        value = getattr(options, name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BEAM_SIZE
        ):
            raise RequestError(f"{name} must be an integer from 1 to {MAX_BEAM_SIZE}, got {value!r}")
    patience = options.patience
    if patience is not None:
        if isinstance(patience, bool) or not isinstance(patience, (int, float)) or not (
            math.isfinite(patience) and 0 < patience <= MAX_BEAM_SIZE
        ):
            raise RequestError(f"patience must be a number above 0 and at most {MAX_BEAM_SIZE}, got {patience!r}")
        if round((options.beam_size or 1) * patience) < 1:
            raise RequestError(
                f"patience {patience!r} leaves no candidate for beam_size {options.beam_size!r}: "
                "round(beam_size * patience) must be at least 1"
            )
    penalty = options.length_penalty
    if penalty is not None and (
        isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0.0 <= penalty <= 1.0
    ):
        raise RequestError(f"length_penalty must be a number from 0 to 1 (or unset for length), got {penalty!r}")


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
    # The KV slot that still holds the window's encoder K/V while the result's callback
    # runs, for a window submitted with keep_audio (word timestamps align on them
    # instead of encoding the window again); None otherwise. Freed once the callback returns.
    audio_slot: int | None = field(default=None, compare=False)


class LongFormMode(str, enum.Enum):
    """How audio longer than one window is cut (see `longform`)."""

    SEQUENTIAL = "sequential"
    BATCHED = "batched"


class WindowPadding(str, enum.Enum):
    """What a window holds past the end of the audio (see `longform`).

    OPENAI_WHISPER, the default: zeros of the normalised log-mel whatever the
    length, as openai-whisper's and faster-whisper's `transcribe` pad every
    window; a short clip then reads as it reads there. The default because
    those are the transcripts users compare against, and on real speech they
    are the more accurate (docs/benchmarks/beam-wer).
    TRANSFORMERS: as transformers' `generate` pads it, token for token (what
    the exactness tests against it ask for): a recording of up to 30 s is
    padded with silence (the log-mel of zeros, as its feature extractor pads
    the audio), a longer one's last window with zeros of the normalised
    log-mel (long-form `generate`).
    """

    TRANSFORMERS = "transformers"
    OPENAI_WHISPER = "openai-whisper"


@dataclass(frozen=True)
class TranscribeOptions:
    """How to transcribe a whole recording (`longform.LongFormJob`).

    decoding: how to decode each 30 s window; its `temperature` is the first
        temperature tried, and each fallback adds `temperature_increment`, up
        to 1.0 (0 disables fallback).
    compression_ratio_threshold, logprob_threshold: a window whose text is more
        repetitive or less likely than this is decoded again, hotter.
    no_speech_threshold: a window whose no-speech probability is above this,
        with a log-probability below `logprob_threshold`, is skipped as silent.
        A threshold of None disables its check.
    condition_on_previous_text: SEQUENTIAL mode conditions each window on the
        text decoded before it.
    mode: SEQUENTIAL (Whisper's seeking) or BATCHED (windows in parallel).
    word_timestamps: time every word (alignment heads and DTW; one extra
        decoder pass per window).
    hallucination_silence_threshold: with word timestamps, a stretch of
        doubtful words (`transcription.hallucination`) that has at least this
        many seconds of silence around it is dropped, and decoding seeks past
        the silence (openai-whisper's option); None: off.
    window_padding: what a window holds past the end of the audio (`WindowPadding`).
    live: a live session's request: its windows join the engine's batch before every
        other waiting window, without waiting for others to encode with (`Engine.submit`).
    """

    decoding: DecodingOptions = DecodingOptions()
    temperature_increment: float = DEFAULT_TEMPERATURE_INCREMENT
    compression_ratio_threshold: float | None = DEFAULT_COMPRESSION_RATIO_THRESHOLD
    logprob_threshold: float | None = DEFAULT_LOGPROB_THRESHOLD
    no_speech_threshold: float | None = DEFAULT_NO_SPEECH_THRESHOLD
    condition_on_previous_text: bool = True
    mode: LongFormMode = LongFormMode.SEQUENTIAL
    word_timestamps: bool = False
    hallucination_silence_threshold: float | None = None
    window_padding: WindowPadding = WindowPadding.OPENAI_WHISPER
    live: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", choice(LongFormMode, self.mode, "long_form"))
        object.__setattr__(self, "window_padding", choice(WindowPadding, self.window_padding, "window_padding"))
        _check_threshold("hallucination_silence_threshold", self.hallucination_silence_threshold, low=0.0)
        if self.hallucination_silence_threshold is not None and not self.word_timestamps:
            # openai-whisper and faster-whisper ignore it then; saying so beats a silent no-op.
            raise RequestError("hallucination_silence_threshold works on word timestamps: add word_timestamps")
        if self.hallucination_silence_threshold is not None and self.mode is LongFormMode.BATCHED:
            raise RequestError("hallucination_silence_threshold seeks window after window: use long_form sequential")
        increment = self.temperature_increment
        if isinstance(increment, bool) or not (
            isinstance(increment, (int, float)) and 0.0 <= increment <= MAX_TEMPERATURE
        ):
            raise RequestError(f"temperature_increment must be from 0 to 1, got {increment!r}")
        if (tried := self._fallbacks() + 1) > MAX_TEMPERATURES:  # counted, not listed: 1e-12 would list 10^12
            first = self.decoding.temperature
            smallest = math.ceil((MAX_TEMPERATURE - first) / (MAX_TEMPERATURES - 1) * 1000) / 1000
            raise RequestError(
                f"temperature_increment {increment!r} from temperature {first:g} tries "
                f"{f'{tried:,}' if tried < 10**6 else 'over a million'} temperatures a "
                f"window; at most {MAX_TEMPERATURES} are allowed (an increment of at least {smallest:g}, or 0 for none)"
            )
        _check_threshold("compression_ratio_threshold", self.compression_ratio_threshold, low=0.0)
        _check_threshold("logprob_threshold", self.logprob_threshold)
        _check_threshold("no_speech_threshold", self.no_speech_threshold, low=0.0, high=1.0)

    @property
    def temperatures(self) -> tuple[float, ...]:
        first = self.decoding.temperature
        return tuple(round(first + i * self.temperature_increment, 6) for i in range(self._fallbacks() + 1))

    def _fallbacks(self) -> int:
        """How many hotter temperatures follow the first, up to 1.0."""
        first = self.decoding.temperature
        if self.temperature_increment <= 0 or first >= MAX_TEMPERATURE:
            return 0
        steps = (MAX_TEMPERATURE - first) / self.temperature_increment + 1e-6
        return math.floor(steps) if math.isfinite(steps) else sys.maxsize  # a subnormal increment: infinitely many


def _check_threshold(name: str, value: float | None, low: float = -math.inf, high: float = math.inf) -> None:
    """A quality threshold is None (its check off) or a finite number from `low` to `high`."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not (
        low <= value <= high
    ):
        if math.isfinite(high):
            wanted = f"a number from {low:g} to {high:g}"
        else:
            wanted = f"a number of at least {low:g}" if math.isfinite(low) else "a finite number"
        raise RequestError(f"{name} must be {wanted}, got {value!r}")
