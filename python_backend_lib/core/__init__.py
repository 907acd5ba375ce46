"""Facts and types every layer shares, with no torch: Whisper's audio and time
geometry, a checkpoint's dimensions and control tokens (`model_facts`), the
language table, the cache folder, decoding options and results, segments, and
`RequestError`, the one base of the client's mistakes."""
