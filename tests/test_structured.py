"""Grammars for tools and response formats, driven token by token through llguidance with SmolLM2's tokenizer:
what they accept validates against the client's schema, what they must refuse they refuse, and a complete
output leaves EOS as the only token."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
from model_fixtures import smollm2_folder
from transformers import AutoTokenizer

from edgespec.server.chat_input import ChatInput, Message, ResponseFormat, ToolCall, ToolChoiceNamed, ToolSpec
from edgespec.server.structured import GrammarError, plan
from edgespec.server.tool_prompt import HERMES, SMOLLM2

EOS = 2  # <|im_end|>

# Home Assistant's intent tools, as its voluptuous-openapi conversion sends them.
_TARGET = {
    "name": {"type": "string"},
    "area": {"type": "string"},
    "floor": {"type": "string"},
    "domain": {"type": "array", "items": {"type": "string", "enum": ["light", "switch", "fan", "cover"]}},
    "device_class": {"type": "array", "items": {"type": "string", "enum": ["outlet", "switch", "tv"]}},
}
HASS_TURN_ON = ToolSpec("HassTurnOn", "Turns on/opens a device or entity",
                        {"type": "object", "properties": _TARGET, "required": []})
HASS_TURN_OFF = ToolSpec("HassTurnOff", "Turns off/closes a device or entity",
                         {"type": "object", "properties": _TARGET, "required": []})
HASS_LIGHT_SET = ToolSpec("HassLightSet", "Sets the brightness or color of a light", {
    "type": "object", "strict": True,
    "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                   "brightness": {"type": "integer", "minimum": 0, "maximum": 100},
                   "color": {"type": ["string", "null"]}},
})
GET_LIVE_CONTEXT = ToolSpec("GetLiveContext", "Current states of devices", {})
HASS_CLIMATE = ToolSpec("HassClimateSetTemperature", "Sets the target temperature", {
    "type": "object",
    "properties": {"temperature": {"type": "number"}, "name": {"type": "string"}, "area": {"type": "string"}},
    "required": ["temperature"],
})
HA_TOOLS = (HASS_TURN_ON, HASS_TURN_OFF, HASS_LIGHT_SET, GET_LIVE_CONTEXT, HASS_CLIMATE)
BY_NAME = {t.name: t for t in HA_TOOLS}
USER = (Message("user", "turn on the kitchen light"),)

# HA core's structured output: an inner "strict": true and nullable strings.
HA_TASK = {
    "type": "object", "strict": True,
    "properties": {"summary": {"type": ["string", "null"]},
                   "steps": {"type": "array", "items": {"type": "string"}}},
    "required": ["summary", "steps"],
}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(smollm2_folder())


@pytest.fixture(scope="module")
def lt(tok):
    return llguidance.hf.from_tokenizer(tok)


@pytest.fixture
def run(tok, lt):
    """run(grammar, text) -> (accepted, detail): consume `text`'s tokens one by one; accepted means every token
    was allowed and the matcher then allows only EOS (`eos_only=False`: allows EOS)."""

    def drive(grammar: str, text: str, eos_only: bool = True) -> tuple[bool, str]:
        m = llguidance.LLMatcher(lt, grammar)
        assert not m.is_error(), m.get_error()
        ids = tok.encode(text, add_special_tokens=False)
        for i, t in enumerate(ids):
            if not m.consume_token(t):
                return False, f"token {i} {tok.decode(ids[:i + 1])!r}"
        mask = llguidance.numpy.allocate_token_bitmask(1, lt.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(m, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:lt.vocab_size])
        ok = list(allowed) == [EOS] if eos_only else EOS in allowed
        return ok, f"allowed after the text: {allowed[:8]} ({len(allowed)})"

    return drive


def _chat(tools=HA_TOOLS, choice="auto", parallel=True, fmt=None, legacy=False) -> ChatInput:
    return ChatInput(USER, tools, choice, parallel, fmt, legacy)


def _tag(*calls) -> str:
    return "<tool_call>" + json.dumps(list(calls), separators=(",", ":")) + "</tool_call>"


def _call(tool, /, **arguments) -> dict:
    return {"name": tool, "arguments": arguments}


def _validate_calls(text: str) -> None:
    """Every call in an accepted output is valid against the tool's ORIGINAL parameters."""
    for call in json.loads(text[len("<tool_call>"):-len("</tool_call>")]):
        jsonschema.validate(call["arguments"], BY_NAME[call["name"]].parameters or {"type": "object"})


GOOD_CALLS = [
    _tag(_call("HassTurnOn", name="kitchen light", domain=["light"])),
    _tag(_call("HassLightSet", area="living room", brightness=40, color=None)),
    _tag(_call("HassLightSet", name="lamp", color="red")),
    _tag(_call("GetLiveContext")),
    _tag(_call("HassClimateSetTemperature", temperature=21.5, area="bedroom")),
    _tag(_call("HassTurnOff", area="kitchen"), _call("HassTurnOn", area="hall", device_class=["tv", "outlet"])),
]


def test_no_tools_and_no_format_is_free_text():
    assert plan(_chat(tools=()), SMOLLM2) is None
    assert plan(_chat(choice="none"), SMOLLM2) is None


@pytest.mark.parametrize("text", GOOD_CALLS)
def test_required_accepts_valid_calls(run, text):
    grammar = plan(_chat(choice="required"), SMOLLM2)
    assert grammar.forced is None and grammar.trigger is None  # no trigger: the calls are the only output
    accepted, detail = run(grammar.grammar, text)
    assert accepted, detail
    _validate_calls(text)


def test_each_route_opens_with_its_tool_and_may_go_on_with_any(run):
    routes = dict(plan(_chat(choice="required"), SMOLLM2).routes)
    assert list(routes) == [t.name for t in HA_TOOLS]
    first = routes["HassTurnOff"]
    assert run(first, _tag(_call("HassTurnOff", area="kitchen")))[0]
    assert run(first, _tag(_call("HassTurnOff", area="kitchen"), _call("HassTurnOn", area="hall")))[0]
    assert not run(first, _tag(_call("HassTurnOn", area="kitchen")))[0]
    assert not run(first, _tag(_call("HassTurnOn", area="hall"), _call("HassTurnOff", area="kitchen")))[0]
    assert plan(_chat(choice=ToolChoiceNamed("HassTurnOff")), SMOLLM2).routes == ()  # one tool: nothing to route


@pytest.mark.parametrize("text", [
    _tag(_call("HassTurnOnn", name="light")),  # an unknown tool
    _tag(_call("HassTurnOn", name="light", brightness=3)),  # a key the tool does not have
    _tag(_call("HassTurnOn", domain=["lights"])),  # an enum value not listed
    _tag(_call("HassLightSet", brightness=101)),  # out of range
    _tag(_call("HassClimateSetTemperature", area="x")),  # a required argument missing
    _tag(_call("HassTurnOn", name="x" * 49)),  # over the string cap
    _tag(_call("HassTurnOn", domain=["light", "fan", "cover", "switch"])),  # over the array cap
    _tag(),  # no call at all
    _tag(*[_call("GetLiveContext")] * 5),  # over the parallel cap
    "Sure! " + _tag(_call("GetLiveContext")),  # free text
    '<tool_call>[{"name": "GetLiveContext", "arguments": {}}]</tool_call>',  # free whitespace
    _tag(_call("GetLiveContext")) + "\nDone.",  # text after the call
])
def test_required_rejects(run, text):
    grammar = plan(_chat(choice="required"), SMOLLM2).grammar
    accepted, detail = run(grammar, text)
    assert not accepted, detail


def test_parallel_off_allows_one_call(run):
    grammar = plan(_chat(choice="required", parallel=False), SMOLLM2).grammar
    assert run(grammar, _tag(_call("GetLiveContext")))[0]
    assert not run(grammar, _tag(_call("GetLiveContext"), _call("HassTurnOn", area="hall")))[0]


def test_legacy_functions_allow_one_call(run):
    grammar = plan(_chat(choice="required", legacy=True), SMOLLM2).grammar
    assert run(grammar, _tag(_call("GetLiveContext")))[0]
    assert not run(grammar, _tag(_call("GetLiveContext"), _call("GetLiveContext")))[0]


def test_named_tool_only(run):
    grammar = plan(_chat(choice=ToolChoiceNamed("HassLightSet")), SMOLLM2).grammar
    assert run(grammar, _tag(_call("HassLightSet", brightness=10)))[0]
    assert not run(grammar, _tag(_call("HassTurnOn", name="lamp")))[0]


def test_tool_choice_errors():
    with pytest.raises(GrammarError, match="'HassFly'") as err:
        plan(_chat(choice=ToolChoiceNamed("HassFly")), SMOLLM2)
    assert err.value.param == "tool_choice"
    for choice in ("required", ToolChoiceNamed("GetLiveContext")):
        with pytest.raises(GrammarError, match="no tools") as err:
            plan(_chat(tools=(), choice=choice), SMOLLM2)
        assert err.value.param == "tool_choice"


@pytest.mark.parametrize(("schema", "why"), [
    ({"type": "object", "properties": {"at": {"type": "string", "format": "color-hex"}}}, "color-hex"),
    ({"type": "object", "properties": {"at": {"type": "string", "pattern": "(?=a)b"}}}, "look-around"),
])
def test_a_schema_llguidance_cannot_compile(schema, why):
    bad = ToolSpec("HassBroken", "", schema)
    with pytest.raises(GrammarError, match=why) as err:
        plan(_chat(tools=(HASS_TURN_ON, bad)), SMOLLM2)
    assert err.value.param == "tools" and "'HassBroken'" in str(err.value)
    with pytest.raises(GrammarError, match=why) as err:
        plan(_chat(tools=(), fmt=ResponseFormat("json_schema", schema)), SMOLLM2)
    assert err.value.param == "response_format"


def test_local_refs_resolve_inside_the_tools_own_schema(run):
    """Pydantic-made parameters point into their own $defs; wrapped in the call object they still resolve."""
    schema = {"type": "object", "properties": {"mode": {"$ref": "#/$defs/Mode"}}, "required": ["mode"],
              "$defs": {"Mode": {"type": "string", "enum": ["heat", "cool"]}}}
    grammar = plan(_chat(tools=(ToolSpec("SetMode", "", schema),), choice="required"), SMOLLM2).grammar
    assert run(grammar, _tag(_call("SetMode", mode="cool")))[0]
    assert not run(grammar, _tag(_call("SetMode", mode="dry")))[0]


def test_auto_free_text_or_calls(run):
    p = plan(_chat(), SMOLLM2)
    assert p.trigger == "<tool_call>["
    assert p.forced == plan(_chat(choice="required"), SMOLLM2).grammar
    for text in ["Hello there! How are you?", "", "Line one.\nA <b>tag</b> and <tool"]:
        assert run(p.grammar, text, eos_only=False)[0], text
    for text in GOOD_CALLS:
        assert run(p.grammar, "I'll do it. " + text)[0]
        assert run(p.grammar, text)[0]


@pytest.mark.parametrize("text", [
    "ok <tool_call>[" + '{"name":"HassFly","arguments":{}}]</tool_call>',
    "ok " + _tag(_call("HassTurnOn", colour="red")),
    "ok " + _tag(_call("HassTurnOn")) + " and more text",
    "ok <tool_call> I changed my mind",
])
def test_auto_enforces_the_call_after_the_tag(run, text):
    accepted, detail = run(plan(_chat(), SMOLLM2).grammar, text)
    assert not accepted, detail


AFTER_A_RESULT = (*USER, Message("assistant", "", (ToolCall("call_1", "GetLiveContext", "{}"),)),
                  Message("tool", '{"success":true}', tool_call_id="call_1"))


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_after_a_result_the_text_opens_with_words(run, choice):
    """Once results are shown, the text branch is words: not empty, not opening with markup (the result block the
    135M model copied), never the call tag; a call after a result is the trigger's (forced) alone."""
    p = plan(ChatInput(AFTER_A_RESULT, HA_TOOLS, choice), SMOLLM2)
    for text in ["The kitchen light is on.", "\nYes, it did. <b>Done</b>", " 1 < 2"]:
        assert run(p.grammar, text, eos_only=False)[0], text
    for text in ["", " \n", '<tool_response>\n{"success":true}\n</tool_response>', "<b>Done</b>", GOOD_CALLS[0],
                 "Sure. " + GOOD_CALLS[0]]:
        assert not run(p.grammar, text, eos_only=False)[0], text
    if choice == "auto":
        assert p.trigger == "<tool_call>[" and p.forced == plan(_chat(choice="required"), SMOLLM2).grammar
    # a response format keeps its own grammar; before any result, text is as free as ever
    assert plan(ChatInput(AFTER_A_RESULT, HA_TOOLS, "none", response_format=ResponseFormat("json_object")),
                SMOLLM2).grammar.startswith("start: json")
    assert plan(_chat(choice="none"), SMOLLM2) is None


def test_hermes_one_object_per_tag(run):
    p = plan(_chat(), HERMES)
    assert p.trigger == "<tool_call>"
    one = '<tool_call>\n{"name":"HassTurnOn","arguments":{"area":"kitchen"}}\n</tool_call>'
    two = one + '\n<tool_call>{"name":"GetLiveContext","arguments":{}}</tool_call>'
    for text in (one, two, "Okay. " + two):
        assert run(p.grammar, text, eos_only=False)[0], text
    assert run(p.forced, two, eos_only=False)[0]
    assert not run(p.forced, "Okay. " + one, eos_only=False)[0]
    assert not run(p.forced, '<tool_call>[{"name":"GetLiveContext","arguments":{}}]</tool_call>', False)[0]
    single = plan(_chat(choice="required", parallel=False), HERMES).grammar
    assert run(single, one)[0]  # and nothing but EOS after it
    assert not run(single, two, eos_only=False)[0]


def test_json_object(run):
    grammar = plan(_chat(tools=(), fmt=ResponseFormat("json_object")), SMOLLM2).grammar
    assert run(grammar, '{"answer":"yes","n":[1,2.5,null],"o":{"k":true}}')[0]
    assert not run(grammar, '{"answer": "yes"}')[0]  # compact: no whitespace anywhere
    assert not run(grammar, '["a"]')[0]
    assert not run(grammar, 'Sure: {"a":1}')[0]


def test_json_schema_outputs_validate(run):
    grammar = plan(_chat(tools=(), fmt=ResponseFormat("json_schema", HA_TASK, "ha_task", True)), SMOLLM2).grammar
    long_summary = "word " * 51  # 255 characters: strings are capped at 256 where the schema sets no maxLength
    good = [{"summary": None, "steps": []}, {"summary": long_summary, "steps": ["a", "b"]}]
    for value in good:
        text = json.dumps(value, separators=(",", ":"))
        assert run(grammar, text)[0], text
        jsonschema.validate(value, HA_TASK)
    for value in [{"summary": "x"}, {"summary": "x", "steps": [], "extra": 1},
                  {"summary": "x", "steps": ["s"] * 9},  # arrays are capped at 8
                  {"summary": long_summary + "ab", "steps": []}]:
        assert not run(grammar, json.dumps(value, separators=(",", ":")))[0], value


def test_response_format_with_tools(run):
    fmt = ResponseFormat("json_schema", HA_TASK)
    p = plan(_chat(fmt=fmt), SMOLLM2)
    assert p.trigger == "<tool_call>[" and p.forced == plan(_chat(choice="required"), SMOLLM2).grammar
    assert run(p.grammar, '{"summary":"done","steps":["a"]}')[0]
    assert run(p.grammar, _tag(_call("GetLiveContext")))[0]
    assert not run(p.grammar, "Hello", eos_only=False)[0]
    required = plan(_chat(choice="required", fmt=fmt), SMOLLM2)
    assert required.trigger is None and not run(required.grammar, '{"summary":"done","steps":["a"]}')[0]
    none = plan(_chat(choice="none", fmt=fmt), SMOLLM2)
    assert run(none.grammar, '{"summary":"done","steps":["a"]}')[0]
    assert not run(none.grammar, _tag(_call("GetLiveContext")))[0]
