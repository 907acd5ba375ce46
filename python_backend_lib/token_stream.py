"""TOKENS, the tensor from the `whisper` model to `postprocessing`, for audio of any length.

The library transcribes long audio window by window (`longform.LongFormJob`):
each 30 s window's generated tokens become segments at an offset that depends
on where the previous windows stopped. TOKENS carries every accepted window's
generated tokens in order, each window closed by <|endoftext|>:

    window 0 tokens, EOT, window 1 tokens, EOT, ...

A window that was skipped as silent is empty (a lone EOT). The window offsets
are not sent: `postprocessing` replays the same seek rule (`longform.split_window`)
from the tokens and the audio's duration, so its segments are the library's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from python_backend_lib import audio
from python_backend_lib.longform import (
    TranscribeOptions,
    Transcript,
    compression_ratio,
    content_frames,
    is_silent,
    split_window,
)
from python_backend_lib.options import DecodingResult
from python_backend_lib.tokenizer import Segment, Tokenizer

NAN = float("nan")


def pack(transcript: Transcript, options: TranscribeOptions, eot: int) -> np.ndarray:
    """TOKENS for a finished transcript: int32 [tokens], windows closed by `eot`."""
    stream: list[int] = []
    for window in transcript.windows:
        if not is_silent(window, options):  # the rule by which LongFormJob kept no segments
            stream.extend(window.tokens)
        stream.append(eot)
    return np.array(stream, dtype=np.int32)


def unpack(stream: Sequence[int], eot: int) -> list[tuple[int, ...]]:
    """The windows' tokens; ValueError if the stream does not end a window."""
    windows: list[tuple[int, ...]] = []
    current: list[int] = []
    for token in stream:
        if token == eot:
            windows.append(tuple(current))
            current = []
        else:
            current.append(int(token))
    if current:
        raise ValueError(f"TOKENS must end with <|endoftext|> ({eot}), the end of its last window")
    return windows


def transcript_text_and_segments(
    tokenizer: Tokenizer, windows: Sequence[tuple[int, ...]], duration: float
) -> tuple[str, tuple[Segment, ...]]:
    """Text and segments as `LongFormJob` makes them, from the windows' tokens.

    duration: seconds of audio (a whole number of samples).
    """
    content = audio_frames(duration)
    seek = 0
    segments: list[Segment] = []
    for tokens in windows:
        if seek >= content:
            raise ValueError(f"TOKENS holds more windows than {duration} s of audio has")
        frames = min(audio.N_FRAMES, content - seek)
        ratio = compression_ratio(tokenizer.decode(tokens))
        # The window's decoding statistics stay in the whisper model; SEGMENTS carries
        # only times and text, which depend on the tokens alone.
        result = DecodingResult(tokens=tokens, language=None, avg_logprob=NAN, no_speech_prob=NAN, temperature=NAN)
        outcome = split_window(tokens, tokenizer, seek, frames, result, ratio)
        segments.extend(outcome.segments)
        seek += outcome.advance
    text = tokenizer.decode([t for s in segments for t in s.tokens]).strip()
    return text, tuple(segments)


def audio_frames(duration: float) -> int:
    """Mel frames that hold audio, as LongFormJob counts them in the LOG_MEL of `duration` seconds."""
    samples = round(duration * audio.SAMPLE_RATE)
    # `longform.features_for`: one window up to 30 s, else everything plus 30 s of padding.
    mel_frames = audio.N_FRAMES if samples <= audio.N_SAMPLES else (samples + audio.N_SAMPLES) // audio.HOP_LENGTH
    return content_frames(mel_frames, duration)
