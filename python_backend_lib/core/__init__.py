"""Facts and types every layer shares, with no torch: Whisper's audio and time
geometry, decoding options and results, segments and languages."""
