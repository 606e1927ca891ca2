"""Which tool a call opens with, the part read from the request's own text: which tools may serve what the
request names, what the prompt says of each tool, and how many of the request's words each tool's own text
holds. decoding/decide.py adds the model's evidence (the noisy channel) and chooses.

Measured on SmolLM2-135M with Home Assistant 2025.4.4's 23 tools and prompt, on the tuning half (32 commands)
of bench/prompts/ha_commands.json, the intended tool under `required`:
- the channel alone (log P(request | a system turn naming the tool), issue 19's route): 14/32; however its
  context was worded or the request rewritten, 11 to 21/32: a tool whose description is long and full of home
  words (GetLiveContext) or short (HassVacuumStart) drew commands of every kind;
- the overlap of the request's words with each tool's own words (stems, weighted by how few of the tools and
  of the prompt's sentences hold them): 22/32; with the schemas' domains leaving tools out, 24/32;
- the overlap and the model's evidence added, in nats each: 25/32 (23-26/32 over the variants tried), and 7/8
  on issue 19's set (6/8 for the overlap alone).
What the checking half, the held-out cases and issue 38's two-light home gave is in
bench/results/issue38-tool-choice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import snowballstemmer

from edgespec.server.chat_input import ChatInput, ToolSpec
from edgespec.server.home_context import Mention, admitted_domains, as_domains, words

_SENTENCE = re.compile(r"(?<=[.!?:])\s+|\n+")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


@dataclass(frozen=True)
class RoutePlan:
    """The text half of a route. `candidates`: the indices of the tools that may serve the request (every
    tool, less those whose schema's domain enum leaves out the one domain the request names); `notes`: for
    every tool, the system prompt's sentences that name it; `overlap`: for each candidate, the request's word
    overlap with the tool's own words, in nats; `request`: the request as the channel reads it (named entities
    written as their domains' words); `figures`: what the request named and which tools were left out."""

    candidates: tuple[int, ...]
    notes: tuple[str, ...]
    overlap: tuple[float, ...]
    request: str
    figures: dict[str, Any] = field(default_factory=dict)


class ToolRouter:
    """Plans routes (one per server: it holds the stemmer, which is not shared between threads)."""

    def __init__(self) -> None:
        self._stem = snowballstemmer.stemmer("english").stemWord

    def plan(self, chat: ChatInput, request: str, named: Mention) -> RoutePlan:
        """The route of `request` (the last user message) among `chat`'s tools; `named`: what it names in the
        home its system messages list (home_context.mention)."""
        system = [m.content for m in chat.messages if m.role == "system" and m.content]
        sentences = [s.strip() for text in system for s in _SENTENCE.split(text) if s.strip()]
        candidates = tuple(i for i, t in enumerate(chat.tools) if _serves(t, named))
        if not candidates:  # a schema that admits nothing named: the schemas cannot tell, all stay
            candidates = tuple(range(len(chat.tools)))
        said = self._stems(words(request) + words(as_domains(request, named)))
        docs = [self._stems(_own_words(t)) for t in chat.tools]
        overlap = _idf_overlap(said, docs, [self._stems(words(s)) for s in sentences])
        notes = tuple(" ".join(s for s in sentences if t.name in s) for t in chat.tools)
        figures = {"named": {"entities": [e.names[0] for e in named.entities], "areas": list(named.areas),
                             "domains": list(named.domains)},
                   "left_out": [t.name for i, t in enumerate(chat.tools) if i not in candidates]}
        return RoutePlan(candidates, notes, tuple(overlap[i] for i in candidates), as_domains(request, named),
                         figures)

    def _stems(self, ws: Iterable[str]) -> frozenset[str]:
        return frozenset(self._stem(w) for w in ws)


def _serves(tool: ToolSpec, named: Mention) -> bool:
    """Whether `tool`'s schema lets it act on what the request names: unless the request names entities of one
    domain and the tool's `domain` enum leaves that domain out."""
    admitted = admitted_domains(tool)
    return admitted is None or len(named.domains) != 1 or named.domains[0] in admitted


def _own_words(tool: ToolSpec) -> list[str]:
    """A tool's own words: its name (split where its case changes), its description, and its schema's property
    names and enum values."""
    return words(" ".join([_CAMEL.sub(" ", tool.name), tool.description, *_schema_words(tool.parameters)]))


def _schema_words(schema: Any) -> list[str]:
    out: list[str] = []
    if isinstance(schema, dict):
        props = schema.get("properties")
        if isinstance(props, dict):
            out += [str(k) for k in props]
        if isinstance(schema.get("enum"), list):
            out += [str(v) for v in schema["enum"]]
        for value in schema.values():
            out += _schema_words(value) if isinstance(value, dict | list) else []
    elif isinstance(schema, list):
        for value in schema:
            out += _schema_words(value)
    return out


def _idf_overlap(said: frozenset[str], docs: list[frozenset[str]], background: list[frozenset[str]]) -> list[float]:
    """For each doc, the sum over the words it shares with `said` of log((N + 1) / (df + 1)), df counting the
    docs and the background's sentences that hold the word: a word every tool and sentence holds ("the")
    weighs nothing, one tool's own word the most. The background keeps a few tools' words from all weighing
    alike (issue 38's four tools)."""
    corpus = docs + background
    n = len(corpus)

    def idf(w: str) -> float:
        return math.log((n + 1) / (1 + sum(w in d for d in corpus)))

    return [sum(idf(w) for w in said & d) for d in docs]
