"""The reference policy: one forward pass per generated token."""

from __future__ import annotations

from edgespec.decoding.sampling import Sampler
from edgespec.decoding.stats import StepStats
from edgespec.decoding.text import TextStream
from edgespec.decoding.types import GenerationRequest, TokenEvent
from edgespec.model.engine import Rows
from edgespec.model.runner import ModelRunner


class NaivePolicy:
    name = "naive"
    options = frozenset()

    async def started(self, request: GenerationRequest, model: ModelRunner, session) -> None:
        """Called once the session is open (a subclass configures it here)."""

    def summary(self, model: ModelRunner, session) -> dict:
        """Figures of the session to add to the final statistics (on the model thread)."""
        return {}

    async def generate(self, request: GenerationRequest, model: ModelRunner, tokenizer):
        sampler = await model.call(Sampler, request.sampling, model.cfg.vocab_size)
        text = TextStream(tokenizer, request.stop, request.stop_token_ids, request.max_tokens)
        stats = StepStats(self.name)
        session = await model.open(len(request.prompt_ids) + request.max_tokens, prompt=request.prompt_ids)
        stats.session = session
        stats.cached_prompt_tokens = session.length
        try:
            await self.started(request, model, session)
            async for event in model.engine.run(session, self.program(request, model, session, sampler, text, stats)):
                yield event
        finally:
            await model.release(session)

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
