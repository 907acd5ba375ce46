"""The `whisper` model called directly, as a client may: with a log-mel the client
computed with the library (what `preprocessing` writes), answered in numbers whose
transcript the library assembles."""

from __future__ import annotations

import functools

import numpy as np

from clients.api import DECODED_OUTPUTS, LogMel
from python_backend_lib.audio.features import features_for, without_padding
from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.contract import tensor_names
from python_backend_lib.contract.decoded_tensors import DecodedTensors, from_tensors
from python_backend_lib.text.tokenizer import load_tokenizer
from python_backend_lib.text.transcript import assemble


def library_log_mel(waveform: np.ndarray, n_mels: int = 80) -> LogMel:
    """A 16 kHz waveform's LOG_MEL and SAMPLES, as `preprocessing` writes them."""
    features = without_padding(features_for(waveform, n_mels), len(waveform))
    return LogMel(np.ascontiguousarray(features.numpy()), len(waveform))


def whisper_inputs(triton, log_mel: LogMel) -> list:
    """LOG_MEL and SAMPLES as inputs of `triton` (tritonclient.grpc or .http)."""
    mel = triton.InferInput(tensor_names.LOG_MEL, [1, *log_mel.log_mel.shape], "FP32")
    mel.set_data_from_numpy(log_mel.log_mel[None].astype(np.float32))
    samples = triton.InferInput(tensor_names.SAMPLES, [1, 1], "INT64")
    samples.set_data_from_numpy(np.array([[log_mel.samples]], dtype=np.int64))
    return [mel, samples]


@functools.lru_cache(maxsize=None)
def _tokenizer():
    return load_tokenizer(load_config("default"))


def decoded_text(result, samples: int) -> str:
    """The transcript of the whisper model's answer `result` (a tritonclient result)."""
    arrays = DecodedTensors(*(result.as_numpy(name)[0] for name in DECODED_OUTPUTS))
    return assemble(from_tensors(arrays, samples), _tokenizer()).text
