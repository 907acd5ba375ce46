"""The decoding engine: Whisper's encoder and decoder, attention backends (SDPA and
FlashInfer), the static KV slot pool, CUDA graphs of decode steps, Whisper's decoding
rules, and the continuous-batching thread that owns them (`scheduler.Engine`)."""
