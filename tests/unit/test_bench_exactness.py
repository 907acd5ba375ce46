"""bench.exactness: where two devices' greedy decodes part, and whether float16 noise explains it."""

from __future__ import annotations

from bench.exactness import LogitTrace, compare_traces

PROMPT = (50257, 50362)


def _trace(steps: list[tuple[tuple[int, ...], dict[int, float]]]) -> LogitTrace:
    trace = LogitTrace()
    for generated, top in steps:
        trace.steps[(PROMPT, generated)] = top
    return trace


def test_a_near_tie_inside_the_measured_noise_is_explained():
    cpu = _trace([((), {1: 5.0, 2: 3.0}), ((1,), {7: 4.00, 8: 3.99})])
    gpu = _trace([((), {1: 5.02, 2: 2.97}), ((1,), {7: 3.985, 8: 3.995})])
    divergence = compare_traces(cpu, gpu, [1, 7], [1, 8])
    assert (divergence.step, divergence.cpu_token, divergence.gpu_token) == (1, 7, 8)
    assert abs(divergence.noise - 0.03) < 1e-9  # the first step: same choice, |3.0 - 2.97|
    assert abs(divergence.cpu_gap - 0.01) < 1e-9 and abs(divergence.gpu_gap - 0.01) < 1e-9
    assert divergence.explained


def test_a_gap_wider_than_the_noise_is_not_explained():
    cpu = _trace([((), {1: 5.0, 2: 3.0}), ((1,), {7: 4.5, 8: 3.0})])
    gpu = _trace([((), {1: 5.001, 2: 3.001}), ((1,), {7: 3.0, 8: 4.5})])
    divergence = compare_traces(cpu, gpu, [1, 7], [1, 8])
    assert divergence.cpu_gap == 1.5 and not divergence.explained


def test_a_token_the_other_device_did_not_rank_is_not_explained():
    cpu = _trace([((), {1: 5.0, 2: 3.0})])
    gpu = _trace([((), {9: 5.0, 2: 3.0})])
    divergence = compare_traces(cpu, gpu, [1], [9])
    assert divergence.cpu_gap is None and not divergence.explained


def test_equal_decodes_have_no_divergence():
    trace = _trace([((), {1: 5.0, 2: 3.0})])
    assert compare_traces(trace, trace, [1], [1]) is None
