"""The fused tail of a graph step (`engine.step_kernels`) against transformers' logits
processors and the PyTorch path it replaces (`fed_inputs`, `LogitRules`, `sample`).

On a GPU the kernels run compiled; without one, in Triton's interpreter (the same
kernel code, executed with NumPy), so that CI checks them on every change.
"""

from __future__ import annotations

import importlib
import os
import random
import sys

import numpy as np
import pytest
import torch
from test_decoding_rules import ENGLISH, MULTILINGUAL, _hf_processors, _random_history

from python_backend_lib.core.options import DecodingOptions
from python_backend_lib.engine.graph_io import META_FOLLOWS, META_RULES, META_TOKEN, N_META
from python_backend_lib.engine.overlap import fed_inputs
from python_backend_lib.engine.prompt import Prompt
from python_backend_lib.engine.rows import Row
from python_backend_lib.engine.rules import N_RULE_FACTS, LogitRules, RuleFacts, sample

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":  # read when the kernels are decorated, at the module's first import
    os.environ["TRITON_INTERPRET"] = "1"
    assert "triton" not in sys.modules, "Triton was imported before its interpreter was asked for"
pytest.importorskip("triton")
step_kernels = importlib.import_module("python_backend_lib.engine.step_kernels")
ROWS = 12
# Also among the GPU tests (`scripts/gpu_run.sh tests`), where they run compiled.
pytestmark = pytest.mark.gpu


def _rows_and_logits(config, seed: int):
    """ROWS rows with random options and histories, their facts, their logits
    (timestamps made likely in a third of them, so the forcing rule fires), and
    transformers' processed scores for each."""
    rng = random.Random(seed)
    special = config.special
    logits = torch.randn(ROWS, config.dims.n_vocab, generator=torch.Generator().manual_seed(seed)) * 3
    logits[::3, special.timestamp_begin :] += 4.0
    logits = logits.half()  # as the GPU's output projection writes them
    facts, expected = [], []
    for b in range(ROWS):
        options = DecodingOptions(
            timestamps=rng.random() < 0.7,
            min_new_tokens=rng.choice([0, 0, 3]),
            max_initial_timestamp=rng.choice([1.0, 0.0, 2.5]),
        )
        prompt = (special.sot,) if options.timestamps else (special.sot, special.no_timestamps)
        row = Row(tag=b, options=options, prompt=Prompt(prompt, 0, False, "en"), slot=1, max_new_tokens=100, pending=[])
        row.generated = _random_history(rng, config, options.timestamps)
        facts.append(row.rule_facts(special.timestamp_begin))
        scores = logits[b : b + 1].float().clone()
        for processor in _hf_processors(config, len(prompt), options):
            scores = processor(torch.tensor([list(prompt) + row.generated]), scores)
        expected.append(scores[0])
    return torch.tensor(facts).T.contiguous(), logits, torch.stack(expected)


@pytest.mark.parametrize("config", [ENGLISH, MULTILINGUAL], ids=["tiny.en", "multilingual"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_fused_choice_equals_transformers_and_the_pytorch_rules(config, seed):
    facts, raw, expected = _rows_and_logits(config, seed)
    kernels = step_kernels.StepKernels(config, DEVICE)
    logits = torch.empty(raw.shape, dtype=torch.float32, device=DEVICE)
    picked = torch.zeros(3, ROWS, device=DEVICE)
    picks = torch.empty(ROWS, dtype=torch.long, device=DEVICE)
    kernels.choose(
        raw.to(DEVICE), facts.to(DEVICE), logits=logits, picks=picks,
        token_values=picked[0], logprobs=picked[1], no_speech=picked[2],
    )
    logits, picked, picks = logits.cpu(), picked.cpu(), picks.cpu()

    # transformers: the same tokens masked (the forcing rule included), the same greedy token.
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))
    assert picks.tolist() == expected.argmax(dim=-1).tolist()
    assert picked[0].long().tolist() == picks.tolist()
    # The PyTorch path: the same filtered logits, bit for bit; the same sums up to rounding.
    rules = LogitRules(config, torch.device("cpu"))
    reference = rules.apply(raw.float(), RuleFacts.from_table(facts))
    tokens, logprobs = sample(reference)
    assert torch.equal(logits, reference)
    assert picks.tolist() == tokens.tolist()
    torch.testing.assert_close(picked[1], logprobs, rtol=1e-5, atol=1e-5)
    no_speech = raw.float().softmax(dim=-1)[:, config.special.nospeech]
    torch.testing.assert_close(picked[2], no_speech, rtol=1e-4, atol=1e-9)
    # What was checked: rows forced to a timestamp, rows choosing text, rows choosing one freely.
    begin = config.special.timestamp_begin
    forced = torch.isinf(reference[:, :begin]).all(dim=1)
    assert forced.any() and (picks < begin).any() and ((picks >= begin) & ~forced).any()


def test_the_feed_kernel_equals_fed_inputs():
    """Rows that follow take the step before's pick as their token, and a timestamp pick
    as their last timestamp; the others keep what the host wrote."""
    begin = MULTILINGUAL.special.timestamp_begin
    rng = np.random.default_rng(3)
    rows = 13
    meta = np.zeros((N_META, rows), dtype=np.int64)
    meta[META_TOKEN] = rng.integers(0, 50000, rows)
    meta[META_FOLLOWS] = np.where(rng.random(rows) < 0.6, rng.integers(0, 20, rows), -1)
    meta[META_RULES:] = rng.integers(0, 2, (N_RULE_FACTS, rows))
    picks = np.where(rng.random(20) < 0.5, rng.integers(0, 50000, 20), rng.integers(begin, begin + 1500, 20))
    meta, picks = torch.from_numpy(meta), torch.from_numpy(picks)
    tokens, facts = fed_inputs(meta, picks, begin)
    kernels = step_kernels.StepKernels(MULTILINGUAL, DEVICE)
    fused_tokens, fused_facts = kernels.feed(meta.to(DEVICE), picks.to(DEVICE))
    assert fused_tokens.cpu().tolist() == tokens.tolist()
    assert fused_facts.cpu().tolist() == facts.tolist()
    followed = meta[META_FOLLOWS] >= 0
    assert followed.any() and (~followed).any() and (picks[meta[META_FOLLOWS][followed]] >= begin).any()
