"""Names of every tensor that crosses a Triton model boundary, defined once.

The `config.pbtxt` files in `model_repository/` must agree with these names;
`tests/infrastructure/test_model_repository.py` checks that they do. Each model may be called on
its own, so every name here is part of the interface clients see.
"""

# The public `transcribe` ensemble: clients rely on these; keep them stable.
ENSEMBLE_NAME = "transcribe"
AUDIO = "AUDIO"  # BYTES [1]: one audio file (or raw PCM, see request parameters)
TEXT = "TEXT"  # BYTES [1]: UTF-8 transcript
SEGMENTS = "SEGMENTS"  # BYTES [1]: JSON list of {"start", "end", "text"} in seconds
FORMATTED = "FORMATTED"  # BYTES [1]: the transcript in the request's response_format

# preprocessing: AUDIO -> the recording's log-mel, without its padding, and its length.
PREPROCESSING_NAME = "preprocessing"
LOG_MEL = "LOG_MEL"  # FP32 [n_mels, frames]: `audio.features.without_padding` of `features_for`
SAMPLES = "SAMPLES"  # INT64 [1]: the recording's length in 16 kHz samples (with vad_filter: its speech's)
# With vad_filter, LOG_MEL holds only the recording's speech, joined; these put times back on the recording.
SPEECH_SPANS = "SPEECH_SPANS"  # INT64 [spans, 2]: (start, end) samples of the speech LOG_MEL holds
RECORDING_SAMPLES = "RECORDING_SAMPLES"  # INT64 [1]: the whole recording's length, silences included

# whisper: LOG_MEL, SAMPLES -> what decoding decided, as numbers (`decoded_tensors`).
WHISPER_NAME = "whisper"
TOKENS = "TOKENS"  # INT32 [tokens]: every accepted window's tokens, in order
WINDOWS = "WINDOWS"  # FP64 [windows, 10]: each window's counts and statistics (`decoded_tensors.WINDOW_COLUMNS`)
ALIGNMENT = "ALIGNMENT"  # FP64 [rows, 2]: word timestamps' token times and probabilities
LANGUAGE = "LANGUAGE"  # INT32 [1]: index in `core.languages.LANGUAGE_CODES`, -1: none
LANGUAGE_PROBABILITY = "LANGUAGE_PROBABILITY"  # FP64 [1]: of the detection, NaN: none

# postprocessing: whisper's outputs, SAMPLES (and SPEECH_SPANS, RECORDING_SAMPLES) -> TEXT, SEGMENTS, FORMATTED.
POSTPROCESSING_NAME = "postprocessing"

# The streamed path (gRPC stream_infer only): `transcribe`'s inputs and outputs, a response
# with the transcript so far each time more is decoded, the last one (final flag) whole.
STREAM_ENSEMBLE_NAME = "transcribe_stream"
# whisper's code, decoupled: whisper's outputs and SAMPLES, each time more windows are settled.
WHISPER_STREAM_NAME = "whisper_stream"
