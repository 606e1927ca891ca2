"""The `auto` policy: per request, outline decoding where the router says the prompt suits it (a chat question
whose answer is a list of independent points, and no tools or response format constrain the answer), else
the server's default policy."""

from __future__ import annotations

from edgespec.decoding.router import route
from edgespec.decoding.types import GenerationRequest
from edgespec.model.runner import ModelRunner


class AutoPolicy:
    name = "auto"
    options = frozenset({"question"})

    def __init__(self, outline, default):
        """outline: the outline policy; default: the policy for everything else."""
        self.outline, self.default = outline, default

    def check(self, options: dict) -> None:
        """`question` is checked as every policy's (server/service.py)."""

    async def generate(self, request: GenerationRequest, model: ModelRunner, tokenizer):
        question = request.policy_options.get("question")
        if request.grammar is not None:
            # outline writes its own skeleton and expansions: it cannot keep to a grammar
            suits, reason = False, "tools or a response format"
        else:
            suits, reason = route(question) if question else (False, "not a chat request")
        chosen = self.outline if suits else self.default
        async for event in chosen.generate(request, model, tokenizer):
            if event.stats is not None:
                event.stats = {**event.stats, "auto": {"chose": chosen.name, "router": reason}}
            yield event
