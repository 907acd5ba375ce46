"""Where batched long-form cuts a recording: chunks of at most 30 s ending in pauses.

Checked on synthetic loudness, and on the three-minute recording, whose clips'
places are known (tests/long_recording.py): every cut must fall where no one
speaks.
"""

from __future__ import annotations

import numpy as np
import pytest
from long_recording import SPEECH_FRAME_SAMPLES, build

from python_backend_lib.audio.features import features_for
from python_backend_lib.core import geometry
from python_backend_lib.core.geometry import content_frames
from python_backend_lib.transcription.chunking import (
    CUT_SEARCH_FRAMES,
    Chunk,
    cut_point,
    frame_loudness,
    plan_chunks,
)

N_FRAMES = geometry.N_FRAMES


def test_the_cut_is_the_middle_of_the_latest_pause():
    loudness = np.ones(100)
    loudness[20:24] = 0.0  # too short for a pause: the gap between two words
    loudness[50:80] = 0.01  # a pause, as quiet within the margin
    loudness[90:92] = 0.0
    assert cut_point(loudness, 0, 100) == 65
    assert cut_point(loudness, 55, 100) == 67  # the pause, clipped to the range


def test_of_two_pauses_the_later_wins():
    loudness = np.ones(100)
    loudness[10:40] = loudness[60:85] = 0.0
    assert cut_point(loudness, 0, 100) == 72


def test_without_a_pause_the_longest_quiet_run_the_later_of_equals():
    loudness = np.ones(100)
    loudness[10:15] = loudness[60:65] = 0.0
    loudness[30:38] = 0.05
    assert cut_point(loudness, 0, 100) == 34
    assert cut_point(loudness, 0, 29) == 12
    assert cut_point(loudness, 40, 100) == 62
    loudness[30:38] = 1.0
    assert cut_point(loudness, 0, 100) == 62


def test_chunks_cover_the_recording_in_order_none_over_30_s():
    rng = np.random.default_rng(0)
    content = 10 * N_FRAMES + 1234
    chunks = plan_chunks(rng.random(content + N_FRAMES), content)
    assert chunks[0].start == 0 and chunks[-1].end == content
    assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
    assert all(0 < c.end - c.start <= N_FRAMES for c in chunks)
    # Each cut lies in the last CUT_SEARCH_FRAMES of the 30 s its chunk could hold.
    assert all(c.end - c.start >= N_FRAMES - CUT_SEARCH_FRAMES for c in chunks[:-1])


@pytest.mark.parametrize("content", [1, N_FRAMES - 1, N_FRAMES])
def test_up_to_30_s_is_one_chunk(content):
    assert plan_chunks(np.zeros(content), content) == (Chunk(0, content),)


def test_the_search_must_leave_each_chunk_a_frame():
    with pytest.raises(ValueError, match="search_frames"):
        plan_chunks(np.zeros(5000), 5000, search_frames=N_FRAMES)


# A pause: 50 ms either side of a cut lie this far below the loudest 10 ms of
# the speech within 3 s of it (the sonnet's reader pauses to its room noise,
# about 30 dB down; the gaps between clips are digital silence).
PAUSE_BELOW_SPEECH_DB = 20.0


def test_every_cut_of_the_three_minute_recording_falls_where_no_one_speaks():
    """Between two clips, or in a pause between two lines of the 53 s sonnet."""
    recording = build()
    mel = features_for(recording.waveform, 80)
    chunks = plan_chunks(frame_loudness(mel), content_frames(len(recording.waveform)))
    assert len(chunks) == 7  # 182 s in chunks of 23 to 30 s: as many as 30 s windows
    frames = recording.waveform[: len(recording.waveform) // SPEECH_FRAME_SAMPLES * SPEECH_FRAME_SAMPLES]
    level_db = 10 * np.log10(np.mean(frames.reshape(-1, SPEECH_FRAME_SAMPLES).astype(np.float64) ** 2, axis=1) + 1e-20)
    for chunk in chunks[:-1]:
        at = chunk.end * geometry.HOP_LENGTH // SPEECH_FRAME_SAMPLES  # 10 ms frames, as mel frames
        cut, nearby = level_db[at - 5 : at + 5], level_db[at - 300 : at + 300]
        assert cut.max() < nearby.max() - PAUSE_BELOW_SPEECH_DB, f"cut at {chunk.end / 100:.2f} s is in speech"
    # Inside a clip only where no gap was near: in the 53 s sonnet.
    inside = {p.clip.file for c in chunks[:-1] for p in recording.placed if p.start <= c.end / 100 <= p.end}
    assert inside == {"sonnet1_longform.wav"}
