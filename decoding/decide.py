"""Decisions a small model makes badly token by token, made before decoding by scoring whole continuations
in the engine's steps: whether to call a tool at all (tool_choice auto) and which tool a call opens with.

Measured on SmolLM2-135M with Home Assistant's six intent tools and its 950-token prompt (greedy):
- Left to the grammar, a call opens with whatever tool the first tokens favour: the intended tool on 1 to 3
  of 8 device commands, whatever the prompt's layout; the first-listed tool won most.
- The sequence log-probability of each tool's name after `<tool_call>[{"name": "` picked 3 to 4 of 8 (a
  strong prior for the first-listed name), and calibrated against a content-free request ("Calibrate Before
  Use", Zhao et al. 2021) 4 of 8.
- The noisy channel (Min et al. 2022), log P(the request | a system message naming the tool and its
  description), picked 6 of 8: it asks which tool explains the request rather than which name the model
  likes, so the names' priors drop out.
A lazy grammar never opens a call by itself (0 of 8), and an always-JSON envelope always does (7 of 7,
"Tell me a joke" too), so whether to call is a score as well: log P("<tool_call>[" | prompt).
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import partial

import torch

from edgespec.decoding.grammar import Grammar
from edgespec.decoding.types import GenerationRequest
from edgespec.engine.engine import Engine
from edgespec.engine.program import Job, Rows, SequenceView


@dataclass(frozen=True)
class Trigger:
    """tool_choice auto: when log P(ids | prompt) is at least `threshold`, the answer is a call, decoded under
    `forced`; else it decodes under the request's own grammar (free text that may still call)."""

    ids: tuple[int, ...]
    threshold: float
    forced: Grammar


@dataclass(frozen=True)
class Route:
    """Which tool a call opens with: for tool i, the channel's context (a prompt naming the tool) and the
    request's ids, scored as log P(request | context); the call then decodes under grammars[i] (calls whose
    first is tool i)."""

    names: tuple[str, ...]
    contexts: tuple[tuple[int, ...], ...]
    request: tuple[int, ...]
    grammars: tuple[Grammar, ...]


async def decide(request: GenerationRequest, engine: Engine) -> tuple[GenerationRequest, dict]:
    """The request to decode, its trigger and route resolved into its grammar, and the figures for its
    statistics. A trigger is scored on a sequence of the prompt and the trigger's ids: the request's own
    sequence then starts from its prompt's blocks (the prefix cache). A route is scored on sequences of its
    own, one per tool, in the same steps."""
    figures: dict = {}
    grammar, calling = request.grammar, request.trigger is None  # no trigger: a call was required
    if request.trigger is not None:
        trigger = request.trigger
        logprob = (await _score(engine, [(request.prompt_ids, trigger.ids)]))[0]
        calling = logprob >= trigger.threshold
        grammar = trigger.forced if calling else grammar
        figures |= {"trigger_logprob": round(logprob, 4), "threshold": trigger.threshold, "call": calling}
    route = request.route
    if route is not None and calling:
        # the contexts are the same for every request with these tools: kept, their blocks are reused
        scores = await _score(engine, [(list(ctx), route.request) for ctx in route.contexts])
        best = max(range(len(scores)), key=scores.__getitem__)
        grammar = route.grammars[best]
        figures["route"] = {"chose": route.names[best],
                            "logprobs": {n: round(x, 4) for n, x in zip(route.names, scores, strict=True)}}
    return replace(request, grammar=grammar, trigger=None, route=None), figures


async def _score(engine: Engine, members: list[tuple[list[int], tuple[int, ...]]]) -> list[float]:
    """log P(continuation | context) for each (context, continuation): every member's rows go in the engine's
    shared steps (two steps each: the context's last logits, then the continuation's)."""
    scores = [0.0] * len(members)

    def program(i: int, seq: SequenceView, context: list[int], continuation: tuple[int, ...]):
        first = yield Rows(context[seq.length:], last_only=True)  # logits [1, 1, V]
        logits = first.logits[0]
        if len(continuation) > 1:
            rest = yield Rows(list(continuation[:-1]))  # logits [1, T - 1, V]
            logits = torch.cat([logits, rest.logits[0]])  # [T, V]
        ids = torch.tensor(continuation)[:, None]  # [T, 1]
        scores[i] = float(torch.log_softmax(logits, dim=-1).gather(1, ids).sum())

    jobs = [Job(len(ctx) + len(cont), partial(program, i, context=ctx, continuation=cont), ctx)
            for i, (ctx, cont) in enumerate(members)]
    async with aclosing(engine.run_group(jobs)) as events:
        async for _ in events:
            pass
    return scores
