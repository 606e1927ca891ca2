"""Outline decoding (Skeleton-of-Thought as Jupiter uses it): the model writes a short numbered outline, then
every point is expanded as its own sequence, all points decoding together as one batch after their shared
prompt (decoding/outline_batch.py), so each forward pass produces one token for every unfinished point.

The answer is the points in order, each "N. point: " followed by its expansion. Point 1 streams as it is
generated; each later point is held back until every earlier one is complete. `max_tokens` bounds the
expansions together (each point gets an equal share, at most `point_tokens`); usage counts every generated
token, the outline's included. A request without a chat question, or whose outline cannot be parsed, is
decoded by the fallback policy instead, and the `decoding` object says why.
"""

from __future__ import annotations

from decoding.naive import NaivePolicy
from decoding.outline_batch import expand
from decoding.outline_text import expansion_messages, outline_messages, parse_outline
from decoding.sampling import Sampler
from decoding.stats import StepStats
from decoding.text import TextStream
from decoding.types import GenerationRequest, TokenEvent
from model.runner import ModelRunner


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` in the model's chat template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def common_prefix(seqs: list[list[int]]) -> int:
    """Length of the longest prefix all sequences share."""
    columns = enumerate(zip(*seqs, strict=False))  # up to the shortest
    return next((i for i, column in columns if len(set(column)) > 1), min(map(len, seqs)))


class OutlinePolicy:
    name = "outline"
    options = frozenset({"outline_tokens", "point_tokens"})

    def __init__(self, fallback=None, outline_tokens: int = 96, point_tokens: int = 64):
        """fallback: the policy for requests outline cannot serve (default: naive)."""
        self.fallback = fallback or NaivePolicy()
        self.outline_tokens, self.point_tokens = outline_tokens, point_tokens

    def check(self, options: dict) -> None:
        """Raise ValueError for option values this policy cannot use."""
        for key in ("outline_tokens", "point_tokens"):
            value = options.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1024:
                raise ValueError(f"{key} must be an integer from 1 to 1024, got {value!r}")

    async def _fall_back(self, request: GenerationRequest, model, tokenizer, reason: str, outline_tokens: int = 0):
        async for event in self.fallback.generate(request, model, tokenizer):
            if event.stats is not None:
                event.stats = {**event.stats, "policy": self.name, "outline": {
                    "fallback": reason, "fallback_policy": self.fallback.name, "outline_tokens": outline_tokens}}
            yield event

    async def generate(self, request: GenerationRequest, model: ModelRunner, tokenizer):
        options = request.policy_options
        if not request.question:
            async for event in self._fall_back(request, model, tokenizer, "not a chat request"):
                yield event
            return
        stats = StepStats(self.name)
        # 1. the outline, decoded as naive would (the request's sampling), not streamed
        outline_prompt = chat_ids(tokenizer, outline_messages(request.question))
        sub = GenerationRequest(outline_prompt, options.get("outline_tokens", self.outline_tokens),
                                request.sampling, (), request.stop_token_ids)
        outline_ids = [t async for e in NaivePolicy().generate(sub, model, tokenizer) for t in e.token_ids]
        points = parse_outline(tokenizer.decode(outline_ids, skip_special_tokens=True))
        if not points:
            async for event in self._fall_back(request, model, tokenizer, "the outline could not be parsed",
                                               len(outline_ids)):
                yield event
            return
        # 2. every point expanded in one batch after the prompt they share
        heads = [f"{i + 1}. {p}: " for i, p in enumerate(points)]
        prompts = [chat_ids(tokenizer, expansion_messages(request.question, points, i)) for i in range(len(points))]
        shared = common_prefix(prompts)
        share = max(1, min(options.get("point_tokens", self.point_tokens), request.max_tokens // len(points)))
        samplers = [await model.call(Sampler, request.sampling, model.cfg.vocab_size) for _ in points]
        texts = [TextStream(tokenizer, request.stop, request.stop_token_ids, share) for _ in points]
        pending: list[list[tuple[int, str]]] = [[] for _ in points]  # per point: (token, text) not sent yet
        shown, header_due = 0, True  # points sent completely; whether the next one's "N. point" is unsent
        carry = list(outline_ids)  # generated too: counted in usage with the first event, not shown
        passes = expanded = 0  # batched forward passes, and the tokens they produced

        def choose(row, logits):  # model thread
            return samplers[row].choose(logits)

        async for step in expand(model, prompts[0][:shared], [p[shared:] for p in prompts], [share] * len(points),
                                 choose, request.stop_token_ids):
            passes += 1
            expanded += len(step)
            for row, token in step:
                if not texts[row].finished:  # a stop string ends a point before the batch retires its row
                    pending[row].append((token, texts[row].push(token).text))
            ids, parts = list(carry), []
            while shown < len(points):  # the next point to show grows; finished ones follow in order
                if header_due:
                    parts.append(heads[shown])
                    header_due = False
                ids += [t for t, _ in pending[shown]]
                parts += [text for _, text in pending[shown]]
                pending[shown] = []
                if not texts[shown].finished:
                    break
                parts.append("\n")
                shown, header_due = shown + 1, True
            if ids or parts:
                carry = []
                stats.tokens_emitted(len(ids), {})
                yield TokenEvent(ids, "".join(parts))
        final = stats.as_dict({})
        # a step is one batched pass: it produced a token for every point still expanding
        final.update(steps=passes, tokens_per_step=round(expanded / passes, 4) if passes else None)
        final["outline"] = {"points": len(points), "outline_tokens": len(outline_ids), "point_tokens": share}
        yield TokenEvent([], "", "stop", [], final)
