"""Whisper's decoding rules, checked against transformers' logits processors
row by row, and the pure pieces around them (options, prompts, segments)."""

from __future__ import annotations

import random

import pytest
import torch
from reference import hf_processors, random_history

from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import MAX_PROMPT_TOKENS, DecodingOptions, Task
from python_backend_lib.core.segments import Segment
from python_backend_lib.engine.draws import draw_key, uniform, window_seed
from python_backend_lib.engine.prompt import Prompt, initial_tokens
from python_backend_lib.engine.rows import Row
from python_backend_lib.engine.rules import N_RULE_FACTS, LogitRules, RuleFacts, sample
from python_backend_lib.text.tokenizer import load_tokenizer

ENGLISH = load_config("default")
MULTILINGUAL = load_config("random:tiny")


@pytest.mark.parametrize("config", [ENGLISH, MULTILINGUAL], ids=["tiny.en", "multilingual"])
def test_vectorised_rules_equal_transformers_processors(config):
    rng = random.Random(5)
    rules = LogitRules(config, torch.device("cpu"))
    special = config.special
    for trial in range(12):
        rows, expected = [], []
        logits = torch.randn(8, config.dims.n_vocab, generator=torch.Generator().manual_seed(trial)) * 3
        # Make timestamps competitive so the probability-mass rule fires in some rows.
        logits[: 4, special.timestamp_begin :] += rng.choice([0.0, 4.0])
        for b in range(8):
            options = DecodingOptions(
                timestamps=rng.random() < 0.7,
                min_new_tokens=rng.choice([0, 0, 3]),
                max_initial_timestamp=rng.choice([1.0, 0.0, 2.5]),
            )
            prompt = (special.sot,) if options.timestamps else (special.sot, special.no_timestamps)
            history = random_history(rng, config, options.timestamps)
            row = Row(tag=b, options=options, prompt=Prompt(prompt, 0, False, "en"), slot=1, max_new_tokens=100, pending=[])
            row.generated = history
            rows.append(row)
            ids = torch.tensor([list(prompt) + history])
            scores = logits[b : b + 1].clone()
            for processor in hf_processors(config, len(prompt), options):
                scores = processor(ids, scores)
            expected.append(scores[0])
        table = torch.tensor([row.rule_facts(special.timestamp_begin) for row in rows]).T
        assert table.shape[0] == N_RULE_FACTS
        ours = rules.apply(logits.clone(), RuleFacts.from_table(table))
        expected = torch.stack(expected)
        assert torch.equal(torch.isinf(ours), torch.isinf(expected)), f"trial {trial}"
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_initial_tokens_english_only():
    special = ENGLISH.special
    assert initial_tokens(ENGLISH, DecodingOptions(), None).tokens == (special.sot, special.no_timestamps)
    assert initial_tokens(ENGLISH, DecodingOptions(timestamps=True), None).tokens == (special.sot,)
    tokenizer = load_tokenizer(ENGLISH)
    prompt = initial_tokens(ENGLISH, DecodingOptions(prompt="  Hello there. "), tokenizer)
    assert prompt.tokens[0] == special.startofprev
    assert tokenizer.decode(prompt.tokens[1 : prompt.sot_index]) == " Hello there."
    assert prompt.tokens[prompt.sot_index :] == (special.sot, special.no_timestamps)


def test_initial_tokens_multilingual():
    special = MULTILINGUAL.special
    french = initial_tokens(MULTILINGUAL, DecodingOptions(language="fr", task=Task.TRANSLATE), None)
    assert french.tokens == (special.sot, special.language_token("fr"), special.translate, special.no_timestamps)
    detect = initial_tokens(MULTILINGUAL, DecodingOptions(), None)
    assert detect.tokens == (special.sot,) and detect.detect_language


@pytest.mark.parametrize(
    "config, options, message, client_fault",
    [
        (ENGLISH, DecodingOptions(language="fr"), r"English-only; 'fr' needs a multilingual one: serve a "
         r"multilingual checkpoint \(whisper-triton serve --checkpoint base\)", True),
        (ENGLISH, DecodingOptions(task="translate"), r"translate.*whisper-triton serve --checkpoint base", True),
        # A language Whisper does not know is unknown, whatever the checkpoint.
        (ENGLISH, DecodingOptions(language="klingon"), "unknown language 'klingon': Whisper's languages are", True),
        (MULTILINGUAL, DecodingOptions(language="xx"), "unknown language 'xx'", True),
        # The checkpoint lacks a tokenizer: the server's setup, not the request, is at fault.
        (MULTILINGUAL, DecodingOptions(prompt="hi"), "tokenizer", False),
    ],
)
def test_options_that_do_not_fit_the_model(config, options, message, client_fault):
    with pytest.raises(ValueError, match=message) as caught:
        initial_tokens(config, options, None)
    assert isinstance(caught.value, RequestError) == client_fault


def test_prompt_too_long_is_refused():
    tokenizer = load_tokenizer(ENGLISH)
    with pytest.raises(RequestError, match=f"at most {MAX_PROMPT_TOKENS}"):
        initial_tokens(ENGLISH, DecodingOptions(prompt="word " * 400), tokenizer)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"task": "summarize"}, "task must be one of"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 449}, "max_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"language": ""}, "language"),
        ({"max_initial_timestamp": 31}, "max_initial_timestamp"),
    ],
)
def test_bad_options_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodingOptions(**kwargs)


def test_segments_from_timestamp_tokens():
    tokenizer = load_tokenizer(ENGLISH)
    begin = ENGLISH.special.timestamp_begin
    hello, world = tokenizer.encode(" Hello"), tokenizer.encode(" world.")
    tokens = [begin, *hello, begin + 100, begin + 100, *world, begin + 250]
    # Each segment keeps the timestamps around its text, as openai-whisper's do.
    assert tokenizer.segments(tokens, duration=6.0) == (
        Segment(0.0, 2.0, "Hello", (begin, *hello, begin + 100)),
        Segment(2.0, 5.0, "world.", (begin + 100, *world, begin + 250)),
    )
    # An unclosed last segment runs to the end of the audio; offsets shift times.
    assert tokenizer.segments([begin + 50, *hello], duration=4.0, offset=30.0) == (
        Segment(31.0, 34.0, "Hello", (begin + 50, *hello)),
    )
    # Without timestamps: one segment over the whole audio.
    assert tokenizer.segments([*hello, *world], duration=3.5) == (
        Segment(0.0, 3.5, "Hello world.", tuple(hello + world)),
    )
    assert tokenizer.timestamp_seconds(begin + 1500) == 30.0


def test_a_row_at_a_temperature_draws_each_token_with_its_probability():
    """`sample` at t = 1 over 40,000 rows of one distribution, each with its own key: each
    token's share within five standard errors of its probability, a masked token never drawn."""
    probabilities = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probabilities.log().expand(40_000, -1).contiguous()
    keys = torch.tensor([draw_key(7, 0, i) for i in range(40_000)])
    tokens, logprobs = sample(logits, torch.ones(40_000), keys)
    shares = torch.bincount(tokens, minlength=5).double() / 40_000
    errors = (probabilities * (1 - probabilities) / 40_000).sqrt().double()
    assert ((shares - probabilities.double()).abs() <= 5 * errors + 1e-12).all(), shares
    assert shares[4] == 0
    assert torch.allclose(logprobs, probabilities.log()[tokens])
    # At t = 0 the same rows take the likeliest token.
    assert (sample(logits[:10], torch.zeros(10), keys[:10])[0] == 0).all()


def test_a_draw_depends_on_its_key_alone():
    """The same key draws the same token whatever rows share the batch; other seeds,
    streams and token indices draw apart; the key is the same bits on every device."""
    logits = torch.randn(1, 51_865, generator=torch.Generator().manual_seed(3))
    key = draw_key(window_seed(0, 0, 1), 0, 5)
    alone = sample(logits, torch.ones(1), torch.tensor([key]))[0]
    crowd = torch.cat([torch.randn(7, 51_865), logits])
    keys = torch.tensor([draw_key(9, s, 2) for s in range(7)] + [key])
    assert sample(crowd, torch.ones(8), keys)[0][-1] == alone
    others = {draw_key(window_seed(seed, seek, attempt), stream, index)
              for seed in (0, 1) for seek in (0, 3000) for attempt in (1, 2) for stream in (0, 1) for index in (0, 1)}
    assert len(others) == 32  # no two of the draws share a key
    drawn = {int(sample(logits, torch.ones(1), torch.tensor([k]))[0]) for k in others}
    assert len(drawn) > 25  # at t = 1 over a near-flat distribution, nearly every key draws its own token
    assert draw_key(1, 2, 3) == 0xC8AE9523  # pinned: a change of the hash changes every seeded transcript
    assert torch.equal(uniform(torch.tensor([key]), 4), uniform(torch.tensor([key]), 8)[:, :4])


def test_a_seed_outside_32_bits_is_refused_naming_it():
    for bad in (-1, 2**32, 1.5, True):
        with pytest.raises(RequestError, match="seed must be an integer"):
            DecodingOptions(seed=bad)


def test_a_row_without_a_finite_distribution_is_sampled_without_failing():
    """Every token masked (or an overflow to inf) once tripped torch.multinomial's assert,
    which on a GPU ends the process's CUDA context (found by the GPU soak on random
    weights): such a row takes its likeliest token, and the rows beside it still draw."""
    logits = torch.tensor([[float("-inf")] * 4, [0.0, float("inf"), 1.0, 2.0], [0.0, 0.0, 50.0, 0.0]])
    tokens, _ = sample(logits, torch.tensor([1.0, 0.5, 1.0]), torch.tensor([1, 2, 3]))
    assert tokens.tolist()[1:] == [1, 2]
    assert 0 <= tokens[0] < 4
