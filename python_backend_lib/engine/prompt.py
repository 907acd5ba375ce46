"""The tokens a window's decoding starts from, before the first generated token.

    [<|startofprev|> previous text...] <|startoftranscript|> [language task] [<|notimestamps|>]

Control-token ids come from the checkpoint's config, never from strings. A
request the checkpoint cannot serve as asked (a language an English-only model
does not know, translation without a multilingual model, a prompt too long)
raises `RequestError` here, before it takes a decoding slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.languages import LANGUAGE_CODES
from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.core.options import MAX_PROMPT_TOKENS, DecodingOptions, Task

if TYPE_CHECKING:
    from python_backend_lib.engine.rows import Row
    from python_backend_lib.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Prompt:
    """The tokens fed before the first generated one.

    tokens: [<|startofprev|> prompt...] <|startoftranscript|> [language task] [<|notimestamps|>]
    sot_index: where <|startoftranscript|> sits (the no-speech probability is read there).
    detect_language: the tokens stop at <|startoftranscript|>; language and task
        follow once the language has been detected from the logits there.
    """

    tokens: tuple[int, ...]
    sot_index: int
    detect_language: bool
    language: str | None


# How a refusal names the languages there are: codes or English names, as openai-whisper names them.
WHISPER_LANGUAGES = "a code such as 'de' or an English name such as 'german', as openai-whisper names its 99"


def initial_tokens(config: ModelConfig, options: DecodingOptions, tokenizer: Tokenizer | None) -> Prompt:
    """Raises RequestError when the options do not fit the checkpoint."""
    special = config.special
    language = options.language
    if language is not None and language.lower() not in LANGUAGE_CODES:
        raise RequestError(f"unknown language {options.language!r}: Whisper's languages are {WHISPER_LANGUAGES}")
    if not config.multilingual:
        fix = "serve a multilingual checkpoint (whisper-triton serve --checkpoint base)"
        if options.task is Task.TRANSLATE:
            raise RequestError(f"task 'translate' needs a multilingual checkpoint; this one is English-only: {fix}")
        if language not in (None, "en"):
            raise RequestError(f"this checkpoint is English-only; {language!r} needs a multilingual one: {fix}")
        language = "en"
    elif language is not None:
        language = language.lower()
        if language not in special.language_codes:  # yue before large-v3
            raise RequestError(f"language {options.language!r} is not one of this checkpoint's")
    tokens: list[int] = []
    if options.previous_tokens:
        tokens = [special.startofprev, *options.previous_tokens[-MAX_PROMPT_TOKENS:]]
    elif options.prompt is not None and options.prompt.strip():
        if tokenizer is None:
            raise ValueError("a prompt needs a checkpoint with a tokenizer")  # the server's setup, not the request
        prompt_tokens = tokenizer.encode(" " + options.prompt.strip())
        if len(prompt_tokens) > MAX_PROMPT_TOKENS:
            raise RequestError(
                f"prompt is {len(prompt_tokens)} tokens long; the model allows at most {MAX_PROMPT_TOKENS}"
            )
        tokens = [special.startofprev, *prompt_tokens]
    sot_index = len(tokens)
    detect = config.multilingual and language is None
    if detect:
        tokens.append(special.sot)
    else:
        tokens.extend(transcript_prefix(config, language, options.task, options.timestamps))
    return Prompt(tuple(tokens), sot_index, detect, language)


def transcript_prefix(config: ModelConfig, language: str, task: Task, timestamps: bool) -> list[int]:
    """<|startoftranscript|>, then language and task (multilingual checkpoints only),
    then <|notimestamps|> unless timestamps are asked for."""
    return [config.special.sot, *task_tokens(config, language, task, timestamps)]


def task_tokens(config: ModelConfig, language: str, task: Task, timestamps: bool) -> list[int]:
    """What follows <|startoftranscript|>: language and task (multilingual only),
    then <|notimestamps|> unless timestamps were asked for."""
    special = config.special
    tokens = []
    if config.multilingual:
        task_token = special.translate if task is Task.TRANSLATE else special.transcribe
        tokens += [special.language_token(language), task_token]
    if not timestamps:
        tokens.append(special.no_timestamps)
    return tokens


def generation_room(config: ModelConfig, prompt_tokens: int) -> int:
    """Tokens a row may generate after `prompt_tokens` of prompt: together they fill at
    most the text context (448 positions). The length invariant: no row ever reads or
    writes a position past it. A row that reaches the room ends unfinished, as
    openai-whisper's does at its sample length, and the fallback rules judge it."""
    return config.dims.n_text_ctx - prompt_tokens


def start_of_transcript(
    config: ModelConfig, rows: list[Row], no_speech: list[float], languages: list[tuple[int, float]] | None
) -> set[Row]:
    """Record the no-speech probability of rows whose <|startoftranscript|> was
    just fed, and detect the language of those that asked; return the rows
    that choose no token now (they feed their language and task tokens next).

    languages: each row's likeliest language at <|startoftranscript|> (its index
        among the language tokens) and its probability; None on English-only checkpoints.
    """
    waiting: set[Row] = set()
    codes = config.special.language_codes
    for k, row in enumerate(rows):
        if row.prompt.detect_language and row.language is None:
            index, confidence = languages[k]
            row.language, row.language_probability = codes[index], confidence
            row.pending = task_tokens(config, row.language, row.options.task, row.options.timestamps)
            # The prompt grew by the language and task tokens: the room to generate shrinks by as many.
            room = generation_room(config, len(row.prompt.tokens) + len(row.pending))
            row.max_new_tokens = min(row.max_new_tokens, room)
            waiting.add(row)
    for row, probability in zip(rows, no_speech):
        row.prefilled = True
        row.no_speech_prob = probability
    return waiting
