"""Audio decoding and Whisper log-mel features, checked against soundfile and transformers."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from python_backend_lib.audio.decode import AudioError, decode_audio, pcm_to_waveform, resample, to_mono
from python_backend_lib.audio.features import (
    SUPPORTED_N_MELS,
    log_mel_spectrogram,
    mel_filters,
    pad_or_trim,
    window_features,
)
from python_backend_lib.core import geometry
from python_backend_lib.core.geometry import HOP_LENGTH, N_FRAMES, N_SAMPLES, SAMPLE_RATE

AUDIO_DIR = Path(__file__).resolve().parents[1] / "data" / "audio"
CLIPS = sorted(p.name for p in AUDIO_DIR.glob("*.wav"))
FEATURE_ATOL = 1e-4
# Lossy codecs at their default bitrates keep speech at least this far above the error.
LOSSY_MIN_SNR_DB = 15.0


def encode(samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def sine(freq_hz: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * freq_hz * t)).astype(np.float32)


def peak_hz(waveform: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(waveform * np.hanning(len(waveform))))
    return float(np.fft.rfftfreq(len(waveform), 1 / rate)[np.argmax(spectrum)])


def snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference**2) / np.sum((reference - other) ** 2)))


@pytest.fixture(scope="module")
def extractors():
    transformers = pytest.importorskip("transformers")
    return {n: transformers.WhisperFeatureExtractor(feature_size=n) for n in SUPPORTED_N_MELS}


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    samples, rate = soundfile.read(AUDIO_DIR / "jfk.wav", dtype="float32")
    assert rate == SAMPLE_RATE
    return samples


# --- Constants ---------------------------------------------------------------


def test_constants_are_whispers():
    assert (geometry.N_FFT, HOP_LENGTH, geometry.CHUNK_SECONDS) == (400, 160, 30)
    assert (N_SAMPLES, N_FRAMES, geometry.N_AUDIO_CTX) == (480_000, 3_000, 1_500)
    assert geometry.SECONDS_PER_FRAME == pytest.approx(0.01)
    assert geometry.SECONDS_PER_POSITION == pytest.approx(0.02)


# --- Features against transformers --------------------------------------------


@pytest.mark.parametrize("n_mels", SUPPORTED_N_MELS)
@pytest.mark.parametrize("clip", CLIPS)
def test_window_features_match_whisper_feature_extractor(extractors, clip, n_mels):
    samples, rate = soundfile.read(AUDIO_DIR / clip, dtype="float32")
    assert rate == SAMPLE_RATE
    # The extractor pads short clips to 30 s and cuts long ones (sonnet1_longform is 53 s).
    expected = extractors[n_mels](samples, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    features = window_features(samples, n_mels)
    assert features.shape == (n_mels, N_FRAMES)
    assert features.dtype == torch.float32
    np.testing.assert_allclose(features.numpy(), expected, rtol=0, atol=FEATURE_ATOL)


@pytest.mark.parametrize("n_mels", SUPPORTED_N_MELS)
def test_mel_filters_match_transformers(n_mels):
    audio_utils = pytest.importorskip("transformers.audio_utils")
    expected = audio_utils.mel_filter_bank(
        num_frequency_bins=geometry.N_FREQ_BINS,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=SAMPLE_RATE,
        norm="slaney",
        mel_scale="slaney",
    ).T
    filters = mel_filters(n_mels)
    assert filters.shape == (n_mels, geometry.N_FREQ_BINS) and filters.dtype == torch.float32
    np.testing.assert_allclose(filters.numpy(), expected, rtol=1e-6, atol=1e-9)
    assert mel_filters(n_mels, "cpu") is filters  # cached per (n_mels, device)


def test_mel_filters_reject_unknown_sizes():
    with pytest.raises(ValueError, match="n_mels"):
        mel_filters(64)


def test_padding_argument_equals_the_30_s_window(speech):
    padded = log_mel_spectrogram(speech, 80, padding=N_SAMPLES - len(speech))
    torch.testing.assert_close(padded, window_features(speech, 80), rtol=0, atol=0)


def test_frames_follow_length_and_padding(speech):
    assert log_mel_spectrogram(speech, 80).shape == (80, len(speech) // HOP_LENGTH)
    assert log_mel_spectrogram(speech, 128, padding=1000).shape == (128, (len(speech) + 1000) // HOP_LENGTH)
    with pytest.raises(ValueError, match="padding"):
        log_mel_spectrogram(speech, 80, padding=-1)
    with pytest.raises(ValueError, match="samples"):
        log_mel_spectrogram(speech[:100], 80)


def test_batch_equals_items_and_inputs_may_be_tensors(speech):
    short = speech[: 3 * SAMPLE_RATE]
    batch = np.stack([pad_or_trim(speech), pad_or_trim(short)])  # [2, N_SAMPLES]
    features = window_features(torch.from_numpy(batch), 80)
    assert features.shape == (2, 80, N_FRAMES)
    # Each item keeps its own dynamic-range floor.
    torch.testing.assert_close(features[0], window_features(speech, 80), rtol=0, atol=0)
    torch.testing.assert_close(features[1], window_features(short, 80), rtol=0, atol=0)


def test_output_dtype_is_an_argument_and_float64_input_is_rounded_like_the_extractor(speech):
    reference = window_features(speech, 80)
    half = window_features(speech.astype(np.float64), 80, "cpu", dtype=torch.float16)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), reference, rtol=0, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n_mels", SUPPORTED_N_MELS)
def test_gpu_features_match_the_extractor(extractors, speech, n_mels):
    expected = extractors[n_mels](speech, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    features = window_features(torch.from_numpy(speech).cuda(), n_mels)
    assert features.device.type == "cuda"
    np.testing.assert_allclose(features.cpu().numpy(), expected, rtol=0, atol=FEATURE_ATOL)
    bf16 = window_features(speech, n_mels, "cuda", dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.device.type == "cuda"


def test_all_zero_audio_is_valid_and_finite():
    silence = decode_audio(encode(np.zeros(SAMPLE_RATE, np.int16), SAMPLE_RATE, subtype="PCM_16"))
    assert np.array_equal(silence, np.zeros(SAMPLE_RATE, np.float32))
    features = window_features(silence, 80)
    assert torch.isfinite(features).all()
    # log10 of the 1e-10 floor, normalised: (-10 + 4) / 4.
    assert torch.all(features == -1.5)


def test_concurrent_callers_get_the_same_features(speech):
    expected = window_features(speech, 128)
    results = [None] * 4

    def work(i):
        results[i] = window_features(speech, 128)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        torch.testing.assert_close(result, expected, rtol=0, atol=0)


# --- Decoding -------------------------------------------------------------------


def test_wav_bytes_decode_to_soundfiles_samples():
    data = (AUDIO_DIR / "jfk.wav").read_bytes()
    expected, _ = soundfile.read(io.BytesIO(data), dtype="float32")
    waveform = decode_audio(data)
    assert waveform.dtype == np.float32 and waveform.ndim == 1
    np.testing.assert_array_equal(waveform, expected)
    assert decode_audio(bytearray(data)).shape == expected.shape
    assert decode_audio(memoryview(data)).shape == expected.shape


def test_wav_bytes_decode_back_to_their_samples_to_16_bit_rounding(speech):
    from python_backend_lib.audio.encode import wav_bytes

    decoded = decode_audio(wav_bytes(speech))
    assert decoded.shape == speech.shape
    assert np.abs(decoded - speech).max() <= 1 / 32767


def test_flac_round_trip_is_lossless(speech):
    np.testing.assert_array_equal(decode_audio(encode(speech, SAMPLE_RATE, "FLAC", "PCM_16")), speech)


@pytest.mark.parametrize(
    ("fmt", "subtype"),
    [("OGG", "VORBIS"), ("OGG", "OPUS"), ("MP3", "MPEG_LAYER_III")],
)
def test_lossy_round_trips_keep_the_speech(speech, fmt, subtype):
    if subtype not in soundfile.available_subtypes(fmt):
        pytest.skip(f"this libsndfile cannot write {fmt}/{subtype}")
    clip = speech[: 3 * SAMPLE_RATE]
    waveform = decode_audio(encode(clip, SAMPLE_RATE, fmt, subtype))
    assert waveform.shape == clip.shape
    assert snr_db(clip, waveform) > LOSSY_MIN_SNR_DB


@pytest.mark.parametrize(("subtype", "atol"), [("PCM_24", 2**-23), ("FLOAT", 0.0), ("DOUBLE", 1e-7)])
def test_24_bit_and_float_wavs(subtype, atol):
    tone = sine(440, SAMPLE_RATE, 0.5, amplitude=0.9)
    waveform = decode_audio(encode(tone, SAMPLE_RATE, "WAV", subtype))
    np.testing.assert_allclose(waveform, tone, rtol=0, atol=atol)


def test_stereo_is_averaged():
    left, right = sine(440, SAMPLE_RATE, 0.5), sine(1000, SAMPLE_RATE, 0.5, amplitude=0.25)
    stereo = np.stack([left, right], axis=1)  # [frames, 2]
    waveform = decode_audio(encode(stereo, SAMPLE_RATE, "WAV", "FLOAT"))
    np.testing.assert_allclose(waveform, (left + right) / 2, rtol=0, atol=1e-7)
    np.testing.assert_allclose(to_mono(stereo), (left + right) / 2, rtol=0, atol=1e-7)
    assert to_mono(stereo[:, :1]).shape == (len(left),)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_other_rates_are_resampled_to_16_khz_and_keep_pitch(rate):
    seconds = 2.0
    waveform = decode_audio(encode(sine(440, rate, seconds), rate, "WAV", "PCM_16"))
    assert abs(len(waveform) - seconds * SAMPLE_RATE) <= 1
    assert peak_hz(waveform, SAMPLE_RATE) == pytest.approx(440, abs=1 / seconds)
    # The sine keeps its amplitude: nothing lost to the resampler's passband.
    steady = waveform[SAMPLE_RATE // 4 : -SAMPLE_RATE // 4]
    assert np.abs(steady).max() == pytest.approx(0.5, abs=0.01)


def test_resample_is_identity_at_16_khz():
    tone = sine(440, SAMPLE_RATE, 0.1)
    assert resample(tone, SAMPLE_RATE) is tone


def test_raw_pcm_mono_and_interleaved_stereo():
    tone = sine(440, SAMPLE_RATE, 0.5)
    waveform = pcm_to_waveform(tone.astype("<f4").tobytes(), SAMPLE_RATE)
    np.testing.assert_array_equal(waveform, tone)
    assert waveform.flags.writeable

    stereo = np.stack([tone, np.zeros_like(tone)], axis=1)  # interleaved L R L R ...
    mixed = pcm_to_waveform(stereo.astype("<f4").tobytes(), SAMPLE_RATE, channels=2)
    np.testing.assert_allclose(mixed, tone / 2, rtol=0, atol=1e-8)

    low = pcm_to_waveform(sine(440, 8000, 1.0).tobytes(), 8000)
    assert len(low) == SAMPLE_RATE and peak_hz(low, SAMPLE_RATE) == pytest.approx(440, abs=1)


def test_pad_or_trim_numpy_and_torch():
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    np.testing.assert_array_equal(pad_or_trim(x, 3), x[:, :3])
    np.testing.assert_array_equal(pad_or_trim(x, 7), np.concatenate([x, np.zeros((2, 2), np.float32)], axis=1))
    t = torch.from_numpy(x)
    assert pad_or_trim(t, 7).shape == (2, 7) and isinstance(pad_or_trim(t, 7), torch.Tensor)
    assert torch.equal(pad_or_trim(t, 3), t[:, :3])
    assert pad_or_trim(x, 5) is x


# --- Errors ---------------------------------------------------------------------


def _wav(samples, rate=SAMPLE_RATE, subtype="FLOAT") -> bytes:
    return encode(np.asarray(samples, np.float32), rate, "WAV", subtype)


def _truncated(fmt: str, subtype: str | None, keep: float) -> bytes:
    data = encode(sine(440, SAMPLE_RATE, 1.0), SAMPLE_RATE, fmt, subtype)
    return data[: int(len(data) * keep)]


ERROR_CASES = {
    "empty file": (lambda: decode_audio(b""), "audio is empty"),
    "text": (lambda: decode_audio(b"this is not audio at all" * 4), "not a decodable audio file"),
    "wav header only": (lambda: decode_audio(_wav(np.ones(100))[:30]), "not a decodable audio file"),
    "half a flac": (lambda: decode_audio(_truncated("FLAC", None, 0.5)), "damaged or truncated"),
    "half an ogg": (lambda: decode_audio(_truncated("OGG", "VORBIS", 0.5)), "not a decodable audio file"),
    "nan": (lambda: decode_audio(_wav([0.1, np.nan] * 100)), "audio contains NaN or infinite samples"),
    "inf": (lambda: decode_audio(_wav([0.1, np.inf] * 100)), "audio contains NaN or infinite samples"),
    "no frames": (lambda: decode_audio(_wav(np.zeros((0, 1)))), "audio decodes to zero samples"),
    "rate too low": (lambda: decode_audio(_wav(np.zeros(100), rate=500)), "sample rate 500 Hz is outside 1000..384000 Hz"),
    "rate too high": (lambda: decode_audio(_wav(np.zeros(100), rate=400_000)), "sample rate 400000 Hz is outside"),
    "too long file": (
        lambda: decode_audio(_wav(np.zeros(612_000), rate=1000, subtype="PCM_16"), max_seconds=600),
        "audio is 612.0 s long; the limit is 600 s",
    ),
    "pcm empty": (lambda: pcm_to_waveform(b"", SAMPLE_RATE), "audio is empty"),
    "pcm ragged": (lambda: pcm_to_waveform(b"\0" * 7, SAMPLE_RATE), "raw PCM is 7 bytes, not a multiple of 4"),
    "pcm ragged stereo": (lambda: pcm_to_waveform(b"\0" * 12, SAMPLE_RATE, channels=2), "not a multiple of 8"),
    "pcm rate zero": (lambda: pcm_to_waveform(b"\0" * 8, 0), "sample rate 0 Hz is outside"),
    "pcm rate negative": (lambda: pcm_to_waveform(b"\0" * 8, -16000), "sample rate -16000 Hz is outside"),
    "pcm rate absurd": (lambda: pcm_to_waveform(b"\0" * 8, 10**9), "sample rate 1000000000 Hz is outside"),
    "pcm rate float": (lambda: pcm_to_waveform(b"\0" * 8, 16000.5), "sample rate must be an integer"),
    "pcm channels": (lambda: pcm_to_waveform(b"\0" * 8, SAMPLE_RATE, channels=0), "channels must be from 1"),
    "pcm nan": (
        lambda: pcm_to_waveform(np.array([0.0, np.nan], "<f4").tobytes(), SAMPLE_RATE),
        "audio contains NaN or infinite samples",
    ),
    "pcm too long": (
        lambda: pcm_to_waveform(np.zeros(612_000, "<f4").tobytes(), 1000, max_seconds=600),
        "audio is 612.0 s long; the limit is 600 s",
    ),
    "pcm too short to resample": (
        lambda: pcm_to_waveform(np.zeros(1, "<f4").tobytes(), 384_000),
        "audio is too short",
    ),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_bad_audio_raises_audio_error_naming_the_problem(case):
    call, message = ERROR_CASES[case]
    with pytest.raises(AudioError) as excinfo:
        call()
    assert message in str(excinfo.value)
    assert "0x" not in str(excinfo.value)  # no object addresses leak to clients


def test_audio_within_the_limit_passes():
    assert len(decode_audio(_wav(np.zeros(SAMPLE_RATE)), max_seconds=1.0)) == SAMPLE_RATE
    assert len(pcm_to_waveform(np.zeros(SAMPLE_RATE, "<f4").tobytes(), SAMPLE_RATE, max_seconds=1)) == SAMPLE_RATE


def test_server_mistakes_are_not_audio_errors():
    with pytest.raises(ValueError, match="max_seconds") as excinfo:
        decode_audio(_wav(np.zeros(100)), max_seconds=0)
    assert not isinstance(excinfo.value, AudioError)
    with pytest.raises(TypeError, match="bytes"):
        decode_audio("jfk.wav")


def _with_data_size(wav: bytes, size: int) -> bytes:
    data = bytearray(wav)
    data_chunk = data.index(b"data") + 4
    data[data_chunk : data_chunk + 4] = size.to_bytes(4, "little")
    return bytes(data)


@pytest.mark.parametrize(
    ("damage", "declared", "present"),
    [
        ("cut short", 16000, 10000),  # a half-finished upload
        ("header claims 1 GiB", 0x40000000, 16000),
    ],
)
def test_a_wav_with_fewer_samples_than_its_header_declares_is_refused(damage, declared, present):
    wav = _with_data_size(_wav(sine(440, SAMPLE_RATE, 0.5), subtype="PCM_16"), declared)
    data = wav[: len(wav) - 16000 + present]
    with pytest.raises(AudioError, match=f"WAV file is truncated .* declares {declared} bytes of samples, only {present} follow"):
        decode_audio(data)


def test_a_streamed_wav_of_unknown_length_decodes():
    """Writers that stream a WAV put 0xFFFFFFFF in the size field; libsndfile reads to the end."""
    wav = _wav(sine(440, SAMPLE_RATE, 0.5), subtype="PCM_16")
    assert len(decode_audio(_with_data_size(wav, 0xFFFFFFFF))) == SAMPLE_RATE // 2


def test_a_header_that_understates_the_length_decodes_what_it_declares():
    wav = _wav(sine(440, SAMPLE_RATE, 0.5), subtype="PCM_16")
    assert len(decode_audio(_with_data_size(wav, 4000))) == 2000


def _corrupted(data: bytes, rng: np.random.Generator, n_bytes: int = 8) -> bytes:
    damaged = bytearray(data)
    for i in rng.integers(0, len(damaged), size=n_bytes):
        damaged[i] = int(rng.integers(0, 256))
    return bytes(damaged)


def test_random_and_corrupted_bytes_never_hang():
    rng = np.random.default_rng(0)
    # Random tails behind each container's magic number reach past the format probe.
    magics = [b"", b"RIFF\xff\xff\xff\x7fWAVEfmt ", b"fLaC", b"OggS\x00\x02", b"ID3\x04\x00", b"\xff\xfb\x90\x64"]
    inputs = [magic + rng.bytes(int(n)) for magic in magics for n in rng.integers(1, 4096, size=20)]
    # Valid files with a few bytes overwritten reach into the codecs themselves.
    tone = sine(440, SAMPLE_RATE, 1.0)
    for fmt, subtype in [("WAV", "PCM_16"), ("FLAC", None), ("OGG", "VORBIS"), ("OGG", "OPUS"), ("MP3", None)]:
        if fmt in soundfile.available_formats():
            valid = encode(tone, SAMPLE_RATE, fmt, subtype)
            inputs += [_corrupted(valid, rng) for _ in range(20)]
    outcomes = []

    def decode_all():
        for data in inputs:
            try:
                waveform = decode_audio(data, max_seconds=600)
            except AudioError:
                outcomes.append("rejected")
            except Exception as err:  # anything else is a bug; report it below
                outcomes.append(repr(err))
            else:
                ok = waveform.dtype == np.float32 and waveform.ndim == 1 and np.isfinite(waveform).all()
                outcomes.append("decoded" if ok else f"bad waveform {waveform.dtype} {waveform.shape}")

    worker = threading.Thread(target=decode_all, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), f"decoding hung after {len(outcomes)} of {len(inputs)} inputs"
    assert set(outcomes) <= {"decoded", "rejected"}, set(outcomes)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_features_of_many_recordings_equal_each_alone(n_mels):
    """The batched log-mel (one STFT for every recording up to 30 s, longer ones alone)
    gives each recording exactly the features it gets alone, bit for bit."""
    from python_backend_lib.audio.decode import decode_audio
    from python_backend_lib.audio.features import features_for, features_for_many

    waveforms = [decode_audio(path.read_bytes()) for path in sorted(AUDIO_DIR.glob("*.wav"))]
    waveforms.append(np.zeros(480_000, np.float32))  # exactly 30 s of silence
    assert any(len(w) > 480_000 for w in waveforms) and any(len(w) < 480_000 for w in waveforms)
    for waveform, together in zip(waveforms, features_for_many(waveforms, n_mels)):
        alone = features_for(waveform, n_mels)
        assert together.shape == alone.shape and torch.equal(together, alone)
