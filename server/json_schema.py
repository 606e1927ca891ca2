"""JSON schemas made safe for a small model to generate under a grammar.

A client's schema usually leaves objects open and arrays and strings unbounded. Under a grammar a 135M model
then stuffs objects with extra keys and loops inside arrays until max_tokens (../shared/notes/tools.md, §1
and §2). `close_schema` only ever narrows a schema, so whatever the grammar lets through still validates against
the client's original schema.
"""

from __future__ import annotations

import copy
import json
from typing import Any

# Keywords whose values are subschemas that constrain the instance positively: narrowing them narrows the parent.
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_SINGLE = ("additionalProperties", "items", "contains", "then", "else", "unevaluatedItems")
# Any of these already bounds a string's length or content: adding maxLength could contradict it.
_STRING_BOUNDS = ("maxLength", "enum", "const", "pattern", "format")
# Numbers are bounded too: under a grammar the 135M model wrote "confidence":0.0000... until max_tokens (3 of 8
# structured answers). JSON Schema cannot bound digits, but a step bounds the decimals (llguidance then allows
# at most three, and no exponent) and a range the integer part.
NUMBER_STEP = 0.001
NUMBER_MAGNITUDE = 10**9


def compact(obj: Any) -> str:
    """`obj` as JSON without whitespace, non-ASCII characters kept as they are."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def close_schema(schema: dict[str, Any], max_items: int | None, max_length: int | None) -> dict[str, Any]:
    """A deep copy of `schema`, narrowed so that a small model cannot wander inside it:

    - an object schema with `properties` and no `additionalProperties` gets `additionalProperties: false`;
    - an array schema without `maxItems` gets `maxItems: max(max_items, minItems)` (unless max_items is None);
    - a string schema without maxLength, enum, const, pattern or format gets `maxLength: max(max_length,
      minLength)` (unless max_length is None);
    - a number schema without multipleOf, enum or const gets `multipleOf: NUMBER_STEP`, and a number or
      integer schema without a lower or an upper bound gets -NUMBER_MAGNITUDE or NUMBER_MAGNITUDE.

    Every instance of the result is an instance of `schema`. Keywords it does not know (HA's inner
    `"strict": true`) are kept as they are; `schema` is never mutated.
    """
    out = copy.deepcopy(schema)
    _close(out, max_items, max_length, in_all_of=False)
    return out


def _close(s: Any, max_items: int | None, max_length: int | None, in_all_of: bool) -> None:
    if not isinstance(s, dict):
        return  # boolean schemas (true/false) and malformed values are left alone
    types = _types(s)
    # A member of allOf, or a schema merged with allOf/$ref, may see properties declared next to it: closing
    # it would forbid those and could make the whole schema unsatisfiable.
    mergeable = in_all_of or "allOf" in s or "$ref" in s
    if "properties" in s and "additionalProperties" not in s and not mergeable:
        s["additionalProperties"] = False
    if max_items is not None and "maxItems" not in s and _is(types, s, "array", ("items", "prefixItems")):
        s["maxItems"] = max(max_items, _int(s.get("minItems")))
    if (max_length is not None and _is(types, s, "string", ("minLength",))
            and not any(k in s for k in _STRING_BOUNDS)):
        s["maxLength"] = max(max_length, _int(s.get("minLength")))
    if "enum" not in s and "const" not in s and (types & {"number", "integer"}):
        if "number" in types and "multipleOf" not in s:
            s["multipleOf"] = NUMBER_STEP
        if "minimum" not in s and "exclusiveMinimum" not in s:
            s["minimum"] = -NUMBER_MAGNITUDE
        if "maximum" not in s and "exclusiveMaximum" not in s:
            s["maximum"] = NUMBER_MAGNITUDE
    for key in _SUBSCHEMA_MAPS:
        if isinstance(s.get(key), dict):
            for sub in s[key].values():
                _close(sub, max_items, max_length, in_all_of=False)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(s.get(key), list):
            for sub in s[key]:
                _close(sub, max_items, max_length, in_all_of=False)
    for key in _SUBSCHEMA_SINGLE:
        value = s.get(key)
        if isinstance(value, list):  # draft-4 tuple `items`
            for sub in value:
                _close(sub, max_items, max_length, in_all_of=False)
        else:
            _close(value, max_items, max_length, in_all_of=False)
    if isinstance(s.get("allOf"), list):
        for sub in s["allOf"]:
            _close(sub, max_items, max_length, in_all_of=True)
    # `not` and `if` are left as they are: narrowing a subschema there would widen what the parent accepts.


def _types(s: dict[str, Any]) -> set[str]:
    t = s.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


def _is(types: set[str], s: dict[str, Any], kind: str, hints: tuple[str, ...]) -> bool:
    """Whether `s` describes values of `kind`: by its type, or, untyped, by a keyword only that kind uses."""
    if types:
        return kind in types
    return any(h in s for h in hints)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
