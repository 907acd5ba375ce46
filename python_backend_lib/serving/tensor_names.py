"""Names of every tensor that crosses a Triton model boundary, defined once.

The `config.pbtxt` files in `model_repository/` must agree with these names;
`tests/test_model_repository.py` checks that they do.
"""

# The public `transcribe` ensemble: clients rely on these; keep them stable. The
# `whisper` model answers with the same three outputs.
ENSEMBLE_NAME = "transcribe"
AUDIO = "AUDIO"  # BYTES [1]: one audio file (or raw PCM, see request parameters)
TEXT = "TEXT"  # BYTES [1]: UTF-8 transcript
SEGMENTS = "SEGMENTS"  # BYTES [1]: JSON list of {"start", "end", "text"} in seconds
FORMATTED = "FORMATTED"  # BYTES [1]: the transcript in the request's response_format

# preprocessing -> whisper: only the samples that hold audio (no padding), and the
# log-mel is computed by the whisper model on its own device.
PREPROCESSING_NAME = "preprocessing"
WAVEFORM = "WAVEFORM"  # FP32 [samples]: the decoded audio, 16 kHz mono

# whisper: WAVEFORM -> TEXT, SEGMENTS, FORMATTED
WHISPER_NAME = "whisper"
