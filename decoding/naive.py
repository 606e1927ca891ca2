"""The reference policy: one forward pass per generated token."""

from __future__ import annotations

from edgespec.decoding.sampling import Sampler
from edgespec.decoding.sequence import Prepared, run_alone
from edgespec.decoding.stats import StepStats
from edgespec.decoding.text import TextStream
from edgespec.decoding.types import GenerationRequest, TokenEvent
from edgespec.model.engine import Rows
from edgespec.model.runner import ModelRunner


class NaivePolicy:
    name = "naive"
    options = frozenset()

    def summary(self, model: ModelRunner, session) -> dict:
        """Figures of the session to add to the final statistics (on the model thread)."""
        return {}

    def capacity(self, request: GenerationRequest, model: ModelRunner) -> int:
        return len(request.prompt_ids) + request.max_tokens

    async def prepare(self, request: GenerationRequest, model: ModelRunner, tokenizer, session):
        sampler = await model.call(Sampler, request.sampling, model.cfg.vocab_size)
        text = TextStream(tokenizer, request.stop, request.stop_token_ids, request.max_tokens)
        stats = StepStats(self.name)
        stats.session = session
        stats.cached_prompt_tokens = session.length
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
