"""Checkpoint loading: the packaged CTranslate2 file, its conversion, and random models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import DATA, hf_model

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.features import window_features
from python_backend_lib.checkpoints import (
    configs,
    ctranslate2_conversion,
    ctranslate2_folder,
    hf_folder,
    random_shapes,
    weights,
)
from python_backend_lib.checkpoints.packaged import packaged_model_directory
from python_backend_lib.core import geometry
from python_backend_lib.core.cache import CACHE_ENV, cache_root
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.model_facts import SpecialTokens
from python_backend_lib.engine.attention import SdpaAttention
from python_backend_lib.engine.kv_cache import KVSlotPool, PoolShape
from python_backend_lib.engine.model import Whisper

PACKAGED = packaged_model_directory()


@pytest.fixture(scope="module")
def variables():
    return ctranslate2_conversion.read_ctranslate2(PACKAGED / "model.bin")


def test_packaged_file_facts(variables):
    assert variables["decoder/embeddings/weight"].shape == (51864, 384)
    tensors = {k: v for k, v in variables.items() if v.dim() >= 1}
    assert all(v.dtype == torch.float16 for v in tensors.values())
    # q/k/v fused by rows; the key bias is stored as zeros.
    assert variables["decoder/layer_0/self_attention/linear_0/weight"].shape == (3 * 384, 384)
    assert not variables["encoder/layer_0/self_attention/linear_0/bias"][384:768].any()
    # The output projection is an alias of the token embedding.
    assert variables["decoder/projection/weight"] is variables["decoder/embeddings/weight"]


def test_special_tokens_agree_with_tokenizer_json():
    config = configs.load_config("default")
    special = config.special
    vocab = {t["content"]: t["id"] for t in json.loads((PACKAGED / "tokenizer.json").read_text())["added_tokens"]}
    assert vocab["<|endoftext|>"] == special.eot == 50256
    assert vocab["<|startoftranscript|>"] == special.sot
    assert vocab["<|translate|>"] == special.translate
    assert vocab["<|transcribe|>"] == special.transcribe
    assert vocab["<|startofprev|>"] == special.startofprev
    assert vocab["<|nocaptions|>"] == special.nospeech
    assert vocab["<|notimestamps|>"] == special.no_timestamps == 50362
    # tokenizer.json stops before the timestamps: <|0.00|> is 50363, <|30.00|> the last id.
    assert max(vocab.values()) == 50362
    assert special.timestamp_begin == 50363 and config.dims.n_vocab - 1 == 50363 + 1500
    assert config.alignment_heads[:2] == ((1, 0), (2, 0))
    assert not config.multilingual


@pytest.mark.parametrize(
    "n_vocab, eot, timestamp_begin, translate, languages",
    [(51865, 50257, 50364, 50358, 99), (51866, 50257, 50365, 50359, 100)],
)
def test_multilingual_token_layouts(n_vocab, eot, timestamp_begin, translate, languages):
    special = SpecialTokens.for_vocab(n_vocab, multilingual=True)
    assert (special.eot, special.timestamp_begin, special.translate) == (eot, timestamp_begin, translate)
    assert len(special.language_codes) == languages
    assert special.language_token("en") == 50259 and special.language_token("de") == 50261
    assert special.language_codes[-1] == ("yue" if languages == 100 else "su")
    with pytest.raises(RequestError, match="unknown language code 'xx'"):  # a request's language
        special.language_token("xx")


def test_the_folders_configuration_without_torch_equals_the_converted_ones():
    """The index of model.bin and config.json give what the converted folder says."""
    read = configs.load_config("default")
    converted = weights.load_checkpoint("default").config
    assert read.directory == PACKAGED and converted.directory == weights.hf_directory("default")
    assert dataclasses.replace(read, directory=converted.directory) == converted
    index = ctranslate2_folder.read_index(PACKAGED / "model.bin")
    assert index.integer("encoder/num_heads") == 6 and index.variables["decoder/projection/weight"] is (
        index.variables["decoder/embeddings/weight"]
    )


def test_conversion_is_cached_and_loads_in_transformers():
    first = ctranslate2_conversion.convert_ctranslate2(PACKAGED)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ctranslate2_conversion.convert_ctranslate2(PACKAGED) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    ours = weights.load_checkpoint("default").state_dict
    theirs = hf_model(first).state_dict()
    for name, tensor in ours.items():
        assert torch.equal(theirs[f"model.{name}"], tensor), name
    assert torch.equal(theirs["proj_out.weight"], ours["decoder.embed_tokens.weight"])


def test_the_cache_root_is_the_variable_unless_it_is_empty(tmp_path):
    default = Path.home() / ".cache" / "whisper-triton"
    assert cache_root({}) == default
    assert cache_root({CACHE_ENV: ""}) == default  # empty is unset, not the working folder
    assert cache_root({CACHE_ENV: str(tmp_path)}) == tmp_path


def test_conversions_are_cached_under_the_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    converted = ctranslate2_conversion.convert_ctranslate2(PACKAGED)
    assert converted.parent == tmp_path / "checkpoints" and (converted / "model.safetensors").is_file()


def test_encoder_matches_ctranslate2():
    """ctranslate2 reads model.bin itself: an independent check of our conversion."""
    import ctranslate2

    features = window_features(decode_audio((DATA / "jfk.wav").read_bytes()), 80)
    reference = ctranslate2.models.Whisper(str(PACKAGED), device="cpu", compute_type="float32")
    expected = np.array(reference.encode(ctranslate2.StorageView.from_array(features[None].numpy())))
    checkpoint = weights.load_checkpoint("default")
    model = Whisper.from_checkpoint(checkpoint, device=torch.device("cpu"), dtype=torch.float32)
    pool = KVSlotPool(PoolShape.for_model(checkpoint.config.dims, 1), device=torch.device("cpu"), dtype=torch.float32)
    with torch.inference_mode():
        ours = model.encode(features[None], SdpaAttention(pool)).numpy()
    np.testing.assert_allclose(ours, expected, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("size", sorted(random_shapes.RANDOM_SIZES))
def test_random_configs_have_real_shapes(size):
    shapes = random_shapes.RANDOM_SIZES[size]
    dims = configs.load_config(f"random:{size}").dims
    assert (dims.n_audio_state, dims.n_text_head, dims.n_audio_layer, dims.n_text_layer) == (
        shapes.width, shapes.heads, shapes.encoder_layers, shapes.decoder_layers,
    )
    assert (dims.n_mels, dims.n_vocab, dims.head_dim, dims.n_audio_ctx) == (
        shapes.n_mels, shapes.n_vocab, 64, geometry.N_AUDIO_CTX,
    )


def test_random_weights_are_seeded():
    a = weights.load_checkpoint("random:tiny:1").state_dict
    b = weights.load_checkpoint("random:tiny:1").state_dict
    c = weights.load_checkpoint("random:tiny:2").state_dict
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["decoder.layers.0.fc1.weight"], c["decoder.layers.0.fc1.weight"])


def test_hf_checkpoint_round_trip(tmp_path):
    checkpoint = weights.load_checkpoint("random:tiny:4")
    hf_folder.write_hf_folder(checkpoint.config, checkpoint.state_dict, tmp_path)
    loaded = weights.load_checkpoint(str(tmp_path))
    assert loaded.config.dims == checkpoint.config.dims
    assert loaded.config.special == checkpoint.config.special
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in checkpoint.state_dict.items())


@pytest.mark.parametrize(
    "source, message",
    [("random:huge", "unknown random model size"), ("random:tiny:x", "seed"), ("/no/such/folder", "neither")],
)
def test_bad_sources_name_the_problem(source, message):
    with pytest.raises(ValueError, match=message):
        configs.load_config(source)
