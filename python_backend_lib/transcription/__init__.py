"""Recordings through the engine: long audio window by window with Whisper's quality
controls (`longform`), word timestamps (`alignment`), and `pipeline.Pipeline`, the
library's front door."""
