"""What a chat request's own text says about the home it controls, for choosing a tool (decoding/decide.py):
the entities its system prompt lists (names, domain, areas: Home Assistant's exposed-entities YAML), the
domains each tool's parameter schema admits, and which entities, areas and domains the request names.

Nothing here is keyed to a phrase or a tool's name: the names are the prompt's own, the domains the ones its
entities have, and a tool admits a domain only where its `domain` parameter's enum says so.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from edgespec.server.chat_input import ToolSpec

_WORD = re.compile(r"[^\W_]+")  # words: letters and digits (a domain's "media_player" is two)


@dataclass(frozen=True)
class Entity:
    """One listed entity: its names (the first is its own, the rest aliases), domain and areas."""

    names: tuple[str, ...]
    domain: str
    areas: tuple[str, ...] = ()


@dataclass(frozen=True)
class Mention:
    """What a request names: the entities whose name (or alias) it holds, the areas, and the domains it names
    by their own words ("fan", "media player"). `domains`: what the request's target is, as far as these say:
    the named entities' domains, else the named domains; empty when they say nothing (an area alone). `said`:
    the request's words."""

    entities: tuple[Entity, ...]
    areas: tuple[str, ...]
    domains: tuple[str, ...]
    said: tuple[str, ...]

    def says(self, value: str) -> bool:
        """Whether the request holds all of `value`'s words, in order and adjacent (case aside)."""
        w = words(value)
        return bool(w) and next(_starts(self.said, w), None) is not None


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _starts(said: Sequence[str], w: list[str]) -> Iterator[int]:
    """Where the words `w` start in `said`, in order and adjacent."""
    return (i for i in range(len(said) - len(w) + 1) if list(said[i:i + len(w)]) == w)


def listed_entities(system_texts: list[str]) -> tuple[Entity, ...]:
    """The entities that YAML lists in the system messages name: each a mapping with `names` (or `name`) and
    `domain`, and optionally `areas` (or `area`), the names and areas comma-separated as Home Assistant joins
    them. Text that is not such a list is passed over."""
    found: list[Entity] = []
    for text in system_texts:
        for block in _yaml_lists(text):
            for item in block:
                entity = _entity(item)
                if entity is not None:
                    found.append(entity)
    return tuple(found)


def admitted_domains(tool: ToolSpec) -> frozenset[str] | None:
    """The domains `tool`'s schema admits: the enum of its `domain` parameter (a string, or an array of
    strings); None when it names none (any domain, as far as the schema says)."""
    props = tool.parameters.get("properties") if isinstance(tool.parameters, dict) else None
    domain = props.get("domain") if isinstance(props, dict) else None
    enum = _enum(domain) if isinstance(domain, dict) else None
    return frozenset(enum) if enum is not None else None


def mention(request: str, entities: tuple[Entity, ...]) -> Mention:
    """What `request` names among `entities`: a name is named when all its words appear in the request in
    order, adjacent (case aside). An entity whose name is named wins over an area that the name contains
    ("Kitchen Speaker" over "Kitchen"); a longer name over a shorter one inside it."""
    said = words(request)
    names = sorted({n for e in entities for n in e.names}, key=lambda n: -len(words(n)))
    spans: list[tuple[int, int]] = []

    def find(name: str) -> bool:
        w = words(name)
        for i in _starts(said, w):
            span = (i, i + len(w))
            if not any(a < span[1] and span[0] < b for a, b in spans):
                spans.append(span)
                return True
        return False

    named = {n for n in names if words(n) and find(n)}
    hit = tuple(e for e in entities if named & set(e.names))
    areas = sorted({a for e in entities for a in e.areas}, key=lambda a: -len(words(a)))
    hit_areas = tuple(a for a in areas if words(a) and find(a))
    listed = sorted({e.domain for e in entities}, key=lambda d: -len(words(d)))
    said_domains = tuple(d for d in listed if find(d))
    domains = tuple(sorted({e.domain for e in hit})) or said_domains
    return Mention(hit, hit_areas, domains, tuple(said))


def as_domains(request: str, named: Mention) -> str:
    """`request` with each named entity's name written as its domain's words ("Pause the TV" -> "Pause the
    media player"): the words tools' descriptions use for what they act on, where a home's names are its own
    ("TV", "Roomba", "Heating")."""
    for entity in named.entities:
        for name in sorted(entity.names, key=len, reverse=True):
            pattern = r"\b" + r"\W+".join(map(re.escape, words(name))) + r"\b"
            rewritten, n = re.subn(pattern, " ".join(words(entity.domain)), request, flags=re.IGNORECASE)
            if n:
                request = rewritten
                break
    return request


def _yaml_lists(text: str) -> list[list[Any]]:
    """Every run of lines that opens with "- " at the margin and goes on with such lines or indented ones,
    parsed as YAML, when it parses as a list."""
    runs: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("- ") or (current is not None and line.startswith((" ", "\t")) and line.strip()):
            if current is None:
                current = []
                runs.append(current)
            current.append(line)
        else:
            current = None  # a break: the next "- " opens a new run
    out = []
    for run in runs:
        try:
            parsed = yaml.safe_load("\n".join(run))
        except yaml.YAMLError:
            continue
        if isinstance(parsed, list):
            out.append(parsed)
    return out


def _entity(item: Any) -> Entity | None:
    if not isinstance(item, dict) or not isinstance(item.get("domain"), str):
        return None
    names = _listed(item.get("names", item.get("name")))
    if not names:
        return None
    return Entity(names, item["domain"], _listed(item.get("areas", item.get("area"))))


def _listed(value: Any) -> tuple[str, ...]:
    if isinstance(value, list):
        return tuple(str(v).strip() for v in value if str(v).strip())
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return ()


def grounded(tool: ToolSpec, home: tuple[Entity, ...], named: Mention) -> ToolSpec:
    """`tool` as the grammar holds it when the prompt lists the `home`'s entities and the tool acts on them (its
    schema has a `domain` property, as Home Assistant's entity intents do): its `name`, `area` and `domain` take
    only the values of the entities it may target; its other optional parameters with an enum (a string, or an
    array of strings) take only the values the request names, and are left out where it names none; the optional
    arrays whose schema says nothing of their items are left out. The targets: of the entities whose domain the
    tool's schema admits, the ones the request `named`, else those in the domains and areas it named, else all;
    the areas: the named ones, else the targets'.

    Measured on SmolLM2-135M with Home Assistant 2025.4.4's own turn "Turn on the kitchen light": HassTurnOn was
    called with `{"area": "kitchen", "domain": ["kitchen", "area", "name"]}` (OpenAI integration) and with
    `device_class` filled with made-up words (the Ollama integration strips the arrays' item enums); HA's
    matching refused both and the light stayed off. Given every listed name, it paused the "Hallway Light" for
    "the office speaker". With the OpenAI integration's `device_class` item enum offered, a call could fill it
    with the enum's first values: HA builds that enum from a set, so its order follows the process's hash seed;
    of 21 runs of tests/ha, each with its own seed, two failed; the one whose requests were kept had called
    HassTurnOn `{"area": "Kitchen", "device_class": ["tv", "speaker", "receiver"]}` (the enum's first three),
    which HA's matching refused; replayed, its requests drew that call every time. With the enum left out, 29
    more runs passed. Every call made under the grounded schema is valid under the client's."""
    params = tool.parameters
    props = params.get("properties") if isinstance(params, dict) else None
    if not home or not isinstance(props, dict) or not isinstance(props.get("domain"), dict):
        return tool
    admitted = admitted_domains(tool)
    fit = [e for e in home if admitted is None or e.domain in admitted] or list(home)
    targets = [e for e in fit if e in named.entities] or [
        e for e in fit if (not named.domains or e.domain in named.domains)
        and (not named.areas or set(e.areas) & set(named.areas))] or fit
    listed = {"name": sorted({n for e in targets for n in e.names}),
              "area": sorted(set(named.areas) or {a for e in targets for a in e.areas}),
              "domain": sorted({e.domain for e in targets})}
    required = set(params.get("required") or ())
    out: dict[str, Any] = {}
    for key, schema in props.items():
        if not isinstance(schema, dict):
            out[key] = schema
        elif listed.get(key):
            out[key] = _only(schema, listed[key])
        elif key in required:
            out[key] = schema
        elif (enum := _enum(schema)) is not None:
            if said := [v for v in enum if named.says(v)]:
                out[key] = _only(schema, said)
        elif schema.get("type") != "array" or "items" in schema:
            out[key] = schema
    return ToolSpec(tool.name, tool.description, {**params, "properties": out})


def _enum(schema: dict[str, Any]) -> list[str] | None:
    """The values a string's (or an array of strings') schema enumerates; None where it enumerates none."""
    inner = schema.get("items") if schema.get("type") == "array" else schema
    enum = inner.get("enum") if isinstance(inner, dict) else None
    return [str(v) for v in enum] if isinstance(enum, list) and enum else None


def _only(schema: dict[str, Any], values: list[str]) -> dict[str, Any]:
    """`schema` (a string, or an array of strings) admitting only `values` (those its own enum admits too)."""
    array = schema.get("type") == "array"
    inner = schema.get("items", {}) if array else schema
    if not isinstance(inner, dict) or inner.get("type", "string") != "string":
        return schema
    own = inner.get("enum")
    kept = [v for v in values if not isinstance(own, list) or v in own] or own or values
    inner = {**inner, "type": "string", "enum": kept}
    return {**schema, "items": inner} if array else inner
