"""The benchmark's requests: each clip with its request parameters and what its answer must be.

Every system of the table (the served path, the stand-in ceiling, the engine
alone, transformers) gets the same jobs. With real weights a job asks what a
client would (`REQUEST_PARAMETERS`) and its answer must be a plausible
transcript. With random weights each job forces its decode length: as many
text tokens as tiny.en produced per second of real speech, times the clip's
length, with min_new_tokens = max_new_tokens, no timestamp tokens (the served
checkpoint suppresses every token but text, `bench.served_checkpoint`) and no
temperature fallback (forced lengths are not "unlikely" text to decode again).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bench.clips import ClipAudio
from bench.load import LoadRequest
from bench.transcripts import REQUEST_PARAMETERS, TranscriptCheck
from python_backend_lib.contract.parameters import parse_request_parameters
from python_backend_lib.core.options import MAX_TEXT_POSITIONS, TranscribeOptions

# <|startoftranscript|>, language, task, <|notimestamps|> come before the first generated token.
PROMPT_TOKENS = 4
MAX_FORCED_TOKENS = MAX_TEXT_POSITIONS - PROMPT_TOKENS


@dataclass(frozen=True, eq=False)
class Job:
    audio: ClipAudio
    parameters: dict[str, object]
    check: TranscriptCheck

    @property
    def options(self) -> TranscribeOptions:
        """The library's options for this request, parsed as the server parses them."""
        return parse_request_parameters(self.parameters).transcription

    def load_request(self) -> LoadRequest:
        return LoadRequest(name=self.audio.clip.name, wav=self.audio.wav, duration_s=self.audio.clip.duration_s,
                           parameters=self.parameters, check=self.check)

    def describe(self) -> dict:
        clip = self.audio.clip
        return {"name": clip.name, "recording": clip.recording, "start_s": clip.start_s, "end_s": clip.end_s,
                "duration_s": clip.duration_s, "forced_tokens": self.check.expected_tokens}


def real_jobs(clips: list[ClipAudio], eot: int, parameters: Mapping[str, object] | None = None) -> list[Job]:
    """Requests as a client sends them, with `parameters` added to each (beam search, say);
    answers must be plausible transcripts."""
    return [Job(c, {**REQUEST_PARAMETERS, **(parameters or {})}, TranscriptCheck(eot, c.clip.duration_s))
            for c in clips]


def free_jobs(clips: list[ClipAudio], eot: int, parameters: Mapping[str, object] | None = None) -> list[Job]:
    """Requests to random weights without forced lengths, with `parameters` added to each: rows
    run as far as the text context lets them (the soak's stress of the length limit)."""
    return [Job(c, {**REQUEST_PARAMETERS, **(parameters or {})},
                TranscriptCheck(eot, c.clip.duration_s, free_length=True)) for c in clips]


def forced_tokens(duration_s: float, tokens_per_second: float) -> int:
    return min(MAX_FORCED_TOKENS, max(1, round(tokens_per_second * duration_s)))


def forced_jobs(clips: list[ClipAudio], eot: int, tokens_per_second: float) -> list[Job]:
    """Requests that decode exactly forced_tokens(duration) text tokens each."""
    jobs = []
    for c in clips:
        n = forced_tokens(c.clip.duration_s, tokens_per_second)
        parameters = {**REQUEST_PARAMETERS, "language": "en", "timestamps": False, "min_new_tokens": n,
                      "max_new_tokens": n, "temperature_increment": 0}
        jobs.append(Job(c, parameters, TranscriptCheck(eot, c.clip.duration_s, expected_tokens=n)))
    return jobs
