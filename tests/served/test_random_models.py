"""Our model against transformers loaded with the same seeded weights.

Random checkpoints have the real shapes (width, heads, vocabulary, mel bins);
comparing logits shows that the two implementations compute the same function,
for sizes the packaged tiny.en does not cover: a multilingual 80-bin model and
the 128-bin large-v3 layout. large-v3 keeps 4 of its 32 layers on each side:
every layer computes as the others do, and the whole model made this one test
take minutes and 13 GB on the CI machine.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from reference import hf_model_from_state

from python_backend_lib.checkpoints import random_shapes, random_weights
from python_backend_lib.checkpoints.weights import Checkpoint, load_checkpoint
from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.engine.attention import SdpaAttention, StepLayout
from python_backend_lib.engine.kv_cache import KVSlotPool, PoolShape
from python_backend_lib.engine.model import Whisper

CPU = torch.device("cpu")
# float32 on both sides; differences come only from summation order.
LOGIT_ATOL = 2e-3
LOGIT_RTOL = 1e-3


def _prefix(special) -> list[int]:
    return [special.sot, special.language_token("en"), special.transcribe, special.no_timestamps]


def _our_logits(checkpoint, features: torch.Tensor, tokens: list[int], *, incremental: bool) -> torch.Tensor:
    """Logits at every position of `tokens`: [len(tokens), vocab]."""
    model = Whisper.from_checkpoint(checkpoint, device=CPU, dtype=torch.float32)
    pool = KVSlotPool(PoolShape.for_model(checkpoint.config.dims, 1), device=CPU, dtype=torch.float32)
    attention = SdpaAttention(pool)
    slot = torch.tensor([pool.allocate()])
    with torch.inference_mode():
        pool.write_cross(slot, model.cross_kv(model.encode(features[None], attention)))
        ids = torch.tensor(tokens)
        if not incremental:
            layout = StepLayout(slot, (len(tokens),), (0,))
            return model.decode_step(ids, layout, attention, torch.arange(len(tokens)))
        rows = []
        for i in range(len(tokens)):
            layout = StepLayout(slot, (1,), (i,))
            rows.append(model.decode_step(ids[i : i + 1], layout, attention, torch.tensor([0])))
        return torch.cat(rows)


def _with_layers(source: str, layers: int) -> Checkpoint:
    """The random checkpoint `source` with `layers` encoder and decoder layers."""
    parsed = random_shapes.parse_random_source(source)
    config = random_shapes.random_config(parsed.size, source)
    dims = dataclasses.replace(config.dims, n_audio_layer=layers, n_text_layer=layers)
    heads = tuple((layers - 1, h) for h in range(dims.n_text_head))  # the last decoder layer's, as random_config picks
    config = dataclasses.replace(config, dims=dims, alignment_heads=heads)
    return Checkpoint(config, random_weights.random_state_dict(dims, parsed.seed))


@pytest.mark.slow
@pytest.mark.parametrize("source, layers", [("random:base:7", None), ("random:large-v3:3", 4)])
def test_logits_match_transformers(source: str, layers: int | None) -> None:
    checkpoint = load_checkpoint(source) if layers is None else _with_layers(source, layers)
    assert checkpoint.config.dims.n_mels == (128 if "large-v3" in source else 80)
    config = checkpoint.config
    generator = torch.Generator().manual_seed(11)
    features = torch.randn(config.dims.n_mels, N_FRAMES, generator=generator).clamp(-1.5, 1.5)
    text = torch.randint(0, config.special.eot, (12,), generator=generator).tolist()
    tokens = _prefix(config.special) + text

    with torch.inference_mode():
        hf = hf_model_from_state(config, checkpoint.state_dict)
        expected = hf(input_features=features[None], decoder_input_ids=torch.tensor([tokens])).logits[0]
        del hf
    assert expected.std() > 0.1, "degenerate random model: logits carry no signal"

    prefilled = _our_logits(checkpoint, features, tokens, incremental=False)
    torch.testing.assert_close(prefilled, expected, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
    # The KV cache path, one token at a time, computes the same logits.
    stepped = _our_logits(checkpoint, features, tokens, incremental=True)
    torch.testing.assert_close(stepped, expected, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
    assert torch.equal(stepped.argmax(-1), expected.argmax(-1))


@pytest.mark.server
@pytest.mark.slow
def test_serve_takes_a_random_checkpoint_by_name(tmp_path):
    """`whisper-triton serve --checkpoint random:<size>`, as the README offers it: every
    model loads (the launcher writes the servable folder once, with a tokenizer) and a
    request gets a transcript, meaningless text of the random model's tokens."""
    from conftest import AUDIO_DIR, launch_server
    from test_faults import transcribe

    from python_backend_lib.checkpoints.served_random import FOLDER

    cache = tmp_path / "cache"
    environ, arguments = {"WHISPER_TRITON_CACHE": str(cache)}, ("--checkpoint", "random:tiny:3")
    with launch_server(tmp_path, environ, arguments, streamed_path=False) as launched:
        text = transcribe(launched.server.grpc_url, "grpc", (AUDIO_DIR / "cards_001.wav").read_bytes(),
                          max_new_tokens=5, min_new_tokens=5)
    assert isinstance(text, str) and text.count("<") == 5, text  # five tokens, each spelled "<i>"
    assert (cache / FOLDER / "random-tiny-3" / "tokenizer.json").exists()
    assert "writing random:tiny:3 as a servable folder" in launched.server.log.read_text()
