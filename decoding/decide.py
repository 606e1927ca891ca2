"""Decisions a small model makes badly token by token, made before decoding by scoring whole continuations
in the engine's steps: whether to call a tool at all (tool_choice auto) and which tool a call opens with.

Whether to call: a lazy grammar never opens a call by itself (0 of 8 device commands on SmolLM2-135M), and an
always-JSON envelope always does (7 of 7, "Tell me a joke" too), so it is a score: log P("<tool_call>[" |
prompt) against a threshold.

Which tool (measured on SmolLM2-135M, greedy; server/tool_route.py has the figures on Home Assistant's own
prompt and 23 tools):
- Left to the grammar, a call opens with whatever tool the first tokens favour: 1 to 3 of 8 on issue 19's
  set; the sequence log-probability of each tool's name 3-4 of 8 (a prior for the first-listed name).
- The noisy channel (Min et al. 2022), log P(request | a system turn naming the tool), 6 of 8 there, but 14 of
  32 on Home Assistant's real tools (the tuning half of bench/prompts/ha_commands.json): a long description full
  of home words explains any home request. So a tool's evidence is the channel's log-ratio against the same turn
  naming no tool, token by token, summed over the TOP_TOKENS request tokens the tool raises most (the words that
  name the action; the device's name and the filler weigh alike under every tool and only add noise). Alone, all
  tokens 15/32, the top one 20/32, two 20/32, three 21/32; with the prior below, 23, 24, 25 and 24/32.
- That evidence is added to the route's prior (server/tool_route.py: the request's word overlap with the tool's
  own words, in nats too), among the tools whose schemas admit what the request names.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass, field, replace
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
    """Which tool a call opens with, among the candidates `names`: for each, the channel's context (a prompt
    naming the tool), its prior (nats) and the grammar its calls decode under (calls whose first is that tool);
    `baseline`: the same context naming no tool; `request`: the request's ids as the channel reads them.
    `figures`: what chose the candidates, for the statistics."""

    names: tuple[str, ...]
    contexts: tuple[tuple[int, ...], ...]
    baseline: tuple[int, ...]
    request: tuple[int, ...]
    prior: tuple[float, ...]
    grammars: tuple[Grammar, ...]
    figures: dict = field(default_factory=dict)


TOP_TOKENS = 2  # the request tokens whose evidence counts for a tool (the module's docstring: best with the prior)


async def decide(request: GenerationRequest, engine: Engine) -> tuple[GenerationRequest, dict]:
    """The request to decode, its trigger and route resolved into its grammar, and the figures for its
    statistics (`decide_ms`: the time the decision took). A trigger is scored on a sequence of the prompt and
    the trigger's ids: the request's own sequence then starts from its prompt's blocks (the prefix cache). A
    route is scored on sequences of its own, one per candidate and the baseline, in the same steps; the choice
    is the highest prior plus evidence, the first listed on a tie."""
    began = time.perf_counter()
    figures: dict = {}
    grammar, calling = request.grammar, request.trigger is None  # no trigger: a call was required
    if request.trigger is not None:
        trigger = request.trigger
        logprob = sum((await _logprobs(engine, [(request.prompt_ids, trigger.ids)]))[0])
        calling = logprob >= trigger.threshold
        grammar = trigger.forced if calling else grammar
        figures |= {"trigger_logprob": round(logprob, 4), "threshold": trigger.threshold, "call": calling}
    route = request.route
    if route is not None and calling:
        evidence = [0.0] * len(route.names)
        if len(route.names) > 1:  # the contexts are the same for every request with these tools: blocks reused
            rows = await _logprobs(engine, [(list(ctx), route.request) for ctx in (*route.contexts, route.baseline)])
            evidence = [_evidence(row, rows[-1]) for row in rows[:-1]]
        scores = [p + e for p, e in zip(route.prior, evidence, strict=True)]
        best = max(range(len(scores)), key=scores.__getitem__)
        grammar = route.grammars[best]
        figures["route"] = {"chose": route.names[best], "scores": _by_name(route.names, scores),
                            "prior": _by_name(route.names, route.prior),
                            "evidence": _by_name(route.names, evidence), **route.figures}
    figures["decide_ms"] = round(1000 * (time.perf_counter() - began), 1)
    return replace(request, grammar=grammar, trigger=None, route=None), figures


def _evidence(row: list[float], baseline: list[float]) -> float:
    """The sum of the TOP_TOKENS largest per-token log-ratios of a tool's channel against the baseline's."""
    return sum(sorted((a - b for a, b in zip(row, baseline, strict=True)), reverse=True)[:TOP_TOKENS])


def _by_name(names: tuple[str, ...], values) -> dict[str, float]:
    return {n: round(v, 4) for n, v in zip(names, values, strict=True)}


async def _logprobs(engine: Engine, members: list[tuple[list[int], tuple[int, ...]]]) -> list[list[float]]:
    """log P(token | context, the tokens before it) of every token of each (context, continuation): every
    member's rows go in the engine's shared steps (two steps each: the context's last logits, then the
    continuation's)."""
    out: list[list[float]] = [[] for _ in members]

    def program(i: int, seq: SequenceView, context: list[int], continuation: tuple[int, ...]):
        first = yield Rows(context[seq.length:], last_only=True)  # logits [1, 1, V]
        logits = first.logits[0]
        if len(continuation) > 1:
            rest = yield Rows(list(continuation[:-1]))  # logits [1, T - 1, V]
            logits = torch.cat([logits, rest.logits[0]])  # [T, V]
        ids = torch.tensor(continuation)[:, None]  # [T, 1]
        out[i] = torch.log_softmax(logits, dim=-1).gather(1, ids)[:, 0].tolist()

    jobs = [Job(len(ctx) + len(cont), partial(program, i, context=ctx, continuation=cont), ctx)
            for i, (ctx, cont) in enumerate(members)]
    async with aclosing(engine.run_group(jobs)) as events:
        async for _ in events:
            pass
    return out
