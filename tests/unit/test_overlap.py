"""Graph steps planned while the step before them runs (`engine.overlap`): the same
results as steps taken one after another, and the engine's handling of failures,
cancellations and silence around a step in flight.

The graph table here is the CPU stand-in (`cpu_steps.CpuStepTable`): the same
inputs and outputs as the captured steps, computed eagerly. tests/gpu/test_gpu.py
runs the real table the same way on a GPU.
"""

from __future__ import annotations

from concurrent.futures import CancelledError, Future

import numpy as np
import pytest
import torch
from cpu_steps import CpuStepTable
from reference import clips

from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.audio.features import window_features
from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core import geometry
from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.core.options import DecodingOptions
from python_backend_lib.engine.attention import SdpaAttention
from python_backend_lib.engine.batch import DecodeBatch
from python_backend_lib.engine.faults import FaultPlan, FaultyDecodeBatch, InjectedFault
from python_backend_lib.engine.graph_io import META_FOLLOWS, META_RULES, META_TOKEN, N_META
from python_backend_lib.engine.kv_cache import KVSlotPool, PoolShape
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.overlap import fed_inputs
from python_backend_lib.engine.prompt import initial_tokens
from python_backend_lib.engine.rows import END_ALLOWED, Admission, Row, follow_facts
from python_backend_lib.engine.rules import N_RULE_FACTS
from python_backend_lib.engine.scheduler import Engine
from python_backend_lib.text.tokenizer import load_tokenizer

CPU = torch.device("cpu")
_MODELS: dict = {}


def model_for(source: str, dtype: torch.dtype):
    if (source, dtype) not in _MODELS:
        checkpoint = load_checkpoint(source)
        _MODELS[source, dtype] = (Whisper.from_checkpoint(checkpoint, device=CPU, dtype=dtype), checkpoint.config)
    return _MODELS[source, dtype]


def make_batch(source: str, slots: int, *, overlap: bool, dtype=torch.float32, faults: FaultPlan | None = None,
               run_steps: int = 1):  # fmt: skip
    model, config = model_for(source, dtype)
    attention = SdpaAttention(KVSlotPool(PoolShape.for_model(config.dims, slots), device=CPU, dtype=dtype))
    graphs = CpuStepTable(model, config, attention, max_batch=slots, run_steps=run_steps)
    if faults is not None:
        return FaultyDecodeBatch(model, config, attention, graphs, plan=faults, overlap=overlap)
    return DecodeBatch(model, config, attention, graphs, overlap=overlap)


def random_features(config, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(config.dims.n_mels, N_FRAMES, generator=generator).clamp(-1.5, 1.5)


def run(batch: DecodeBatch, admissions: list[Admission], join_every: int = 2) -> tuple[dict, int]:
    """Admit one request every `join_every` steps (while slots are free) and step until
    every request is answered; returns the results by tag, and how many launched
    steps fed a row the token its step before chose (0 without overlap)."""
    queue, results, followed, steps = list(admissions), {}, 0, 0
    while queue or batch.rows:
        if queue and batch.free_slots and steps % join_every == 0:
            batch.admit(queue[:1])
            queue = queue[1:]
        results.update(batch.step())
        steps += 1
        in_flight = batch._in_flight
        followed += bool(in_flight and any(part.follows is not None for part in in_flight.parts))
    results.update(batch.drain())
    assert batch.free_slots == batch.pool.shape.n_slots
    return results, followed


def assert_same(overlapped: dict, stepwise: dict, sampled: set = frozenset(), rel: float = 1e-9) -> None:
    """The same tokens, language and prompt; probabilities within `rel`: the two runs
    batch the rows differently (a step later, beside rows that ended), and the
    CPU's matrix products round a row's sums differently in other batches."""
    assert overlapped.keys() == stepwise.keys()
    for tag, a in stepwise.items():
        b = overlapped[tag]
        if tag in sampled:  # drawn at a temperature: other draws in another order
            assert len(b.tokens) == len(a.tokens) and b.prompt_tokens == a.prompt_tokens
            continue
        assert (b.tokens, b.language, b.finished, b.prompt_tokens) == (a.tokens, a.language, a.finished, a.prompt_tokens), tag
        for name in ("avg_logprob", "no_speech_prob", "language_probability"):
            expected = getattr(a, name)
            assert getattr(b, name) == (expected if expected is None else pytest.approx(expected, rel=rel)), (tag, name)


def test_the_facts_a_row_follows_with_equal_its_own_after_each_token():
    """`follow_facts` from a step's facts and pick gives what `Row.rule_facts` gives
    once the pick is appended, over random sequences of text and timestamp tokens."""
    begin = 50364
    generator = np.random.default_rng(0)
    options = DecodingOptions(timestamps=True, min_new_tokens=5)
    for _ in range(50):
        row = Row(tag=0, options=options, prompt=None, slot=1, max_new_tokens=100, pending=[])
        facts = np.array(row.rule_facts(begin), dtype=np.int64)
        for _ in range(12):
            token = int(generator.choice([generator.integers(0, 50000), generator.integers(begin, begin + 1500)]))
            followed = follow_facts(facts[:, None], np.array([token]), begin)[:, 0]
            row.generated.append(token)
            expected = np.array(row.rule_facts(begin), dtype=np.int64)
            followed[END_ALLOWED] = expected[END_ALLOWED]  # the caller counts tokens
            assert followed.tolist() == expected.tolist()
            facts = expected
    assert len(facts) == N_RULE_FACTS


def test_the_device_feeds_following_rows_the_picks_and_facts_the_host_would_make():
    """`fed_inputs` (on the device) from the step before's picks and the facts it ran with
    (`carried`) gives following rows the tokens and facts that `follow_facts` gives on the
    host, but whether they may end, which the host writes; rows that do not follow keep
    their own token and facts."""
    begin = 50364
    generator = np.random.default_rng(1)
    options = DecodingOptions(timestamps=True)
    before = []
    for _ in range(24):  # facts of rows after random text and timestamp tokens
        row = Row(tag=0, options=options, prompt=None, slot=1, max_new_tokens=100, pending=[])
        for _ in range(int(generator.integers(0, 5))):
            row.generated.append(int(generator.choice([generator.integers(0, 50000), generator.integers(begin, begin + 1500)])))
        before.append(row.rule_facts(begin))
    before = np.array(before, dtype=np.int64).T  # [N_RULE_FACTS, 24]: the step before's rows
    picks = np.where(generator.random(24) < 0.5, generator.integers(0, 50000, 24), generator.integers(begin, begin + 1500, 24))
    follows = np.array([5, -1, 0, 23, -1, 11, 7, 2, 19, -1])
    own = np.array(Row(tag=0, options=options, prompt=None, slot=1, max_new_tokens=9, pending=[]).rule_facts(begin))
    planned = np.repeat(own[:, None], len(follows), axis=1)
    following = np.flatnonzero(follows >= 0)
    planned[:, following] = 0  # what plan_step writes for them: only whether they may end
    planned[END_ALLOWED, following] = generator.integers(0, 2, len(following))
    meta = np.zeros((N_META, len(follows)), dtype=np.int64)
    meta[META_TOKEN], meta[META_FOLLOWS], meta[META_RULES:] = 7, follows, planned
    tokens, facts = fed_inputs(torch.from_numpy(meta), torch.from_numpy(picks), torch.from_numpy(before), begin)
    expected = planned.copy()
    expected[:, following] = follow_facts(before[:, follows[following]], picks[follows[following]], begin)
    expected[END_ALLOWED, following] = planned[END_ALLOWED, following]
    assert tokens.tolist() == [int(picks[f]) if f >= 0 else 7 for f in follows]
    assert facts.tolist() == expected.tolist()
    assert any(picks[f] >= begin for f in follows[following]) and any(picks[f] < begin for f in follows[following])
    assert len({tuple(before[:, f]) for f in follows[following]}) > 3  # rows after different tokens


def encoded_once(monkeypatch, model) -> None:
    """`model.encode` keeps what it encoded: a second batch admitting the same windows one
    at a time reads the first's audio features, the same bits it would compute again
    (float64 windows take most of such a test's time on a CPU)."""
    encode, kept = model.encode, {}

    def encode_kept(mel: torch.Tensor, attention, stop=None) -> torch.Tensor:
        key = (tuple(mel.shape), mel.numpy().tobytes())
        if key not in kept:
            kept[key] = encode(mel, attention, stop)
        return kept[key].clone()

    monkeypatch.setattr(model, "encode", encode_kept)


@pytest.mark.slow
def test_overlapped_steps_give_the_stepwise_results_with_random_weights(monkeypatch):
    """Language detection, prompts fed a token a step and a long one fed eagerly,
    forced lengths (rows leave at different steps), timestamps, a row at a
    temperature and a window of digital silence, joining one by one."""
    source = "random:tiny:1"
    model, config = model_for(source, torch.float64)
    encoded_once(monkeypatch, model)
    forced = [dict(min_new_tokens=m, max_new_tokens=m) for m in (6, 11, 3, 9, 14, 7, 5, 12)]
    options = [
        DecodingOptions(**forced[0]),  # multilingual: its language is detected
        DecodingOptions(language="en", timestamps=True, **forced[1]),
        DecodingOptions(language="de", previous_tokens=(1, 2, 3), **forced[2]),
        DecodingOptions(language="en", previous_tokens=tuple(range(1, 21)), **forced[3]),  # fed eagerly
        DecodingOptions(language="en", temperature=1.0, **forced[4]),
        DecodingOptions(**forced[5]),
        DecodingOptions(language="fr", task="translate", **forced[6]),
        DecodingOptions(language="en", **forced[7]),
    ]
    admissions = [Admission(i, random_features(config, i), o, initial_tokens(config, o, None)) for i, o in enumerate(options)]
    silent = torch.full((config.dims.n_mels, N_FRAMES), -1.5)  # the log-mel of zeros
    admissions.append(Admission("silence", silent, DecodingOptions(language="en"), initial_tokens(config, DecodingOptions(language="en"), None), content_frames=N_FRAMES))
    stepwise, none_followed = run(make_batch(source, 4, overlap=False, dtype=torch.float64), admissions)
    overlapped, followed = run(make_batch(source, 4, overlap=True, dtype=torch.float64), admissions)
    assert none_followed == 0 and followed > 10  # the steps did overlap
    assert_same(overlapped, stepwise, sampled={4})
    assert stepwise["silence"].tokens == () and stepwise["silence"].no_speech_prob == 1.0
    assert stepwise[0].language is not None and stepwise[0].language_probability is not None  # detected


def test_a_beam_search_that_joins_with_a_greedy_step_in_flight_is_handled_like_stepwise():
    """The step in flight was launched with no beam row in the batch, so it kept no
    logits; a beam search admitted before it is handled must not need them (found by
    the GPU soak: the step failed and was retried request by request)."""
    source = "random:tiny:1"
    _, config = model_for(source, torch.float64)
    greedy = DecodingOptions(language="en", min_new_tokens=12, max_new_tokens=12)
    searched = DecodingOptions(language="en", beam_size=2, min_new_tokens=5, max_new_tokens=5)
    admissions = [Admission(i, random_features(config, i), o, initial_tokens(config, o, None))
                  for i, o in enumerate((greedy, searched, greedy))]
    # Six steps apart: the greedy row chooses its tokens by the time the search joins.
    stepwise, _ = run(make_batch(source, 6, overlap=False, dtype=torch.float64), admissions, join_every=6)
    overlapped, followed = run(make_batch(source, 6, overlap=True, dtype=torch.float64), admissions, join_every=6)
    assert followed > 5
    assert_same(overlapped, stepwise)


@pytest.mark.slow
def test_overlapped_steps_give_the_stepwise_transcripts_of_real_speech():
    """tiny.en on the shared clips, timestamps on: real text and timestamp tokens
    fed from the step before's picks."""
    model, config = model_for("default", torch.float32)
    tokenizer = load_tokenizer(config)
    options = DecodingOptions(timestamps=True)
    features = [window_features(decode_audio(c.read())[: geometry.N_SAMPLES], config.dims.n_mels) for c in clips()[:6]]
    prompt = initial_tokens(config, options, tokenizer)
    admissions = [Admission(i, f, options, prompt, content_frames=N_FRAMES) for i, f in enumerate(features)]
    stepwise, _ = run(make_batch("default", 3, overlap=False), admissions, join_every=3)
    overlapped, followed = run(make_batch("default", 3, overlap=True), admissions, join_every=3)
    assert followed > 20
    assert_same(overlapped, stepwise, rel=1e-5)  # float32: a row's sums move by about 1e-6 with its batch
    timestamps = [t for r in stepwise.values() for t in r.tokens if t >= config.special.timestamp_begin]
    assert len(timestamps) >= 2 * len(admissions)  # the timestamp rules were exercised


def test_a_run_takes_only_rows_that_may_take_every_step_of_it_on_their_page():
    """plan_step makes a run of the next step only where every row follows, greedy, may
    end, has room for the run's tokens, and writes them into its current self page (the
    run's steps read the page tables planned for its first)."""
    from python_backend_lib.engine.kv_cache import PAGE_SIZE
    from python_backend_lib.engine.overlap import Launched, plan_step
    from python_backend_lib.engine.prompt import Prompt

    def plan(cached: list[int], steps: int, **options) -> int:
        rows = []
        for i, c in enumerate(cached):
            row = Row(tag=i, options=DecodingOptions(**options), prompt=Prompt((50257,), 0, False, "en"), slot=i + 1,
                      max_new_tokens=40, pending=[5])  # fmt: skip
            row.cached, row.generated = c, list(range(100, 100 + c - 1))
            rows.append(row)
        first = plan_step(rows, None, 8, 50364)
        previous = Launched(first.parts, first.inputs.tokens.copy(), None)
        for row in rows:
            row.pending, row.cached = [], row.cached + 1  # launched: each follows itself now
        return plan_step(rows, previous, 8, 50364, run_steps=steps).inputs.steps

    assert plan([3, 9], 2) == 2 and plan([3, 9], 3) == 3
    assert plan([3, PAGE_SIZE - 2], 2) == 1  # its second step would open a page
    assert plan([3, PAGE_SIZE - 3], 3) == 1 and plan([3, PAGE_SIZE - 3], 2) == 2
    assert plan([3, PAGE_SIZE], 2) == 2  # on its new page from the first step
    # At most 40 tokens: 37 or 38 generated, one chosen in flight, and the run's two.
    assert plan([3, 38], 2) == 2 and plan([3, 39], 2) == 1
    assert plan([3, 9], 2, min_new_tokens=12) == 1  # may not end yet
    assert plan([3, 9], 2, temperature=0.5) == 1
    assert plan([3, 9], 1) == 1


@pytest.mark.slow
@pytest.mark.parametrize("steps", [2, 3])
def test_runs_give_the_stepwise_results_with_random_weights(monkeypatch, steps):
    """Runs of `steps` steps between single ones: rows joining one by one, prompts,
    timestamps, a detected language, a row at a temperature (never in a run) and token
    limits that end rows inside a run and at its end."""
    source = "random:tiny:1"
    model, config = model_for(source, torch.float64)
    encoded_once(monkeypatch, model)
    options = [
        DecodingOptions(language="en", timestamps=True, max_new_tokens=17),
        DecodingOptions(max_new_tokens=12),  # multilingual: its language is detected
        DecodingOptions(language="de", previous_tokens=(1, 2, 3), max_new_tokens=9),
        DecodingOptions(language="en", timestamps=True, max_new_tokens=21),
        DecodingOptions(language="en", temperature=1.0, max_new_tokens=6),
        DecodingOptions(language="fr", task="translate", timestamps=True, max_new_tokens=14),
        DecodingOptions(language="en", max_new_tokens=10),
    ]
    admissions = [Admission(i, random_features(config, i), o, initial_tokens(config, o, None)) for i, o in enumerate(options)]
    stepwise, _ = run(make_batch(source, 3, overlap=False, dtype=torch.float64), admissions, join_every=5)
    batch = make_batch(source, 3, overlap=True, dtype=torch.float64, run_steps=steps)
    in_runs, _ = run(batch, admissions, join_every=5)
    assert batch.graphs.run_launches > 5
    assert batch.counts.graph_steps - batch.counts.graph_replays == (steps - 1) * batch.graphs.run_launches
    assert_same(in_runs, stepwise, sampled={4})
    assert any(t >= config.special.timestamp_begin for t in stepwise[3].tokens)


@pytest.mark.slow
def test_runs_give_the_stepwise_transcripts_of_real_speech():
    """tiny.en on the shared clips, timestamps on, runs of two steps: rows that end
    with <|endoftext|> inside a run, real timestamp pairs made on the device. In float64:
    the two runs batch the rows differently, which float32's sums would show."""
    model, config = model_for("default", torch.float64)
    tokenizer = load_tokenizer(config)
    options = DecodingOptions(timestamps=True)
    features = [window_features(decode_audio(c.read())[: geometry.N_SAMPLES], config.dims.n_mels) for c in clips()[:4]]
    prompt = initial_tokens(config, options, tokenizer)
    admissions = [Admission(i, f.double(), options, prompt) for i, f in enumerate(features)]
    stepwise, _ = run(make_batch("default", 2, overlap=False, dtype=torch.float64), admissions, join_every=3)
    batch = make_batch("default", 2, overlap=True, dtype=torch.float64, run_steps=2)
    in_runs, _ = run(batch, admissions, join_every=3)
    assert batch.graphs.run_launches > 15
    assert_same(in_runs, stepwise)
    timestamps = [t for r in stepwise.values() for t in r.tokens if t >= config.special.timestamp_begin]
    assert len(timestamps) >= 2 * len(admissions)  # the timestamp rules were exercised


def _engine_results(batch: DecodeBatch, windows: list[tuple[torch.Tensor, DecodingOptions]], tokenizer,
                    cancel_after: dict | None = None, stats: list | None = None) -> list:  # fmt: skip
    """Every window through an Engine over `batch`: each one's result or exception
    (the engine's statistics appended to `stats`)."""
    engine = Engine(batch, batch.config, tokenizer)
    futures, steps = [], {"n": 0}
    original_step = batch.step

    def counted_step(rows=None):
        steps["n"] += 1
        return original_step(rows)

    batch.step = counted_step
    try:
        for i, (features, options) in enumerate(windows):
            future: Future = Future()

            def on_done(outcome, future=future):
                (future.set_exception if isinstance(outcome, BaseException) else future.set_result)(outcome)

            limit = (cancel_after or {}).get(i)
            engine.submit(features, options, on_done, (lambda limit=limit: steps["n"] > limit) if limit else None)
            futures.append(future)
        outcomes = []
        for future in futures:
            try:
                outcomes.append(future.result(timeout=120))
            except Exception as error:
                outcomes.append(error)
        return outcomes
    finally:
        engine.close()
        if stats is not None:
            stats.append(engine.stats)


@pytest.fixture(scope="module")
def speech():
    _, config = model_for("default", torch.float32)
    return [window_features(decode_audio(c.read())[: geometry.N_SAMPLES], config.dims.n_mels) for c in clips()[:5]]


@pytest.mark.slow
@pytest.mark.parametrize("run_steps", [1, 2])
def test_a_failing_request_fails_alone_with_a_step_in_flight(speech, run_steps):
    """A step that raises while the one before it is in flight: the engine rewinds
    the rows (the step in flight abandoned), steps them one by one, and only the
    request that fails alone gets the error. The failing request is the fourth of three
    slots: it joins mid-decode, as a slot frees. With runs, what is abandoned is a run."""
    _, config = model_for("default", torch.float32)
    tokenizer = load_tokenizer(config)
    windows = [(f, DecodingOptions()) for f in speech]
    clean = _engine_results(make_batch("default", 3, overlap=True), windows, tokenizer)
    faulty_windows = windows[:3] + [(speech[3], DecodingOptions(prompt="boom"))] + windows[4:]
    batch = make_batch("default", 3, overlap=True, faults=FaultPlan(step_prompt="boom"), run_steps=run_steps)
    abandoned = _noting_the_launch_in_flight(batch, "rewind", lambda in_flight, saved: in_flight and in_flight.steps)
    faulty = _engine_results(batch, faulty_windows, tokenizer)
    assert isinstance(faulty[3], InjectedFault)
    for i in (0, 1, 2, 4):
        assert faulty[i].tokens == clean[i].tokens
    assert batch.free_slots == 3 and not batch.rows
    assert abandoned[0] == run_steps  # a step was in flight when the failing step raised; with runs, a run


@pytest.mark.slow
@pytest.mark.parametrize("run_steps", [1, 2])
def test_a_step_that_fails_after_launching_the_next_is_rewound_and_retried(speech, monkeypatch, run_steps):
    """The failure comes while handling step t, step t+1 already launched: rows
    rewound to before t (each row's state as the launch remembered it) and retried
    one by one give every request the result it gets without the failure. With runs,
    t may be a run, and the failure come at either of its steps."""
    _, config = model_for("default", torch.float32)
    tokenizer = load_tokenizer(config)
    windows = [(f, DecodingOptions()) for f in speech]
    clean = _engine_results(make_batch("default", 3, overlap=True), windows, tokenizer)
    batch = make_batch("default", 3, overlap=True, run_steps=run_steps)
    original, finish = DecodeBatch._advance, DecodeBatch._finish
    calls, handling, failed_in = {"n": 0}, [], []  # the steps of the launch being handled, at each failure

    def flaky(self, rows, tokens, logprobs, followed):
        if handling[-1] != run_steps:  # with runs, only the runs' steps are counted
            return original(self, rows, tokens, logprobs, followed)
        calls["n"] += 1
        if calls["n"] in (4, 9) and followed:  # mid-decode, a step launched after this one
            failed_in.append(handling[-1])
            raise RuntimeError("a bug while handling a step")
        return original(self, rows, tokens, logprobs, followed)

    def finishing(self, launched, steps, followed):
        handling.append(launched.steps)
        return finish(self, launched, steps, followed)

    monkeypatch.setattr(DecodeBatch, "_advance", flaky)
    monkeypatch.setattr(DecodeBatch, "_finish", finishing)
    stats = []
    retried = _engine_results(batch, windows, tokenizer, stats=stats)
    assert stats[0].failed_steps == 2 and stats[0].restarts == 0
    assert [r.tokens for r in retried] == [r.tokens for r in clean]
    assert batch.free_slots == 3
    assert failed_in == [run_steps, run_steps]  # with runs, each failure came while handling one


@pytest.mark.slow
def test_a_request_cancelled_with_a_step_in_flight_leaves_and_frees_its_slot(speech):
    _, config = model_for("default", torch.float32)
    tokenizer = load_tokenizer(config)
    windows = [(f, DecodingOptions(min_new_tokens=30)) for f in speech[:3]]
    clean = _engine_results(make_batch("default", 3, overlap=True), windows, tokenizer)
    batch = make_batch("default", 3, overlap=True)
    outcomes = _engine_results(batch, windows, tokenizer, cancel_after={1: 6})
    assert isinstance(outcomes[1], CancelledError)
    assert outcomes[0].tokens == clean[0].tokens and outcomes[2].tokens == clean[2].tokens
    assert batch.free_slots == 3 and not batch.rows


@pytest.mark.slow
def test_a_request_cancelled_with_a_run_in_flight_leaves_and_the_others_decode_as_without(speech):
    """A request cancelled while a run of two steps holds its row: the row leaves, its slot
    is freed (the run still writes there, ordered first), and the other requests, those
    that waited for a slot among them, decode as they do without the cancel."""
    _, config = model_for("default", torch.float32)
    tokenizer = load_tokenizer(config)
    windows = [(f, DecodingOptions(timestamps=True)) for f in speech]  # the rule facts matter
    clean = _engine_results(make_batch("default", 3, overlap=True), windows, tokenizer)
    assert len(clean[0].tokens) > 20  # it would go on well past each cancel below
    held = []
    for cancel_after in (4, 9):  # two moments: where the engine's launches fall depends on when requests join
        batch = make_batch("default", 3, overlap=True, run_steps=2)
        noted = _noting_the_launch_in_flight(batch, "drop", _steps_holding)
        outcomes = _engine_results(batch, windows, tokenizer, cancel_after={0: cancel_after})
        assert isinstance(outcomes[0], CancelledError)
        assert [r.tokens for r in outcomes[1:]] == [r.tokens for r in clean[1:]]
        assert batch.free_slots == 3 and not batch.rows
        held += noted
    assert len(held) == 2 and 2 in held  # a run held the row as it left


def _noting_the_launch_in_flight(batch: DecodeBatch, method: str, note) -> list:
    """Wrap `batch.<method>` so that each call first notes `note(the launch in flight or None,
    *arguments)`, unless that is None; returns the list the notes go to, filled as calls come."""
    notes, original = [], getattr(batch, method)

    def noting(*args):
        if (noted := note(batch._in_flight, *args)) is not None:
            notes.append(noted)
        return original(*args)

    setattr(batch, method, noting)
    return notes


def _steps_holding(in_flight, tag) -> int:
    """The steps of the launch in flight if it holds a row of request `tag` (0: none does)."""
    return in_flight.steps if in_flight and any(part.row.tag is tag for part in in_flight.parts) else 0


def test_a_silent_window_is_answered_silent_before_any_token():
    """Digital silence is read after the admission (which does not wait for the
    device): the row may take part in a step, but its answer is the silent one."""
    _, config = model_for("random:tiny:1", torch.float32)
    options = DecodingOptions(language="en", min_new_tokens=4, max_new_tokens=4)
    prompt = initial_tokens(config, options, None)
    silent = torch.full((config.dims.n_mels, N_FRAMES), -1.5)  # the log-mel of zeros
    batch = make_batch("random:tiny:1", 2, overlap=True)
    batch.admit([Admission("quiet", silent, options, prompt, content_frames=N_FRAMES),
                 Admission("loud", random_features(config, 1), options, prompt, content_frames=N_FRAMES)])  # fmt: skip
    assert [row.silence is not None for row in batch.rows] == [True, True]  # not read yet
    results = {}
    while batch.rows:
        results.update(batch.step())
    results.update(batch.drain())
    assert results["quiet"].tokens == () and results["quiet"].no_speech_prob == 1.0
    assert len(results["loud"].tokens) == 4


def test_a_silent_window_answered_in_a_step_that_then_fails_keeps_its_answer(monkeypatch):
    """A silence check read while handling a step (not ready before it) answers its row
    and takes it out of the batch; when taking the other rows' picks then raises, that
    answer travels on the StepFailed for the engine to deliver, not lost with the error."""
    from python_backend_lib.engine.batch import StepFailed
    from python_backend_lib.engine.rows import SilenceCheck

    _, config = model_for("default", torch.float32)
    options = DecodingOptions(timestamps=True, max_new_tokens=4)
    prompt = initial_tokens(config, options, None)
    assert len(prompt.tokens) == 1  # tiny.en with timestamps: the first step chooses a token
    silent = torch.full((config.dims.n_mels, N_FRAMES), -1.5)  # the log-mel of zeros
    batch = make_batch("default", 2, overlap=True)
    batch.admit([Admission("quiet", silent, options, prompt, content_frames=N_FRAMES),
                 Admission("loud", random_features(config, 1), options, prompt)])  # fmt: skip
    monkeypatch.setattr(SilenceCheck, "ready", lambda self: False)  # read only when a step waits for it

    def failing(self, rows, tokens, logprobs, followed):
        raise RuntimeError("a bug while taking the picks")

    monkeypatch.setattr(DecodeBatch, "_advance", failing)
    assert batch.step() == [] and len(batch._in_flight.parts) == 2  # the first step launched, both rows in it
    with pytest.raises(StepFailed) as failed:
        batch.step()
    assert [tag for tag, _ in failed.value.finished] == ["quiet"]
    assert failed.value.finished[0][1].no_speech_prob == 1.0
    assert [row.tag for row in batch.rows] == ["loud"]

