"""Whisper speech recognition for NVIDIA Triton: the library behind the model repository.

The subpackages are layers; each imports only from the layers listed before it
(checked in CI by import-linter, see pyproject.toml and docs/engine.md):

- `core`: facts and types every layer shares, with no torch: Whisper's audio and
  time geometry, a checkpoint's dimensions and tokens, languages, the cache folder,
  options and results, segments, `RequestError`.
- `audio`: bytes to a 16 kHz waveform (`decode`), waveform to log-mel (`features`).
- `checkpoints`: checkpoint sources to a config and a state dict, one module per format
  (`audio` and `checkpoints` are one layer, neither importing the other).
- `text`: tokens to text and segments (`tokenizer`), transcripts to response formats (`formats`).
- `engine`: the model, its attention backends, the KV slot pool, CUDA graphs,
  decoding rules and the continuous-batching engine thread.
- `transcription`: audio of any length through the engine (long-form windows,
  word timestamps) and `Pipeline`, the library's front door.
- `serving`: what the Triton model adapters in `model_repository/` share: settings,
  request parameters, input checks, error responses, admission, metrics, tensor names.
- `apps`: the programs: the Triton launcher, the OpenAI-compatible gateway, the CLI.
"""

__version__ = "0.1.0"
