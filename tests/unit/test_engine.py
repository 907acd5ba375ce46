"""The continuous-batching engine: requests join and leave a running batch
without changing each other's results."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import CancelledError, Future

import pytest
import torch
from conftest import AUDIO_DIR
from reference import clips

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.features import window_features
from python_backend_lib.core import geometry
from python_backend_lib.core.encoder_kernel import EncoderKernel
from python_backend_lib.core.options import DecodingOptions
from python_backend_lib.core.quantization import Quantization
from python_backend_lib.engine.batch import DecodeBatch
from python_backend_lib.engine.faults import FaultPlan, InjectedFault
from python_backend_lib.engine.loading import EngineSetup
from python_backend_lib.engine.scheduler import MAX_CONSECUTIVE_RESTARTS, EngineUnavailable
from python_backend_lib.transcription.pipeline import Pipeline

SLOTS = 4


@pytest.fixture(scope="module")
def pipe():
    pipeline = Pipeline.load("default", device="cpu", setup=EngineSetup(slots=SLOTS))
    yield pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def features(pipe):
    return [window_features(decode_audio(c.read())[: geometry.N_SAMPLES], pipe.n_mels) for c in clips()[:6]]


def _submit(pipe, features, options, **kwargs) -> Future:
    future: Future = Future()

    def on_done(outcome):
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    pipe.engine.submit(features, options, on_done, **kwargs)
    return future


def test_a_row_decoding_alone_reports_each_segment_as_it_ends_it(pipe):
    """jfk.wav, one window of two segments: the listener hears the row's result at the
    first's closing timestamp, as the row goes on, its tokens a beginning of the final
    ones; not at the second's, which ends the window (its answer tells it); beams, whose
    text is chosen only at the end, never call it."""
    jfk = window_features(decode_audio((AUDIO_DIR / "jfk.wav").read_bytes()), pipe.n_mels)
    special = pipe.config.special
    heard, beams_heard = [], []
    final = _submit(pipe, jfk, DecodingOptions(timestamps=True), on_segment=heard.append).result()
    tokens = final.tokens
    ends = [n for n in range(2, len(tokens) + 1) if tokens[n - 1] >= special.timestamp_begin and tokens[n - 2] < special.eot]
    assert len(ends) == 2 and ends[-1] == len(tokens)
    assert [partial.tokens for partial in heard] == [tokens[: ends[0]]]
    assert not any(partial.finished for partial in heard)
    searched = _submit(pipe, jfk, DecodingOptions(timestamps=True, beam_size=2), on_segment=beams_heard.append)
    assert searched.result().tokens and beams_heard == []


def test_requests_join_a_running_batch(pipe, features):
    solo = [_submit(pipe, f, DecodingOptions()).result().tokens for f in features]
    # A long forced decode keeps the batch running while the others join it,
    # more requests than slots, so some wait for a slot to free up.
    long = _submit(pipe, features[0], DecodingOptions(min_new_tokens=120, max_new_tokens=120))
    joined = [_submit(pipe, f, DecodingOptions()) for f in features]
    assert [f.result().tokens for f in joined] == solo
    assert len(long.result().tokens) == 120
    assert pipe.engine.batch.free_slots == SLOTS


def test_a_live_window_joins_before_the_batch_windows_waiting_for_slots(pipe, features):
    """Every slot busy, four batch windows waiting, then a live one: the live window
    takes the first slot that frees, ahead of the batch windows submitted before it."""
    forced = lambda n: DecodingOptions(min_new_tokens=n, max_new_tokens=n)  # noqa: E731
    busy = [_submit(pipe, f, forced(40)) for f in features[:SLOTS]]
    deadline = time.monotonic() + 60
    while pipe.engine.running < SLOTS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipe.engine.running == SLOTS
    order: list[str] = []
    done = threading.Event()

    def submit(name: str, f, live: bool) -> None:
        def on_done(outcome) -> None:
            order.append(name)
            if len(order) == SLOTS + 1:
                done.set()

        pipe.engine.submit(f, forced(30), on_done, live=live)

    for i in range(SLOTS):
        submit(f"batch-{i}", features[i], live=False)
    submit("live", features[SLOTS], live=True)
    assert done.wait(120) and all(len(b.result().tokens) == 40 for b in busy)
    # Without the live priority it would join after the four batch windows, and end last.
    assert order.index("live") < order.index(f"batch-{SLOTS - 1}"), order
    assert pipe.engine.batch.free_slots == SLOTS


def test_cancelled_request_frees_its_slot(pipe, features):
    steps = 0
    lock = threading.Lock()

    def cancel_after_a_few_steps() -> bool:
        nonlocal steps
        with lock:
            steps += 1
            return steps > 5

    cancelled = _submit(
        pipe, features[1], DecodingOptions(min_new_tokens=200, max_new_tokens=200), is_cancelled=cancel_after_a_few_steps
    )
    neighbour = _submit(pipe, features[2], DecodingOptions())
    with pytest.raises(CancelledError):
        cancelled.result(timeout=60)
    assert neighbour.result(timeout=60).finished
    assert pipe.engine.batch.free_slots == SLOTS


def test_a_request_cancelled_while_its_audio_is_encoded_is_answered_at_the_next_layer(pipe, features):
    """On a CPU the encoder's pass is the engine's longest turn (longer than a second under
    load, where a cancel must be answered within one): a request cancelled during it is
    answered before the next layer runs, its slot free, and the engine goes on serving."""
    began = threading.Event()
    entered: list[int] = []

    def entering(index: int):
        def hook(module, inputs) -> None:
            entered.append(index)
            began.set()  # the client gives up while its audio is being encoded

        return hook

    layers = pipe.engine.batch.model.encoder.layers
    hooks = [layer.register_forward_pre_hook(entering(i)) for i, layer in enumerate(layers)]
    try:
        cancelled = _submit(pipe, features[0], DecodingOptions(), is_cancelled=began.is_set)
        with pytest.raises(CancelledError):
            cancelled.result(timeout=60)
    finally:
        for hook in hooks:
            hook.remove()
    assert entered == [0], f"layers run after the cancel: {entered[1:]}"
    assert pipe.engine.batch.free_slots == SLOTS
    assert pipe.engine.stats.restarts == 0 and pipe.engine.stats.failed == 0
    assert _submit(pipe, features[1], DecodingOptions()).result(timeout=60).finished


def test_bad_requests_are_refused_at_submit(pipe, features):
    with pytest.raises(ValueError, match="features must have shape"):
        pipe.engine.submit(torch.zeros(80, 100), DecodingOptions(), lambda _: None)
    with pytest.raises(ValueError, match="English-only"):
        pipe.engine.submit(features[0], DecodingOptions(language="de"), lambda _: None)


def test_a_failing_callback_does_not_stop_the_engine(pipe, features):
    def explode(_):
        raise RuntimeError("callback bug")

    pipe.engine.submit(features[3], DecodingOptions(max_new_tokens=3), explode)
    assert _submit(pipe, features[3], DecodingOptions(max_new_tokens=3)).result(timeout=60).tokens


def test_a_request_that_breaks_the_step_fails_alone(pipe, features, monkeypatch):
    """A request whose handling raises in the middle of a step, after every row of the
    step was advanced: the engine rewinds them and steps each alone, so only that
    request fails and the others' tokens are those they get alone."""
    solo = [_submit(pipe, f, DecodingOptions()).result().tokens for f in features[:3]]
    failed_steps = pipe.engine.stats.failed_steps
    original = DecodeBatch._advance

    def advance_then_break(self, rows, tokens, logprobs, followed):
        finished = original(self, rows, tokens, logprobs, followed)
        if any(row.options.prompt == "boom" for row in rows):
            raise RuntimeError("a bug after the rows were advanced")
        return finished

    monkeypatch.setattr(DecodeBatch, "_advance", advance_then_break)
    long = _submit(pipe, features[0], DecodingOptions(min_new_tokens=60, max_new_tokens=60))
    broken = _submit(pipe, features[4], DecodingOptions(prompt="boom", temperature=0.5))
    neighbours = [_submit(pipe, f, DecodingOptions()) for f in features[:3]]
    with pytest.raises(RuntimeError, match="after the rows were advanced"):
        broken.result(timeout=60)
    assert [f.result(timeout=60).tokens for f in neighbours] == solo
    assert len(long.result(timeout=60).tokens) == 60
    assert pipe.engine.stats.failed_steps > failed_steps
    assert pipe.engine.batch.free_slots == SLOTS


def test_a_request_that_breaks_encoding_fails_alone(pipe, features):
    """Features that cannot reach the model's device fail while new requests are
    encoded together; the others are then encoded one by one and succeed."""
    solo = _submit(pipe, features[1], DecodingOptions()).result().tokens
    requests = [
        _submit(pipe, features[1], DecodingOptions()),
        _submit(pipe, torch.zeros_like(features[1], device="meta"), DecodingOptions()),
        _submit(pipe, features[1], DecodingOptions()),
    ]
    with pytest.raises(NotImplementedError, match="meta"):
        requests[1].result(timeout=60)
    assert [requests[i].result(timeout=60).tokens for i in (0, 2)] == [solo, solo]
    assert pipe.engine.batch.free_slots == SLOTS


def test_the_fault_hook_fails_only_its_request():
    pipeline = Pipeline.load("default", device="cpu", setup=EngineSetup(slots=SLOTS, faults=FaultPlan(step_prompt="boom")))
    try:
        feature = window_features(decode_audio(clips()[0].read())[: geometry.N_SAMPLES], pipeline.n_mels)
        solo = _submit(pipeline, feature, DecodingOptions()).result(timeout=60).tokens
        long = _submit(pipeline, feature, DecodingOptions(min_new_tokens=40, max_new_tokens=40))
        faulty = _submit(pipeline, feature, DecodingOptions(prompt="boom"))
        others = [_submit(pipeline, feature, DecodingOptions(prompt=p)) for p in (None, "not boom")]
        with pytest.raises(InjectedFault, match="boom"):
            faulty.result(timeout=60)
        assert others[0].result(timeout=60).tokens == solo
        assert others[1].result(timeout=60).finished
        assert len(long.result(timeout=60).tokens) == 40
        stats = pipeline.engine.stats
        assert stats.failed == 1 and stats.failed_steps >= 1
        assert stats.admitted == stats.submitted == 5 and len(stats.recent_waits) == 5
        assert pipeline.engine.running == pipeline.engine.waiting == 0
        assert pipeline.engine.batch.counts.eager_passes > 0 and pipeline.engine.batch.counts.graph_replays == 0
    finally:
        pipeline.close()


def test_an_engine_loop_failure_fails_what_it_holds_and_the_engine_restarts():
    """With the engine fault, a step fails and so does the failure handling (dropping
    the faulty row raises): the loop itself fails. Every window it held gets that
    error, none waits forever, and the next request is served by the restarted loop."""
    setup = EngineSetup(slots=SLOTS, faults=FaultPlan(engine_prompt="crash"))
    pipeline = Pipeline.load("default", device="cpu", setup=setup)
    try:
        feature = window_features(decode_audio(clips()[0].read())[: geometry.N_SAMPLES], pipeline.n_mels)
        solo = _submit(pipeline, feature, DecodingOptions()).result(timeout=60).tokens
        held = [_submit(pipeline, feature, DecodingOptions(min_new_tokens=30, max_new_tokens=30)) for _ in range(2)]
        crash = _submit(pipeline, feature, DecodingOptions(prompt="crash"))
        for future in [crash, *held]:
            with pytest.raises(InjectedFault, match="crash"):
                future.result(timeout=60)
        assert pipeline.engine.stats.restarts == 1
        assert _submit(pipeline, feature, DecodingOptions()).result(timeout=60).tokens == solo
        assert pipeline.engine.healthy and pipeline.engine.batch.free_slots == SLOTS
    finally:
        pipeline.close()


def test_an_engine_that_keeps_failing_gives_up_and_refuses_at_once():
    setup = EngineSetup(slots=SLOTS, faults=FaultPlan(engine_prompt="crash"))
    pipeline = Pipeline.load("default", device="cpu", setup=setup)
    try:
        feature = window_features(decode_audio(clips()[0].read())[: geometry.N_SAMPLES], pipeline.n_mels)
        for _ in range(MAX_CONSECUTIVE_RESTARTS):
            with pytest.raises(InjectedFault):
                _submit(pipeline, feature, DecodingOptions(prompt="crash")).result(timeout=60)
        assert not pipeline.engine.healthy
        with pytest.raises(EngineUnavailable, match="unhealthy"):
            pipeline.engine.submit(feature, DecodingOptions(), lambda _: None)
    finally:
        pipeline.close()


def test_close_with_a_window_decoding_answers_it_and_ends_the_engine_thread():
    """close() while a window decodes: the engine finishes it, then its thread ends. (It
    took close()'s marker on a collect while the window was decoding, then waited for
    another once idle, and close() gave up on the thread after its timeout.) A window
    submitted in a `together` block that the close came in is refused as the block ends:
    the engine thread is gone, and nothing else would answer it."""
    pipeline = Pipeline.load("default", device="cpu", setup=EngineSetup(slots=SLOTS))
    feature = window_features(decode_audio(clips()[0].read())[: geometry.N_SAMPLES], pipeline.n_mels)
    decoding = _submit(pipeline, feature, DecodingOptions(min_new_tokens=20, max_new_tokens=20))
    while pipeline.engine.turns < 2:  # admitted and stepping: close()'s marker comes mid-decode
        time.sleep(0.001)
    with pipeline.engine.together():
        held = _submit(pipeline, feature, DecodingOptions())
        pipeline.engine.close(timeout=20.0)
    assert len(decoding.result(timeout=0).tokens) == 20
    assert not pipeline.engine.thread.is_alive()
    with pytest.raises(EngineUnavailable, match="shut down"):
        held.result(timeout=0)


def test_windows_submitted_together_reach_an_idle_engine_as_one(pipe, features, monkeypatch):
    """An idle engine takes the first window handed to it at once; the windows of one
    `together` block come as one, encoded in one pass however slowly they were
    submitted (each one's wait counted), and decode as they do alone."""
    solo = [_submit(pipe, f, DecodingOptions()).result().tokens for f in features[:3]]
    passes = []
    admit = pipe.engine.batch.admit
    monkeypatch.setattr(pipe.engine.batch, "admit", lambda admissions, stop: passes.append(len(admissions)) or admit(admissions, stop))
    with pipe.engine.together():
        together = []
        for f in features[:3]:
            together.append(_submit(pipe, f, DecodingOptions()))
            time.sleep(0.1)  # an engine handed this window would have taken it by now
        assert pipe.engine.waiting == 0
    assert [f.result(timeout=60).tokens for f in together] == solo
    assert passes == [3] and pipe.engine.waiting == 0


def test_a_stuck_step_stops_the_turns_and_a_stalled_engine_refuses_at_once():
    """A step that never returns (the stall prompt) leaves `turns` standing, which is
    what the stall watch reads; `stall` then makes the engine refuse new windows at
    once, naming why, though its thread is still stuck."""
    setup = EngineSetup(slots=SLOTS, faults=FaultPlan(stall_prompt="hang"))
    pipeline = Pipeline.load("default", device="cpu", setup=setup)
    engine = pipeline.engine
    try:
        feature = window_features(decode_audio(clips()[0].read())[: geometry.N_SAMPLES], pipeline.n_mels)
        _submit(pipeline, feature, DecodingOptions()).result(timeout=60)
        stuck = _submit(pipeline, feature, DecodingOptions(prompt="hang"))
        deadline = time.monotonic() + 60
        while engine.batch.stalls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        turns = engine.turns
        time.sleep(0.5)
        assert engine.batch.stalls == 1 and engine.turns == turns and not stuck.done()
        assert engine.healthy
        engine.stall("no progress for 60 s")
        assert not engine.healthy
        with pytest.raises(EngineUnavailable, match="unhealthy and refuses new work: no progress for 60 s"):
            engine.submit(feature, DecodingOptions(), lambda _: None)
    finally:
        setup.faults.released.set()
        pipeline.close()


def test_results_finished_before_a_failed_step_are_delivered(pipe, features):
    """A step whose later part fails (StepFailed) still delivers the rows that
    finished in its earlier part; only the failing rows are retried alone."""
    from python_backend_lib.engine.batch import StepFailed

    batch = pipe.engine.batch
    real_step = batch.step
    calls = []

    def step_whose_second_part_fails(rows=None):
        if rows is None and not calls:
            calls.append(1)
            finished = real_step(rows)
            raise StepFailed(finished, RuntimeError("the graph part failed"))
        return real_step(rows)

    short = DecodingOptions(max_new_tokens=1)
    expected = _submit(pipe, features[0], short).result(timeout=60)
    batch.step = step_whose_second_part_fails
    try:
        got = _submit(pipe, features[0], short).result(timeout=60)
    finally:
        del batch.step
    assert got == expected and calls == [1]


def test_digital_silence_is_answered_without_decoding(pipe):
    silence = window_features(torch.zeros(geometry.N_SAMPLES), pipe.n_mels)
    steps = pipe.engine.batch.counts.eager_passes
    result = _submit(pipe, silence, DecodingOptions(), content_frames=geometry.N_FRAMES).result(timeout=60)
    assert result.tokens == () and result.no_speech_prob == 1.0
    assert pipe.engine.batch.counts.eager_passes == steps  # no decoder step ran for it
    decoded = _submit(pipe, silence, DecodingOptions()).result(timeout=60)  # no check asked: decoded
    assert decoded.no_speech_prob < 1.0


def test_a_pipeline_left_open_exits_cleanly(tmp_path):
    """A script that exits without close(), while the engine thread is still decoding,
    exits 0 and prints nothing (a thread inside torch at exit used to abort the process)."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "from python_backend_lib.engine.loading import EngineSetup\n"
        "from python_backend_lib.transcription.pipeline import Pipeline\n"
        "from python_backend_lib.audio.decode import decode_audio\n"
        "from python_backend_lib.core.options import TranscribeOptions\n"
        "pipeline = Pipeline.load('default', device='cpu', setup=EngineSetup(slots=2))\n"
        "pipeline.submit(decode_audio(open('tests/data/audio/jfk.wav', 'rb').read()), TranscribeOptions())\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_a_fused_qkv_projection_gives_the_three_projections_and_follows_their_weights():
    """`Projections.fuse_qkv` (the GPU decoder's): one product equal to the three, whose
    weights stay views of it, so an in-place change of one reaches the fused product."""
    from python_backend_lib.checkpoints.weights import load_checkpoint
    from python_backend_lib.engine.model import Whisper

    model = Whisper.from_checkpoint(load_checkpoint("random:tiny:3"), device=torch.device("cpu"), dtype=torch.float32)
    projections = model.decoder.layers[0].self_attn
    x = torch.randn(5, model.dims.n_text_state, generator=torch.Generator().manual_seed(0))
    separate = projections.qkv(x, model.dims.n_text_head)
    projections.fuse_qkv()
    for a, b in zip(projections.qkv(x, model.dims.n_text_head), separate):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        projections.k_proj.weight.mul_(2.0)
    k = projections.qkv(x, model.dims.n_text_head)[1]
    torch.testing.assert_close(k, 2.0 * separate[1], rtol=1e-5, atol=1e-5)
    assert projections.fused_qkv_weight.data_ptr() == projections.q_proj.weight.data_ptr()


def test_fp8_quantization_runs_the_encoder_attention_through_flashinfer_unless_told_not_to():
    fp8 = EngineSetup(quantization=Quantization.FP8)
    assert fp8.encoder_attention is EncoderKernel.FLASHINFER
    assert dataclasses.replace(fp8, encoder_kernel=EncoderKernel.SDPA).encoder_attention is EncoderKernel.SDPA
    assert EngineSetup().encoder_attention is EncoderKernel.SDPA
    assert EngineSetup(encoder_kernel=EncoderKernel.FLASHINFER).encoder_attention is EncoderKernel.FLASHINFER


def test_a_request_cancelled_while_waiting_for_a_slot_is_answered_before_one_frees(pipe, features):
    """Every slot busy with long decodes and a request waiting behind them: cancelled, it is
    answered at once, not when a slot frees for it (its client, and the server's request
    limit, would otherwise wait for every decode ahead of it)."""
    forced = DecodingOptions(min_new_tokens=150, max_new_tokens=150)
    busy = [_submit(pipe, f, forced) for f in features[:SLOTS]]
    deadline = time.monotonic() + 60
    while pipe.engine.running < SLOTS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipe.engine.running == SLOTS
    gave_up = threading.Event()
    waiting = _submit(pipe, features[SLOTS], DecodingOptions(), is_cancelled=gave_up.is_set)
    time.sleep(0.2)
    gave_up.set()
    with pytest.raises(CancelledError):
        waiting.result(timeout=60)
    assert not any(b.done() for b in busy), "answered only once a slot freed"
    assert all(len(b.result(timeout=120).tokens) == 150 for b in busy)
    assert pipe.engine.batch.free_slots == SLOTS
