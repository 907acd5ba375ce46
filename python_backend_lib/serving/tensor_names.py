"""Names of every tensor that crosses a Triton model boundary, defined once.

The `config.pbtxt` files in `model_repository/` must agree with these names;
`tests/test_model_repository.py` checks that they do.
"""

# The public `transcribe` ensemble: clients rely on these; keep them stable.
ENSEMBLE_NAME = "transcribe"
AUDIO = "AUDIO"  # BYTES [1]: one audio file (or raw PCM, see request parameters)
TEXT = "TEXT"  # BYTES [1]: UTF-8 transcript
SEGMENTS = "SEGMENTS"  # BYTES [1]: JSON list of {"start", "end", "text"} in seconds
FORMATTED = "FORMATTED"  # BYTES [1]: the transcript in the request's response_format

# preprocessing -> whisper
PREPROCESSING_NAME = "preprocessing"
LOG_MEL = "LOG_MEL"  # FP32 [n_mels, 3000]: the 30 s window's log-mel spectrogram
AUDIO_SECONDS = "AUDIO_SECONDS"  # FP32 [1]: duration of the decoded audio

# whisper -> postprocessing
WHISPER_NAME = "whisper"
TRANSCRIPT = "TRANSCRIPT"  # BYTES [1]: the finished transcript as verbose_json (formats.Document)

POSTPROCESSING_NAME = "postprocessing"
