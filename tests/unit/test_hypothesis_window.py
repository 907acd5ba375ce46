"""A live turn's hypotheses transcribe from near the committed words on
(gateway.hypothesis_window): their cost follows the new audio, not the turn's length.

The session's turn is driven here without a WebSocket, its audio added a step at a
time, and its hypotheses transcribed by the library's pipeline with the packaged
tiny.en (the code the whisper model runs in Triton), so that what each hypothesis
was sent can be read back."""

from __future__ import annotations

import asyncio
import difflib
import json
from pathlib import Path

import numpy as np
import pytest
from reference import clips, normalize, word_error_rate

from gateway.hypothesis_window import PROMPT_WORDS, TRIM_AFTER_S, Window, in_turn, next_window
from gateway.live_transcriber import LiveTranscript
from gateway.live_turn import Turn
from gateway.local_agreement import comparison_key
from gateway.realtime import RealtimeOptions, Session
from gateway.realtime_protocol import SessionSettings
from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.core.geometry import SAMPLE_RATE
from python_backend_lib.core.options import DecodingOptions, TranscribeOptions
from python_backend_lib.core.segments import Word

AUDIO = Path(__file__).resolve().parents[1] / "data" / "audio"
TURN_S = 24.0  # the first 24 s of the sonnet's reading: one turn of continuous speech
STEP_S = 1.5  # audio added, and a hypothesis, per step


def word(text: str, start: float, end: float) -> Word:
    return Word(f" {text}", start, end, 0.9)


def test_the_window_stays_until_the_committed_words_reach_past_the_trim_point():
    window = Window(prompt="Glossary: Dashwood.")
    committed = [word("one", 0.5, 0.9), word("two", 4.2, 4.6), word("three", TRIM_AFTER_S - 0.1, TRIM_AFTER_S + 0.3)]
    assert next_window(window, [], "Glossary: Dashwood.") is window
    assert next_window(window, committed, "Glossary: Dashwood.") is window


def test_the_window_moves_to_the_last_committed_word_and_prompts_with_the_words_before_it():
    committed = [word(w, i * 0.5, i * 0.5 + 0.4) for i, w in enumerate("a b c d e f g h i j k l".split())]
    moved = next_window(Window(), committed, None)
    assert moved.start_s == committed[-1].start == 5.5
    assert moved.prompt == " ".join("h i j k".split()[-PROMPT_WORDS:])
    # A session's own prompt stays as it is: with the committed words it could pass the
    # server's token limit, which the gateway cannot count.
    own = next_window(Window(prompt="Glossary: Dashwood."), committed, "Glossary: Dashwood.")
    assert (own.start_s, own.prompt) == (5.5, "Glossary: Dashwood.")
    # Measured from the moved window's start, and only once the committed words reach past it again.
    assert next_window(moved, committed, None) is moved
    later = [*committed, word("m", moved.start_s + TRIM_AFTER_S, moved.start_s + TRIM_AFTER_S + 0.3)]
    assert next_window(moved, later, None).start_s == later[-1].start
    assert next_window(moved, later, None).prompt == "j k l"


def test_a_hypothesis_is_timed_in_the_turn():
    window = Window(start_s=3.0)
    assert in_turn([word("x", 0.25, 0.5)], window) == [word("x", 3.25, 3.5)]


class LibraryTranscriber:
    """The session's Transcriber, with the library's pipeline in place of Triton; keeps
    how much audio, and which prompt, each transcription was sent."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline
        self.calls: list[tuple[float, str | None]] = []
        self.done = asyncio.Event()

    async def transcribe(self, audio: np.ndarray, model: str, language: str | None, prompt: str | None):
        options = TranscribeOptions(word_timestamps=True, decoding=DecodingOptions(prompt=prompt))
        transcript = await asyncio.to_thread(self.pipeline.transcribe, audio, options)
        self.calls.append((len(audio) / SAMPLE_RATE, prompt))
        self.done.set()
        return LiveTranscript(transcript.text.strip(), tuple(w for s in transcript.segments for w in s.words))


class Events:
    """What the session sends its client."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))


@pytest.fixture(scope="module")
def pipeline():
    from python_backend_lib.transcription.pipeline import Pipeline

    pipe = Pipeline.load("default", device="cpu")
    yield pipe
    pipe.close()


def test_a_long_turns_hypotheses_cost_what_its_new_audio_does_and_lose_no_word(pipeline):
    audio = decode_audio((AUDIO / "sonnet1_longform.wav").read_bytes())[: int(TURN_S * SAMPLE_RATE)]
    transcriber, events = LibraryTranscriber(pipeline), Events()
    options = RealtimeOptions(model_ids=("tiny.en",), detector=lambda: None, hypothesis_every_s=STEP_S)

    async def turn_of_speech() -> None:
        session = Session(events, transcriber, options)
        turn = Turn("item_1", 0)
        task = asyncio.create_task(session.turns.run(turn, SessionSettings(model="tiny.en", turn_detection=None)))
        step = int(STEP_S * SAMPLE_RATE)
        for start in range(0, len(audio), step):
            transcriber.done.clear()
            turn.add(audio[start : start + step])
            await asyncio.wait_for(transcriber.done.wait(), 120)  # this step's hypothesis
        turn.close()
        await asyncio.wait_for(task, 120)

    asyncio.run(turn_of_speech())
    *hypotheses, (completed_s, _) = transcriber.calls
    assert completed_s == pytest.approx(TURN_S)  # the completed transcript is the whole turn's
    sent = [seconds for seconds, _ in hypotheses]
    print("seconds of audio per hypothesis:", [round(s, 2) for s in sent])
    # The window moved up behind the committed words, more than once, and from the first move
    # on the hypotheses carry the committed text before it.
    moves = [i + 1 for i, (a, b) in enumerate(zip(sent, sent[1:])) if b < a]
    assert len(moves) >= 2
    assert all(prompt for _, prompt in hypotheses[moves[0] :])
    # So the last hypothesis was sent less than half the turn, and all of them together
    # (whole-turn hypotheses: exactly the turn so far each time) well under the turn so far.
    assert sent[-1] < TURN_S / 2
    assert sum(sent) < 0.75 * sum(STEP_S * (i + 1) for i in range(len(sent)))

    deltas = "".join(e["delta"] for e in events.sent if e["type"].endswith(".delta"))
    transcript = next(e["transcript"] for e in events.sent if e["type"].endswith(".completed"))
    print("deltas:", deltas, "\ncompleted:", transcript)
    said, heard = [comparison_key(w) for w in deltas.split()], [comparison_key(w) for w in transcript.split()]
    opcodes = difflib.SequenceMatcher(a=said, b=heard, autojunk=False).get_opcodes()
    assert not [heard[j1:j2] for op, _, _, j1, j2 in opcodes if op == "insert"], "the deltas lost words"
    # Where the deltas read a word otherwise than the completed transcript, they are no further
    # from what was said (the recording's own text, as far as the completed transcript reaches).
    truth = normalize(next(c.transcript for c in clips() if c.file == "sonnet1_longform.wav"))
    truth = truth[: len(normalize(transcript))]
    deltas_wer, completed_wer = word_error_rate(normalize(deltas), truth), word_error_rate(normalize(transcript), truth)
    print(f"WER against the recording's text: deltas {deltas_wer:.3f}, completed transcript {completed_wer:.3f}")
    assert deltas_wer <= completed_wer + 0.05
