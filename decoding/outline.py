"""Outline decoding (Skeleton-of-Thought as Jupiter uses it): the model writes a short numbered outline, then
every point is expanded as a sequence of its own, all points decoding in the engine's shared steps beside any
other request, started in the same step. The prompt the points share is computed once, kept by the prefix
cache (engine/prefix.py), and every point starts from its blocks, held once.

The answer is the points in order, each "N. point: " followed by its expansion. Point 1 streams as it is
generated; each later point is held back until every earlier one is complete. The expansions share one
budget, min(max_tokens, points * point_tokens) (decoding/outline_points.py): a point that ends early leaves
its tokens to the others, and a point past its share ends at a sentence end. Usage counts every generated
token, the outline's included. A request without a chat question, or whose outline cannot be parsed, is
decoded by the fallback policy instead, and the `decoding` object says why.

With `{"verify": "medusa"}` or `"speculative"` (Jupiter combines outline with draft-and-verify), the outline
and every point are decoded by that policy, exactly: every point gets the tokens it would get alone. A step
then holds about `pass_tokens` tokens of the points' candidates together (Medusa's trees sized anew each step
by the sequences in it, a draft length of pass_tokens / points), since on a CPU a pass costs about linearly
in its tokens.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import replace
from functools import partial

from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.outline_points import SharedBudget
from edgespec.decoding.outline_text import cut_outline, expansion_messages, outline_messages, parse_outline
from edgespec.decoding.sequence import Prepared, job, text_stream
from edgespec.decoding.stats import StepStats
from edgespec.decoding.types import GenerationRequest, TokenEvent
from edgespec.engine.engine import Engine
from edgespec.engine.program import Job, Rows, SequenceView


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` in the model's chat template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def add_wire(totals: dict, wire: dict) -> None:
    """Add a sequence's (bytes, requests) per link to `totals`: outline reports every sequence it ran."""
    for link, (nbytes, requests) in wire.items():
        b, n = totals.get(link, (0, 0))
        totals[link] = (b + nbytes, n + requests)


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
        `speculative` policies a request may compose with (option `verify`): the outline and every point are
        then decoded by that policy, the points' candidates at most about `pass_tokens` tokens per step."""
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
        self.verifiers[verify].check({})

    @staticmethod
    def _point_options(verify: str, points: int, pass_tokens: int) -> dict:
        # the points share a step's candidate tokens: Medusa's trees are sized by the sequences in each step (as
        # points finish, the others get more), a draft by the points at the start
        if verify == "medusa":
            return {"step_tokens": pass_tokens}
        if verify == "speculative":
            return {"k": max(1, pass_tokens // points - 1)}
        return {}

    async def _outline(self, request: GenerationRequest, engine: Engine, tokenizer, verify: str,
                       wire: dict) -> tuple[list[int], str]:
        """The outline, decoded by the verification policy with the request's sampling, until it is over (it
        repeats itself, or prose follows): its ids and text."""
        question = request.policy_options["question"]
        sub = GenerationRequest(chat_ids(tokenizer, outline_messages(question)),
                                request.policy_options.get("outline_tokens", self.outline_tokens), request.sampling,
                                (), request.stop_token_ids, verify)
        prepared: list[Prepared] = []
        ids, text = [], ""
        try:
            outline = job(self.verifiers[verify], sub, engine.cfg, text_stream(sub, tokenizer), prepared)
            async with aclosing(engine.run(outline)) as events:
                async for event in events:
                    assert isinstance(event, TokenEvent)  # what a policy's program yields
                    ids += event.token_ids
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    cut = cut_outline(text)
                    if cut is not None:
                        return ids, cut
            return ids, text
        finally:
            for p in prepared:
                if p.stats.sequence is not None:  # set when its program was prepared (decoding/sequence.py)
                    add_wire(wire, p.stats.sequence.wire())

    async def _fall_back(self, request: GenerationRequest, engine: Engine, tokenizer, reason: str,
                         outline_ids: list[int] | None = None):
        carry = list(outline_ids or [])  # the unusable outline was generated too: counted in usage, not shown
        async for event in self.fallback.generate(request, engine, tokenizer):
            event.token_ids, carry = carry + event.token_ids, []
            if event.stats is not None:
                event.stats = {**event.stats, "policy": self.name, "outline": {
                    "fallback": reason, "fallback_policy": self.fallback.name,
                    "outline_tokens": len(outline_ids or [])}}
            yield event

    async def generate(self, request: GenerationRequest, engine: Engine, tokenizer):
        options = request.policy_options
        if not options.get("question"):  # the chat's last user message (the service sets it), or the client's
            async for event in self._fall_back(request, engine, tokenizer, "not a chat request"):
                yield event
            return
        verify, stats = options.get("verify", "none"), StepStats(self.name)
        wire: dict[str, tuple[int, int]] = {}
        outline_ids, text = await self._outline(request, engine, tokenizer, verify, wire)
        points, question, policy = parse_outline(text), options["question"], self.verifiers[verify]
        prompts = [chat_ids(tokenizer, expansion_messages(question, points, i)) for i in range(len(points))]
        shared = common_prefix(prompts) if points else 0
        if not shared:  # (the chat template starts every point's prompt alike, so points share a prefix)
            async for event in self._fall_back(request, engine, tokenizer, "the outline could not be parsed",
                                               outline_ids):
                yield event
            return
        total = max(len(points), min(options.get("point_tokens", self.point_tokens) * len(points),
                                     request.max_tokens))
        point_options = self._point_options(verify, len(points), options.get("pass_tokens", self.pass_tokens))
        subs = [GenerationRequest(p, total, request.sampling, request.stop, request.stop_token_ids, verify,
                                  point_options) for p in prompts]
        texts = [text_stream(sub, tokenizer) for sub in subs]
        budget = SharedBudget(total, texts)
        prepared: list[list[Prepared]] = [[] for _ in subs]
        # Each point starts from the shared prompt's blocks and no further (its job's prompt for matching ends one
        # past it), whatever an earlier request left cached: every point then computes the same rows in the same
        # steps, and where the shared budget ends each one does not depend on the cache.
        jobs = [replace(job(policy, sub, engine.cfg, text, made), prompt=sub.prompt_ids[:shared + 1])
                for sub, text, made in zip(subs, texts, prepared, strict=True)]
        if engine.prefix is not None:  # the prompt the points share, computed once: kept, every point starts from it
            async for _ in engine.run(Job(shared + 1, partial(prefill, prompts[0][:shared]), prompts[0][:shared])):
                pass
        # closed here, not when collected: the engine stops the points before their sessions are released
        async with aclosing(engine.run_group(jobs)) as group:
            async for event in self._stream(group, points, outline_ids, stats):
                yield event
        points_stats = [p.stats for made in prepared for p in made]
        stats.proposed = sum(s.proposed for s in points_stats)
        stats.accepted = sum(s.accepted for s in points_stats)
        sequences = [s.sequence for s in points_stats if s.sequence is not None]  # every one: prepared
        for sequence in sequences:
            add_wire(wire, sequence.wire())
        final = stats.as_dict(wire)
        # a step carried a token (or more) for every point still expanding
        steps = max((sequence.passes for sequence in sequences), default=0)
        final.update(steps=steps, tokens_per_step=round(sum(budget.made) / steps, 4) if steps else None)
        final["outline"] = {"points": len(points), "outline_tokens": len(outline_ids), "budget": total,
                            "point_tokens": budget.made, "ended_at_sentence": budget.ended_early,
                            "verify": verify, "expanded_tokens": sum(budget.made)}
        yield TokenEvent([], "", "stop", [], final)

    @staticmethod
    async def _stream(events, points: list[str], outline_ids: list[int], stats: StepStats):
        # the points' events, in the order of the points: the next point to show grows, finished ones follow
        pending: list[list[TokenEvent]] = [[] for _ in points]
        finished = [False] * len(points)
        shown, header_due = 0, True  # points sent completely; whether the next one's "N. point: " is unsent
        carry = list(outline_ids)  # generated too: counted in usage with the first event, not shown
        async for point, event in events:
            pending[point].append(event)
            finished[point] = finished[point] or event.finish_reason is not None
            ids, parts, logprobs = list(carry), [], []
            while shown < len(points):
                if header_due:
                    parts.append(f"{shown + 1}. {points[shown]}: ")
                    header_due = False
                for e in pending[shown]:
                    ids += e.token_ids
                    parts.append(e.text)
                    logprobs += e.logprobs
                pending[shown] = []
                if not finished[shown]:
                    break
                parts.append("\n")
                shown, header_due = shown + 1, True
            if ids or parts:
                carry = []
                stats.tokens_emitted(len(ids), {})
                yield TokenEvent(ids, "".join(parts), None, logprobs)


def prefill(ids: list[int], seq: SequenceView):
    """The engine program of a prompt that is only computed (to be kept: the points' shared prompt)."""
    yield Rows(ids[seq.length:], last_only=True)
