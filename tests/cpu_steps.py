"""The decode-graph table's interface, computed eagerly on the CPU, for tests of the
scheduling around it (which rows a step holds, the tokens written in at launch,
results handled a step late) where there is no GPU.

`CpuStepTable` takes what `cuda_graphs.DecodeGraphs` takes (a step's `StepInputs`,
staged into the same metadata rows) and computes what the captured step computes
(the tokens of following rows fed from the step before's picks, the decoder over
one token per row, the tied projection, the no-speech probability, the language,
Whisper's rules, the pick, draws at a temperature),
through PyTorch SDPA instead of FlashInfer, and runs of `run_steps` steps (`overlap`)
as the captured runs make them: each step after the first with every row following
itself one position further. `launch` runs the step at once: on the CPU there is
nothing to overlap, only the order of the host's work to check. The real table runs
on a GPU in tests/gpu/test_gpu.py.
"""

from __future__ import annotations

import numpy as np
import torch

from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.engine.attention import SdpaAttention, StepLayout
from python_backend_lib.engine.graph_io import (
    META_FOLLOWS,
    META_POSITION,
    META_RULES,
    META_TOKEN,
    N_META,
    GraphStep,
    Prepared,
    StepInputs,
)
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.overlap import fed_inputs
from python_backend_lib.engine.rules import N_RULE_FACTS, LogitRules, RuleFacts, sample


class _Done:
    def __init__(self, steps: list[GraphStep]) -> None:
        self._steps = steps

    def result(self) -> GraphStep:
        (step,) = self._steps
        return step

    def results(self) -> list[GraphStep]:
        return self._steps


class CpuStepTable:
    def __init__(
        self, model: Whisper, config: ModelConfig, attention: SdpaAttention, *, max_batch: int, run_steps: int = 1
    ) -> None:
        self.model, self.config, self.attention = model, config, attention
        self.max_batch = max_batch
        self.run_steps = run_steps
        self.rules = LogitRules(config, torch.device("cpu"))
        self.picks = torch.zeros(max_batch, dtype=torch.long)  # the last step's tokens, as on the device
        self.carried = torch.zeros(N_RULE_FACTS, max_batch, dtype=torch.long)  # and the facts it ran with
        self.launches = 0
        self.run_launches = 0

    def fits(self, n: int) -> bool:
        return 1 <= n <= self.max_batch

    def fits_run(self, n: int) -> bool:
        return self.run_steps > 1 and self.fits(n)

    def prepare(self, inputs: StepInputs) -> Prepared:
        n = len(inputs.slots)
        if not self.fits(n):
            raise ValueError(f"{n} rows do not fit the largest batch {self.max_batch}")
        staged = torch.zeros(N_META, n, dtype=torch.long)
        st = staged.numpy()
        st[META_TOKEN] = inputs.tokens
        st[META_POSITION] = inputs.positions
        st[META_FOLLOWS] = inputs.follows
        st[META_RULES:] = inputs.facts
        return Prepared(entry=None, inputs=inputs, pinned=staged)

    @torch.inference_mode()
    def launch(self, prepared: Prepared, *, keep_logits: bool = False) -> _Done:
        self.launches += 1
        inputs, meta = prepared.inputs, prepared.pinned.clone()  # as the device copy of the staging
        if inputs.steps == 1:
            return _Done([self._step(inputs, meta, keep_logits)])
        assert inputs.steps == self.run_steps and (inputs.follows >= 0).all() and not inputs.temperatures.any()
        self.run_launches += 1
        steps = [self._step(inputs, meta, keep_logits=False)]
        for _ in range(1, inputs.steps):
            meta = meta.clone()
            meta[META_POSITION] += 1
            meta[META_FOLLOWS] = torch.arange(meta.shape[1])
            steps.append(self._step(inputs, meta, keep_logits=False))
        return _Done(steps)

    def _step(self, inputs: StepInputs, meta: torch.Tensor, keep_logits: bool) -> GraphStep:
        n = len(inputs.slots)
        layout = StepLayout(
            slots=torch.from_numpy(inputs.slots.copy()),
            query_lens=(1,) * n,
            cached_lens=tuple(meta[META_POSITION].tolist()),
            slot_ids=tuple(inputs.slots.tolist()),
        )
        fed, facts = fed_inputs(meta, self.picks, self.carried, self.config.special.timestamp_begin)
        self.carried[:, :n] = facts
        raw = self.model.decode_step(fed, layout, self.attention, torch.arange(n))
        special = self.config.special
        no_speech = raw.softmax(dim=-1)[:, special.nospeech]
        languages = None
        if self.config.multilingual:
            best = raw[:, list(special.language_tokens)].float().softmax(dim=-1).max(dim=-1)
            languages = list(zip(best.indices.tolist(), best.values.tolist()))
        logits = self.rules.apply(raw, RuleFacts.from_table(facts))
        tokens, logprobs = sample(logits)
        hot = np.flatnonzero(inputs.temperatures > 0)
        if len(hot):
            index = torch.from_numpy(hot)
            drawn, drawn_logprobs = sample(logits[index], torch.from_numpy(inputs.temperatures[hot]).float(),
                                           torch.from_numpy(inputs.draw_keys[hot]))
            tokens[index], logprobs[index] = drawn, drawn_logprobs
        self.picks[:n] = tokens
        return GraphStep(
            tokens=tokens.tolist(),
            logprobs=logprobs.tolist(),
            no_speech=no_speech.tolist(),
            languages=languages,
            logits=logits.clone() if keep_logits else None,
        )
