"""Whisper's fixed audio and time geometry, shared by every layer (no torch).

Each value is derived from the ones before it, so none is a bare number
anywhere else: 3,000 frames, 1,500 encoder positions, 0.02 s per timestamp.
The functions at the end count a recording's mel frames from its samples.
"""

SAMPLE_RATE = 16000  # Hz; every checkpoint was trained at this rate
N_FFT = 400  # samples per STFT window: 25 ms
HOP_LENGTH = 160  # samples between STFT frames: 10 ms
CHUNK_SECONDS = 30  # the encoder sees exactly this much audio at a time
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480,000 samples in one window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3,000 mel frames in one window
N_FREQ_BINS = N_FFT // 2 + 1  # 201 rows of a one-sided spectrum
ENCODER_STRIDE = 2  # the encoder's second conv halves the frame rate
N_AUDIO_CTX = N_FRAMES // ENCODER_STRIDE  # 1,500 encoder positions per window

FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100 mel frames per second
SECONDS_PER_FRAME = HOP_LENGTH / SAMPLE_RATE  # 0.01 s
SAMPLES_PER_POSITION = HOP_LENGTH * ENCODER_STRIDE  # 320 samples per encoder position
# 0.02 s: one encoder position, which is also the step between timestamp tokens.
SECONDS_PER_POSITION = SAMPLES_PER_POSITION / SAMPLE_RATE


def content_frames(samples: int) -> int:
    """Mel frames that hold audio, of a recording of `samples` samples."""
    return samples // HOP_LENGTH


def padded_frames(samples: int) -> int:
    """Frames of `audio.features.features_for` of a recording of `samples` samples: one 30 s window
    up to 30 s, else the recording's frames followed by a window of padding."""
    return N_FRAMES if samples <= N_SAMPLES else samples // HOP_LENGTH + N_FRAMES


def reached_frames(samples: int) -> int:
    """The frames of `audio.features.features_for` that features travel with between processes: those
    whose STFT window reaches the recording, and the first one after them.

    That one's window holds only the zeros of the padding, so each of its bins is the
    log-mel's floor, and so is every frame after it: a receiver rebuilds them by
    repeating it (`transcription.longform` does, window by window), without a 30 s window of
    padding travelling with every short clip.
    """
    last_reached = -(-(samples + N_FFT // 2) // HOP_LENGTH) - 1  # the window starts N_FFT // 2 before its frame
    return min(padded_frames(samples), last_reached + 2)
