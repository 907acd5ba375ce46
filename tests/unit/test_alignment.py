"""Word timestamps against openai-whisper's own alignment code, on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from alignment_checks import count_align_many, window_to_align
from reference import DATA, openai_model

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.features import window_features
from python_backend_lib.checkpoints import weights
from python_backend_lib.core import geometry
from python_backend_lib.core.options import DecodingOptions, Task, TranscribeOptions
from python_backend_lib.core.segments import Word
from python_backend_lib.text.words import merge_punctuation, shorten_words_after_pauses, split_words
from python_backend_lib.transcription.alignment import Aligner
from python_backend_lib.transcription.pipeline import Pipeline
from python_backend_lib.transcription.time_warping import dynamic_time_warping, dynamic_time_warping_many, median_filter

whisper_timing = pytest.importorskip("whisper.timing")
CLIPS = ["jfk.wav", "sense_and_sensibility_01_austen_64kb-0870.wav", "cards_005.wav"]


@pytest.fixture(scope="module")
def pipe():
    pipeline = Pipeline.load("default", device="cpu")
    yield pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def openai(pipe):
    import whisper.tokenizer

    checkpoint = weights.load_checkpoint("default")
    return openai_model(checkpoint.config, checkpoint.state_dict), whisper.tokenizer.get_tokenizer(False)


@pytest.mark.parametrize("clip", CLIPS)
def test_word_times_equal_openai_whisper(pipe, openai, clip):
    model, tokenizer = openai
    waveform = decode_audio((DATA / clip).read_bytes())
    features = window_features(waveform, pipe.n_mels)
    frames = len(waveform) // geometry.HOP_LENGTH
    result = pipe.decode([waveform], DecodingOptions())[0]
    text = [t for t in result.tokens if t < pipe.config.special.eot]

    expected = whisper_timing.find_alignment(model, tokenizer, text, features, frames)
    aligner = Aligner(pipe.model, pipe.config, pipe.tokenizer)
    starts, probabilities = aligner.token_starts(aligner.window_audio(features), text, frames, "en", Task.TRANSCRIBE)
    words = split_words(pipe.tokenizer, text)
    bounds = np.cumsum([0] + [len(tokens) for _, tokens in words])
    assert [w for w, _ in words] == [t.word for t in expected]
    np.testing.assert_allclose([starts[b] for b in bounds[:-1]], [t.start for t in expected], atol=1e-6)
    np.testing.assert_allclose([starts[b] for b in bounds[1:]], [t.end for t in expected], atol=1e-6)
    mean_probability = [np.mean(probabilities[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    np.testing.assert_allclose(mean_probability, [t.probability for t in expected], atol=1e-4)


def test_dynamic_time_warping_equals_openai():
    rng = np.random.default_rng(1)
    for shape in [(5, 40), (30, 300), (12, 12)]:
        cost = rng.standard_normal(shape)
        ours = dynamic_time_warping(cost)
        theirs = whisper_timing.dtw_cpu(cost)
        assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])


def test_time_warping_many_matrices_at_once_equals_each_alone():
    """Matrices of other shapes solved together (in groups of like shape, each padded to
    its largest) give the paths each gives alone, which equal openai-whisper's."""
    rng = np.random.default_rng(3)
    costs = [rng.standard_normal(shape) for shape in [(5, 40), (30, 300), (12, 12), (1, 7), (30, 25)]]
    for cost, (rows, cols) in zip(costs, dynamic_time_warping_many(costs)):
        theirs = whisper_timing.dtw_cpu(cost)
        assert np.array_equal(rows, theirs[0]) and np.array_equal(cols, theirs[1])


def test_median_filter_equals_openai():
    """The host's sorting network and the device's sliding median give openai-whisper's
    medians exactly, edges reflected."""
    generator = torch.Generator().manual_seed(2)
    for shape in [(6, 40, 1500), (2, 3, 9), (1, 1, 4)]:
        x = torch.randn(shape, generator=generator)
        assert torch.equal(median_filter(x, 7), whisper_timing.median_filter(x, 7))


def test_punctuation_joins_its_neighbours(pipe):
    tokens = pipe.tokenizer.encode(' He said, "go (now)."')
    words = [w for w, _ in split_words(pipe.tokenizer, tokens)]
    assert "".join(words) == ' He said, "go (now)."'
    rows = [[w, float(i), float(i + 1), 1.0, 1] for i, w in enumerate(words)]
    assert [r[0] for r in merge_punctuation(rows)] == [" He", " said,", ' "go', " (now).\""]


def test_transcript_words_lie_in_their_segments(pipe):
    options = TranscribeOptions(decoding=DecodingOptions(timestamps=True), word_timestamps=True)
    transcript = pipe.transcribe((DATA / "jfk.wav").read_bytes(), options)
    words = [w for s in transcript.segments for w in s.words]
    assert "".join(w.word for w in words).strip() == " ".join(s.text for s in transcript.segments)
    for segment in transcript.segments:
        for word in segment.words:
            assert segment.start - 0.5 <= word.start <= word.end <= segment.end + 0.5
            assert 0.0 < word.probability <= 1.0
    starts = [w.start for w in words]
    assert starts == sorted(starts)
    # The second "ask" follows a pause that ends at 8.18 s (measured from the
    # waveform's energy): its onset must land close to it.
    second_ask = [w for w in words if w.word.strip() == "ask"][1]
    assert abs(second_ask.start - 8.18) < 0.2
    # Ordinary requests carry no words and do not pay for them.
    plain = pipe.transcribe((DATA / "jfk.wav").read_bytes(), TranscribeOptions())
    assert all(s.words == () for s in plain.segments)


@pytest.mark.parametrize(
    ("search", "clip", "windows"),
    [({}, "sonnet1_longform.wav", 2), ({"beam_size": 5}, "jfk.wav", 1)],  # beams keep one of their five slots
    ids=["greedy", "beams"],
)
def test_words_align_on_the_kept_slot_as_on_the_window_encoded_again(pipe, monkeypatch, search, clip, windows):
    """Word timestamps read the window's encoder K/V where its decoding left them (the
    slot kept for the callback) and equal those of the window encoded again; every slot
    is free afterwards."""
    options = TranscribeOptions(decoding=DecodingOptions(timestamps=True, **search), word_timestamps=True)
    audio = (DATA / clip).read_bytes()
    slots = []
    aligner = pipe.aligner

    class Spying:
        def align_many(self, requests):
            slots.extend(r.audio_slot for r in requests)
            return aligner.align_many(requests)

    monkeypatch.setattr(pipe.alignments, "aligner", Spying())
    kept = pipe.transcribe(audio, options)
    assert len(slots) >= windows and all(slot is not None for slot in slots)  # no window encoded again

    submit = pipe.engine.submit
    monkeypatch.setattr(pipe.engine, "submit", lambda *args, keep_audio, **kwargs: submit(*args, **kwargs))
    slots.clear()
    encoded_again = pipe.transcribe(audio, options)
    assert slots and all(slot is None for slot in slots)

    words = [w for s in kept.segments for w in s.words]
    assert words and words == [w for s in encoded_again.segments for w in s.words]
    assert pipe.engine.batch.free_slots == pipe.engine.batch.pool.shape.n_slots


def test_a_segment_opening_after_a_pause_is_cut_to_two_median_words():
    def words(*spans):
        return [Word(f" w{i}", start, end, 0.9) for i, (start, end) in enumerate(spans)]

    # Median word 0.3 s: a pause is more than 1.2 s, a word after one at most 0.6 s long.
    first = words((10.0, 10.3), (10.3, 10.6), (10.6, 10.9))
    after_pause = words((10.9, 13.5), (13.5, 13.8))  # DTW began it in the silence
    no_pause = words((10.6, 11.5), (11.5, 11.8))  # long, but it ends 0.9 s after the last word
    result = shorten_words_after_pauses([first, after_pause], window_start=10.0)
    assert result[0] == first
    assert [(w.start, w.end) for w in result[1]] == [(12.9, 13.5), (13.5, 13.8)]
    assert shorten_words_after_pauses([first[:2], no_pause], window_start=10.0)[1] == no_pause
    # The window's start counts as speech before its first segment.
    late = words((0.0, 2.0), (2.0, 2.3), (2.3, 2.6), (2.6, 2.9))
    assert shorten_words_after_pauses([late], window_start=0.0)[0][0].start == 1.4
    assert shorten_words_after_pauses([[], []], window_start=0.0) == [[], []]


def test_windows_aligned_in_one_pass_get_the_times_each_gets_alone(pipe, monkeypatch):
    """`align_many` pads the windows' sequences into one decoder pass; each window's token
    times equal those of its own pass, and its probabilities within float32's rounding.
    Past PASS_SCORE_BYTES the windows go in several passes, with the same results."""
    from python_backend_lib.transcription import alignment

    requests = [window_to_align(pipe, DATA / clip) for clip in CLIPS]
    assert all(pipe.decode([decode_audio((DATA / clip).read_bytes())], DecodingOptions(timestamps=True))[0].tokens
               for clip in CLIPS)
    assert len({len(s.tokens) for r in requests for s in r.segments[:1]}) > 1  # sequences of other lengths
    together = pipe.aligner.align_many(requests)
    for request, (times, probabilities) in zip(requests, together):
        alone_times, alone_probabilities = pipe.aligner.align(
            request.segments, request.features, request.content_frames, request.language, request.task)
        assert times == alone_times and len(times) > 5
        np.testing.assert_allclose(probabilities, alone_probabilities, atol=1e-5)
    # On a GPU every pass takes one of a few fixed shapes, so that a window's pass is
    # the same alone and in company; padded so here, the windows get the same times.
    shapes = []
    with monkeypatch.context() as patched:
        patched.setattr(alignment, "fixed_pass_shapes", lambda device: True)
        patched.setattr(alignment.Aligner, "_token_starts",
                        lambda self, a_pass, mine, audio=None, shipped=alignment.Aligner._token_starts:
                        shapes.append((a_pass.count, a_pass.length)) or shipped(self, a_pass, mine, audio))
        fixed = pipe.aligner.align_many(requests)
        assert pipe.aligner.align_many(requests[:1])[0] == fixed[0]
    assert [a[0] for a in fixed] == [t[0] for t in together]
    assert shapes == [(alignment.PASS_ROWS, alignment.PASS_LENGTHS[0])] * 2  # three windows, then one
    passes = []
    monkeypatch.setattr(alignment, "PASS_SCORE_BYTES", 1)  # a window a pass
    monkeypatch.setattr(alignment.Aligner, "windows_audio",
                        lambda self, mine, shipped=alignment.Aligner.windows_audio: passes.append(len(mine))
                        or shipped(self, mine))
    apart = pipe.aligner.align_many(requests)
    assert passes == [1, 1, 1] and [a[0] for a in apart] == [t[0] for t in together]


def test_the_windows_one_step_delivers_are_aligned_in_one_round(pipe, monkeypatch):
    """Recordings sent together with word timestamps: the windows each engine step
    delivers are aligned in one `align_many` call, fewer calls than windows, and every
    recording gets the words it gets alone."""
    options = TranscribeOptions(decoding=DecodingOptions(timestamps=True), word_timestamps=True)
    audio = [(DATA / clip).read_bytes() for clip in ["jfk.wav", "jfk.wav", "cards_005.wav", "jfk.wav"]]
    alone = [pipe.transcribe(a, options) for a in audio]
    calls = count_align_many(monkeypatch, pipe)
    together = pipe.transcribe_many(audio, options)
    assert sum(calls) == len(audio) and len(calls) < len(audio) and max(calls) > 1
    for a, b in zip(alone, together):
        assert [(w.word, w.start, w.end) for s in a.segments for w in s.words] == [
            (w.word, w.start, w.end) for s in b.segments for w in s.words]


def test_a_failed_capture_leaves_the_eager_passes(pipe, monkeypatch, caplog):
    """Capturing the alignment's passes (on a GPU, at load) may fail, out of device
    memory say: the words then come from the eager passes, and the log says why."""
    from python_backend_lib.transcription import alignment_graphs

    def out_of_memory(self):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(alignment_graphs.AlignmentGraphs, "capture", out_of_memory)
    with caplog.at_level("WARNING", logger=alignment_graphs.__name__):
        assert alignment_graphs.captured_passes(pipe.model, pipe.config, pipe.engine.batch.pool) is None
    assert "capturing their passes failed: CUDA out of memory" in caplog.text
