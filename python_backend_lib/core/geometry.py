"""Whisper's fixed audio and time geometry, shared by every layer (no torch).

Each value is derived from the ones before it, so none is a bare number
anywhere else: 3,000 frames, 1,500 encoder positions, 0.02 s per timestamp.
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
