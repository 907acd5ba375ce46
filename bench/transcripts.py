"""What a benchmark request must get back: non-empty text of a plausible (or an exact) length.

A benchmark whose requests return nothing measures nothing: every response is
read as verbose_json and its text tokens are counted (the segments' tokens
below <|endoftext|>, so timestamps and control tokens do not count). With
real weights the count must be plausible for the clip's length; with forced
lengths (random weights, min_new_tokens = max_new_tokens) it must be exact.

With real weights each answer is also compared with the library's transcript of
the same clip, decoded alone on the same device before the run (`reference`):
equal, or, as float16 results depend on the batch a request shares, within
MAX_REFERENCE_WORD_ERROR of it (a near tie decided the other way changes a word
or two); further off is a wrong answer, not throughput. A window sampled at a
temperature (fallback) follows the request's seed, so it too is compared for
equality (the share of answers identical to the same request alone), but a
sampled answer that differs is not wrong: a logit moved by the batch changes
the draw, and every later token with it. Random weights decoding
freely (no forced length: the GPU soak) answer noise of any length; only the
record's form is checked.

One exception, with real weights: a window that fell back to sampling may
repeat itself past the plausible length. That is the model's own answer
(openai-whisper keeps the last temperature's, whatever it is), not a broken
benchmark: it passes, marked `long_sample`, and each point counts them. On
the H100, tiny.en in float16 falls back on a 1.5 s cut of the sonnet (on the
CPU, in float32, it does not), and now and then samples a loop there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# What every benchmark request asks for beyond the shipped defaults (timestamps on, as
# openai-whisper decodes): the whole transcript as verbose_json, so its tokens can be counted.
REQUEST_PARAMETERS: dict[str, object] = {"response_format": "verbose_json"}

# Fast read speech is about 4 tokens a second; a transcript far beyond that is a
# repetition loop, not speech. The slack lets a short clip hold a few words.
MAX_TOKENS_PER_SECOND = 10.0
TOKEN_SLACK = 10
# An answer whose words differ from the library's transcript of the clip by more than
# this share (word error rate) is wrong: another clip's, cut short, or garbled.
MAX_REFERENCE_WORD_ERROR = 0.3


@dataclass(frozen=True)
class TranscriptCheck:
    """How one response is judged.

    eot: the checkpoint's <|endoftext|> id; smaller ids are text.
    expected_tokens: the exact text-token count (forced lengths), or None for
        any plausible count for `duration_s`.
    free_length: random weights decoding freely: any length up to the text
        context is their answer (the soak's stress of the length limit), so only
        the record's form is checked.
    """

    eot: int
    duration_s: float
    expected_tokens: int | None = None
    free_length: bool = False
    reference: str | None = None  # the library's transcript of the clip, alone on the same device

    @property
    def max_tokens(self) -> int:
        return math.floor(MAX_TOKENS_PER_SECOND * self.duration_s) + TOKEN_SLACK


@dataclass(frozen=True)
class Verdict:
    tokens: int  # text tokens in the transcript
    fallback: bool  # some window was decoded again at a higher temperature
    problem: str | None  # None when the transcript passes
    long_sample: bool = False  # longer than plausible, from a window sampled at a temperature
    exact: bool | None = None  # equal to the reference; None: no reference, or a problem
    differs: str | None = None  # the transcript's text where it is not equal to the reference

    @property
    def ok(self) -> bool:
        return self.problem is None


def text_tokens(record: Mapping[str, Any], eot: int) -> int:
    """Text tokens of a verbose_json record: segment tokens below `eot`."""
    return sum(1 for segment in record["segments"] for token in segment["tokens"] if token < eot)


def judge(record: Mapping[str, Any], check: TranscriptCheck) -> Verdict:
    """Whether a verbose_json record (as a dict) is a real transcript of the clip."""
    tokens = text_tokens(record, check.eot)
    fallback = any(segment.get("temperature", 0.0) > 0 for segment in record["segments"])
    problem, long_sample = None, False
    if check.free_length:
        return Verdict(tokens=tokens, fallback=fallback, problem=None)
    if not str(record.get("text", "")).strip():
        problem = "empty text"
    elif check.expected_tokens is not None and tokens != check.expected_tokens:
        problem = f"{tokens} text tokens, {check.expected_tokens} forced"
    elif check.expected_tokens is None and tokens > check.max_tokens and fallback:
        long_sample = True
    elif check.expected_tokens is None and not 1 <= tokens <= check.max_tokens:
        problem = f"{tokens} text tokens for {check.duration_s:g} s (plausible: 1 to {check.max_tokens})"
    exact = None
    if check.reference is not None and problem is None:
        text = str(record.get("text", ""))
        exact = text == check.reference
        error = 0.0 if exact or fallback else word_error_rate(check.reference, text)
        if error > MAX_REFERENCE_WORD_ERROR:
            problem = f"word error rate {error:.2f} against the library's transcript {check.reference[:60]!r}"
    return Verdict(tokens=tokens, fallback=fallback, problem=problem, long_sample=long_sample, exact=exact,
                   differs=str(record.get("text", "")) if exact is False else None)


def words(text: str) -> list[str]:
    """Lower-case words without punctuation: what a word error rate compares."""
    return "".join(c if c.isalnum() or c.isspace() or c == "'" else " " for c in text.lower()).split()


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level edit distance over the reference's length (1.0 for a wrong answer to an empty one)."""
    ref, hyp = words(reference), words(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        diagonal, row[0] = row[0], i
        for j, h in enumerate(hyp, start=1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (r != h))
    return row[-1] / len(ref)


def judge_json(data: bytes | str, check: TranscriptCheck) -> Verdict:
    """`judge` of a verbose_json document as the server sends it."""
    try:
        record = json.loads(data)
        return judge(record, check)
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        return Verdict(tokens=0, fallback=False, problem=f"not verbose_json: {error}")
