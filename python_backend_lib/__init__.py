"""Whisper speech recognition for NVIDIA Triton: the library behind the model repository.

Modules, in the order data flows through them:
audio (bytes -> 16 kHz waveform -> log-mel), weights (checkpoints -> tensors),
model (encoder and decoder), attention (SDPA / FlashInfer backends), kv_cache,
decoding (Whisper's greedy rules), engine (continuous batching), tokenizer
(tokens -> text and segments), formats (text, json, srt, vtt).
"""

__version__ = "0.1.0"
