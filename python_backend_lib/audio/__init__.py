"""Audio in: bytes or raw PCM to a 16 kHz mono waveform (`decode`, no torch), and the
waveform to Whisper's log-mel spectrogram (`features`, torch)."""
