"""Outline decoding (Skeleton-of-Thought as Jupiter uses it): the model writes a short numbered outline, then
every point is expanded as its own sequence, all points decoding together as one batch after their shared
prompt (decoding/outline_batch.py), so each forward pass produces one token for every unfinished point.

The answer is the points in order, each "N. point: " followed by its expansion. Point 1 streams as it is
generated; each later point is held back until every earlier one is complete. `max_tokens` bounds the
expansions together (each point gets an equal share, at most `point_tokens`); usage counts every generated
token, the outline's included. A request without a chat question, or whose outline cannot be parsed, is
decoded by the fallback policy instead, and the `decoding` object says why.

With `{"verify": "medusa"}` or `"speculative"` (Jupiter combines outline with draft-and-verify), the outline is
decoded by that policy and each batched pass also verifies candidate continuations for the points
(decoding/outline_verify.py), exactly: every point still gets the tokens it would get alone.
"""

from __future__ import annotations

from contextlib import aclosing
from itertools import zip_longest

from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.outline_batch import expand
from edgespec.decoding.outline_text import cut_outline, expansion_messages, outline_messages, parse_outline
from edgespec.decoding.outline_verify import MedusaRows, NgramRows, RootOnly
from edgespec.decoding.sampling import Sampler
from edgespec.decoding.stats import StepStats
from edgespec.decoding.text import TextStream
from edgespec.decoding.types import GenerationRequest, TokenEvent
from edgespec.model.runner import ModelRunner


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` in the model's chat template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


class WireTally:
    """A ModelRunner seen through a tally: the wire counts of every session released through it are summed, so
    a policy that runs several sessions (the outline's, the prompt the points share, their batch) reports them
    all."""

    def __init__(self, model: ModelRunner):
        self.model, self.totals = model, {}

    def __getattr__(self, name):
        return getattr(self.model, name)

    async def release(self, session) -> None:
        for link, (nbytes, requests) in self.model.wire(session).items():
            b, n = self.totals.get(link, (0, 0))
            self.totals[link] = (b + nbytes, n + requests)
        await self.model.release(session)


def common_prefix(seqs: list[list[int]]) -> int:
    """Length of the longest prefix all sequences share."""
    columns = enumerate(zip(*seqs, strict=False))  # up to the shortest
    return next((i for i, column in columns if len(set(column)) > 1), min(map(len, seqs)))


class OutlinePolicy:
    name = "outline"
    options = frozenset({"outline_tokens", "point_tokens", "verify", "pass_tokens", "question"})

    def __init__(self, fallback=None, outline_tokens: int = 96, point_tokens: int = 64, verifiers: dict | None = None,
                 pass_tokens: int = 8):
        """fallback: the policy for requests outline cannot serve (default: naive); verifiers: the `medusa` and
        `speculative` policies a request may compose with (option `verify`): the outline is then decoded by
        that policy, and the points' batched expansion verifies candidates of the same kind (Medusa's heads;
        n-gram lookup for `speculative`, whose model drafters draft one sequence at a time), at most
        `pass_tokens` tokens per pass."""
        self.fallback = fallback or NaivePolicy()
        self.outline_tokens, self.point_tokens, self.pass_tokens = outline_tokens, point_tokens, pass_tokens
        self.verifiers = {"none": NaivePolicy(), **(verifiers or {})}

    def check(self, options: dict) -> None:
        """Raise ValueError for option values this policy cannot use."""
        for key in ("outline_tokens", "point_tokens", "pass_tokens"):
            value = options.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1024:
                raise ValueError(f"{key} must be an integer from 1 to 1024, got {value!r}")
        question = options.get("question", "")
        if not isinstance(question, str) or len(question) > 16384:
            raise ValueError("question must be a string of at most 16384 characters")
        verify = options.get("verify", "none")
        if verify not in self.verifiers:
            raise ValueError(f"verify must be one of {', '.join(sorted(self.verifiers))}, got {verify!r}")
        if hasattr(self.verifiers[verify], "check"):
            self.verifiers[verify].check({})

    def _proposer(self, verify: str, rows: int, pass_tokens: int):
        policy = self.verifiers[verify]
        if verify == "medusa":
            return MedusaRows(policy.heads, policy.heads.tree, pass_tokens)
        if verify == "speculative":
            return NgramRows(rows, policy.k, pass_tokens)
        return RootOnly()

    async def _fall_back(self, request: GenerationRequest, model, tokenizer, reason: str,
                         outline_ids: list[int] | None = None):
        carry = list(outline_ids or [])  # the unusable outline was generated too: counted in usage, not shown
        async for event in self.fallback.generate(request, model, tokenizer):
            event.token_ids, carry = carry + event.token_ids, []
            if event.stats is not None:
                event.stats = {**event.stats, "policy": self.name, "outline": {
                    "fallback": reason, "fallback_policy": self.fallback.name,
                    "outline_tokens": len(outline_ids or [])}}
            yield event

    async def generate(self, request: GenerationRequest, model: ModelRunner, tokenizer):
        options = request.policy_options
        question = options.get("question")  # the chat's last user message (the service sets it), or the client's
        if not question:
            async for event in self._fall_back(request, model, tokenizer, "not a chat request"):
                yield event
            return
        stats = StepStats(self.name)
        verify = options.get("verify", "none")
        model = WireTally(model)
        # 1. the outline, decoded by the verification policy (the request's sampling), not streamed, until done
        outline_prompt = chat_ids(tokenizer, outline_messages(question))
        sub = GenerationRequest(outline_prompt, options.get("outline_tokens", self.outline_tokens),
                                request.sampling, (), request.stop_token_ids, verify)
        outline_ids, text = [], ""
        async with aclosing(self.verifiers[verify].generate(sub, model, tokenizer)) as events:
            async for event in events:
                outline_ids += event.token_ids
                text = tokenizer.decode(outline_ids, skip_special_tokens=True)
                cut = cut_outline(text)
                if cut is not None:  # the outline is over (it repeats itself, or prose follows): stop there
                    text = cut
                    break
        points = parse_outline(text)
        if not points:
            async for event in self._fall_back(request, model.model, tokenizer, "the outline could not be parsed",
                                               outline_ids):
                yield event
            return
        # 2. every point expanded in one batch after the prompt they share
        heads = [f"{i + 1}. {p}: " for i, p in enumerate(points)]
        prompts = [chat_ids(tokenizer, expansion_messages(question, points, i)) for i in range(len(points))]
        shared = common_prefix(prompts)
        share = max(1, min(options.get("point_tokens", self.point_tokens), request.max_tokens // len(points)))
        samplers = [await model.call(Sampler, request.sampling, model.cfg.vocab_size) for _ in points]
        texts = [TextStream(tokenizer, request.stop, request.stop_token_ids, share) for _ in points]
        pending: list[list[tuple[int, str, object]]] = [[] for _ in points]  # per point: (token, text, logprob)
        shown, header_due = 0, True  # points sent completely; whether the next one's "N. point" is unsent
        carry = list(outline_ids)  # generated too: counted in usage with the first event, not shown
        passes = expanded = 0  # batched forward passes, and the tokens they produced
        proposer = self._proposer(verify, len(points), options.get("pass_tokens", self.pass_tokens))
        async for step in expand(model, prompts[0][:shared], [p[shared:] for p in prompts], [share] * len(points),
                                 samplers, request.stop_token_ids, proposer, stats):
            passes += 1
            for row, tokens, lps in step:
                expanded += len(tokens)
                for token, lp in zip_longest(tokens, lps):
                    if not texts[row].finished:  # a stop string ends a point before the batch retires its row
                        pending[row].append((token, texts[row].push(token).text, lp))
            ids, parts, logprobs = list(carry), [], []
            while shown < len(points):  # the next point to show grows; finished ones follow in order
                if header_due:
                    parts.append(heads[shown])
                    header_due = False
                for token, text, lp in pending[shown]:
                    ids.append(token)
                    parts.append(text)
                    logprobs += [lp] if lp else []
                pending[shown] = []
                if not texts[shown].finished:
                    break
                parts.append("\n")
                shown, header_due = shown + 1, True
            if ids or parts:
                carry = []
                stats.tokens_emitted(len(ids), {})
                yield TokenEvent(ids, "".join(parts), None, logprobs)
        final = stats.as_dict(model.totals)
        # a step is one batched pass: it produced a token (or more) for every point still expanding
        final.update(steps=passes, tokens_per_step=round(expanded / passes, 4) if passes else None)
        final["outline"] = {"points": len(points), "outline_tokens": len(outline_ids), "point_tokens": share,
                            "verify": verify, "expanded_tokens": expanded}
        yield TokenEvent([], "", "stop", [], final)
