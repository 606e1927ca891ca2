"""The reference policy: one forward pass per generated token."""

from __future__ import annotations

from edgespec.decoding.sampling import Sampler
from edgespec.decoding.sequence import Prepared, run_alone, start
from edgespec.decoding.stats import StepStats
from edgespec.decoding.text import TextStream
from edgespec.decoding.types import GenerationRequest, TokenEvent
from edgespec.engine.engine import Engine
from edgespec.engine.program import Rows, SequenceView
from edgespec.model.config import ModelConfig


class NaivePolicy:
    name = "naive"
    options: frozenset[str] = frozenset()
    lane = "layers"  # the engine's lane its jobs run on

    def check(self, options: dict) -> None:
        """Raise ValueError for option values this policy cannot use (it takes none)."""

    def capacity(self, request: GenerationRequest, cfg: ModelConfig) -> int:
        return len(request.prompt_ids) + request.max_tokens

    def prepare(self, request: GenerationRequest, cfg: ModelConfig, seq: SequenceView, text: TextStream
                ) -> Prepared:
        sampler, stats = start(self.name, request, cfg, seq)
        return Prepared(self.program(request, seq, sampler, text, stats), stats)

    def generate(self, request: GenerationRequest, engine: Engine, tokenizer):
        return run_alone(self, request, engine, tokenizer)

    def program(self, request: GenerationRequest, seq: SequenceView, sampler: Sampler, text: TextStream,
                stats: StepStats):
        """The engine's program (engine/engine.py): the prompt, then one row per step, each sampled."""
        out = yield Rows(request.prompt_ids[seq.length:], last_only=True)
        while True:
            token, logprob = sampler.choose_with_logprob(out.logits[0, -1])  # logits [1, 1, V]
            pushed = text.push(token)
            stats.tokens_emitted(1, seq.wire())
            logprobs = [logprob] if logprob else []
            if pushed.finish_reason:
                final = stats.as_dict(seq.wire()) | seq.figures()
                yield TokenEvent([token], pushed.text, pushed.finish_reason, logprobs, final)
                return
            yield TokenEvent([token], pushed.text, None, logprobs)
            out = yield Rows([token])
