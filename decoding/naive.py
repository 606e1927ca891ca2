"""The reference policy: one forward pass per generated token."""

from __future__ import annotations

from edgespec.decoding.sampling import Sampler
from edgespec.decoding.sequence import Prepared, run_alone, start
from edgespec.decoding.stats import StepStats
from edgespec.decoding.text import TextStream
from edgespec.decoding.types import GenerationRequest, TokenEvent
from edgespec.model.engine import Rows
from edgespec.model.runner import ModelRunner


class NaivePolicy:
    name = "naive"
    options = frozenset()

    def check(self, options: dict) -> None:
        """No options to check."""

    def summary(self, model: ModelRunner, session) -> dict:
        """Figures of the session to add to the final statistics (on the model thread)."""
        return {}

    def capacity(self, request: GenerationRequest, model: ModelRunner) -> int:
        return len(request.prompt_ids) + request.max_tokens

    async def prepare(self, request: GenerationRequest, model: ModelRunner, tokenizer, session):
        sampler, text, stats = await start(self.name, request, model, tokenizer, session)
        return Prepared(self.program(request, model, session, sampler, text, stats), stats, text)

    def generate(self, request: GenerationRequest, model: ModelRunner, tokenizer):
        return run_alone(self, request, model, tokenizer)

    def program(self, request: GenerationRequest, model: ModelRunner, session, sampler: Sampler, text: TextStream,
                stats: StepStats):
        """The engine's program (model/engine.py): the prompt, then one row per step, each sampled."""
        out = yield Rows(request.prompt_ids[session.length:], last_only=True)
        while True:
            token, logprob = sampler.choose_with_logprob(out.logits[0, -1])  # logits [1, 1, V]
            pushed = text.push(token)
            stats.tokens_emitted(1, model.wire(session))
            logprobs = [logprob] if logprob else []
            if pushed.finish_reason:
                final = stats.as_dict(model.wire(session)) | self.summary(model, session)
                yield TokenEvent([token], pushed.text, pushed.finish_reason, logprobs, final)
                return
            yield TokenEvent([token], pushed.text, None, logprobs)
            out = yield Rows([token])
