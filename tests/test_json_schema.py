"""close_schema: the caps it adds, where it leaves a schema alone, and that it only ever narrows."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from edgespec.server.json_schema import close_schema, compact

# Home Assistant's HassTurnOn as its voluptuous-openapi conversion sends it (domain: a list of enum strings).
HASS_TURN_ON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "area": {"type": "string"},
        "floor": {"type": "string"},
        "domain": {"type": "array", "items": {"type": "string", "enum": ["light", "switch", "fan"]}},
        "device_class": {"type": "array", "items": {"type": "string", "enum": ["outlet", "switch"]}},
    },
    "required": [],
}

# HA core's structured output (Responses text.format): an inner "strict": true and nullable strings.
HA_TASK = {
    "type": "object",
    "strict": True,
    "properties": {
        "summary": {"type": ["string", "null"]},
        "steps": {"type": "array", "items": {"type": "object", "properties": {"text": {"type": "string"}}}},
    },
    "required": ["summary", "steps"],
}


def test_objects_closed_arrays_and_strings_capped():
    closed = close_schema(HASS_TURN_ON, max_items=3, max_length=48)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["name"]["maxLength"] == 48
    domain = closed["properties"]["domain"]
    assert domain["maxItems"] == 3
    assert "maxLength" not in domain["items"]  # an enum bounds it already
    assert closed["required"] == []


def test_unknown_keywords_and_type_lists():
    closed = close_schema(HA_TASK, max_items=8, max_length=None)
    assert closed["strict"] is True
    assert "maxLength" not in closed["properties"]["summary"]  # no string cap asked
    assert closed["properties"]["steps"]["maxItems"] == 8
    assert closed["properties"]["steps"]["items"]["additionalProperties"] is False
    capped = close_schema(HA_TASK, max_items=None, max_length=10)
    assert capped["properties"]["summary"] == {"type": ["string", "null"], "maxLength": 10}
    assert "maxItems" not in capped["properties"]["steps"]


def test_existing_bounds_win():
    schema = {"type": "object", "additionalProperties": True, "properties": {
        "tags": {"type": "array", "minItems": 5, "items": {"type": "string", "minLength": 60}},
        "ids": {"type": "array", "maxItems": 20},
        "code": {"type": "string", "pattern": "^[a-z]+$"},
        "when": {"type": "string", "format": "date"},
        "kind": {"const": "x", "type": "string"},
        "short": {"type": "string", "maxLength": 4},
    }}
    closed = close_schema(schema, max_items=3, max_length=48)
    props = closed["properties"]
    assert closed["additionalProperties"] is True
    assert props["tags"]["maxItems"] == 5  # never below minItems
    assert props["tags"]["items"]["maxLength"] == 60  # never below minLength
    assert props["ids"]["maxItems"] == 20
    for key in ("code", "when", "kind"):
        assert "maxLength" not in props[key]
    assert props["short"]["maxLength"] == 4


def test_recurses_through_every_subschema_keyword():
    schema = {
        "$defs": {"room": {"type": "object", "properties": {"name": {"type": "string"}}}},
        "definitions": {"old": {"type": "string"}},
        "type": "object",
        "properties": {
            "choice": {"anyOf": [{"type": "string"}, {"type": "array"}]},
            "one": {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "null"}]},
            "tuple": {"type": "array", "prefixItems": [{"type": "string"}], "items": [{"type": "string"}]},
            "map": {"type": "object", "additionalProperties": {"type": "string"}},
            "room": {"$ref": "#/$defs/room"},
        },
    }
    closed = close_schema(schema, max_items=2, max_length=9)
    props = closed["properties"]
    assert closed["$defs"]["room"]["additionalProperties"] is False
    assert closed["$defs"]["room"]["properties"]["name"]["maxLength"] == 9
    assert closed["definitions"]["old"]["maxLength"] == 9
    assert props["choice"]["anyOf"] == [{"type": "string", "maxLength": 9}, {"type": "array", "maxItems": 2}]
    assert props["one"]["oneOf"][0]["additionalProperties"] is False
    assert props["tuple"]["maxItems"] == 2
    assert props["tuple"]["prefixItems"][0]["maxLength"] == 9
    assert props["tuple"]["items"][0]["maxLength"] == 9
    assert props["map"]["additionalProperties"] == {"type": "string", "maxLength": 9}
    assert props["room"] == {"$ref": "#/$defs/room"}


def test_allof_members_and_not_are_left_open():
    """Closing an allOf member would forbid the properties its siblings declare; narrowing inside `not` would
    widen what the parent accepts."""
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                        {"type": "object", "properties": {"b": {"type": "string"}}}],
              "not": {"type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"]}}
    closed = close_schema(schema, max_items=3, max_length=5)
    assert all("additionalProperties" not in member for member in closed["allOf"])
    assert closed["allOf"][0]["properties"]["a"]["maxLength"] == 5  # deeper down, caps still apply
    assert closed["not"] == schema["not"]
    jsonschema.validate({"a": "x", "b": "y"}, closed)  # still satisfiable


def test_input_is_never_mutated():
    before = copy.deepcopy(HA_TASK)
    close_schema(HA_TASK, max_items=1, max_length=1)
    assert before == HA_TASK


@pytest.mark.parametrize("instance", [
    {"name": "kitchen light", "domain": ["light"]},
    {"name": "x" * 49},
    {"domain": ["light", "switch", "fan", "light"]},
    {"name": "lamp", "brightness": 50},
    {"area": "kitchen", "device_class": ["outlet"]},
    {},
])
def test_closed_schema_only_narrows(instance):
    """Whatever the closed schema accepts, the original accepts too."""
    closed = close_schema(HASS_TURN_ON, max_items=3, max_length=48)
    if jsonschema.Draft202012Validator(closed).is_valid(instance):
        jsonschema.validate(instance, HASS_TURN_ON)


def test_compact():
    assert compact({"a": [1, 2], "b": "é"}) == '{"a":[1,2],"b":"é"}'


def test_numbers_get_a_step_and_a_range_unless_the_schema_bounds_them():
    closed = close_schema({"type": "object", "properties": {
        "c": {"type": "number"}, "n": {"type": "integer", "minimum": 0}, "e": {"type": "number", "enum": [1.5]},
        "m": {"type": ["number", "null"], "multipleOf": 0.5, "exclusiveMaximum": 3}}}, None, None)["properties"]
    assert closed["c"] == {"type": "number", "multipleOf": 0.001, "minimum": -10**9, "maximum": 10**9}
    assert closed["n"] == {"type": "integer", "minimum": 0, "maximum": 10**9}
    assert closed["e"] == {"type": "number", "enum": [1.5]}
    assert closed["m"] == {"type": ["number", "null"], "multipleOf": 0.5, "exclusiveMaximum": 3, "minimum": -10**9}
