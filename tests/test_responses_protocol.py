"""The Responses API request and its translation into ChatInput (no server): Home Assistant's shapes, the
SDK's short forms, and 400s that name the parameter."""

from __future__ import annotations

import pydantic
import pytest

from edgespec.server.chat_input import Message, ResponseFormat, ToolCall, ToolChoiceNamed, ToolSpec
from edgespec.server.errors import APIError
from edgespec.server.protocol import SamplingFields
from edgespec.server.responses_protocol import ResponsesRequest, sampling_fields, to_chat_input

MODEL = "SmolLM2-135M-Instruct"

# Home Assistant's openai_conversation: intent tools with strict false, parameters from voluptuous.
HA_TOOLS = [
    {"type": "function", "name": "HassTurnOn", "description": "Turns on/opens a device or entity",
     "parameters": {"type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                                                     "domain": {"type": "array", "items": {"type": "string"}}},
                    "required": []},
     "strict": False},
    {"type": "function", "name": "GetLiveContext", "description": "Provides real-time information",
     "parameters": {"type": "object", "properties": {}, "required": []}, "strict": False},
]
HA_FIRST = {
    "model": MODEL, "stream": True, "max_output_tokens": 150, "top_p": 1.0, "temperature": 1.0,
    "user": "01JABCDEF", "store": False, "tools": HA_TOOLS,
    "input": [
        {"type": "message", "role": "developer", "content": "You are a voice assistant for Home Assistant."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Turn on the kitchen light."}]},
    ],
}
HA_CALL = {"type": "function_call", "name": "HassTurnOn", "arguments": '{"name": "kitchen light"}',
           "call_id": "call_abc"}
HA_OUTPUT = {"type": "function_call_output", "call_id": "call_abc", "output": '{"success": true}'}


def chat(body: dict, history=()):
    return to_chat_input(ResponsesRequest.model_validate(body), history)


def rejected(body: dict, param: str) -> APIError:
    with pytest.raises(APIError) as info:
        chat(body)
    err = info.value
    assert (err.status, err.param, err.code) == (400, param, "invalid_value")
    assert err.message
    return err


def test_home_assistant_first_turn():
    req = ResponsesRequest.model_validate({**HA_FIRST, "reasoning": {"effort": "low", "summary": "auto"},
                                           "include": ["reasoning.encrypted_content"]})
    got = to_chat_input(req)
    assert got.messages == (Message("system", "You are a voice assistant for Home Assistant."),
                            Message("user", "Turn on the kitchen light."))
    assert [t.name for t in got.tools] == ["HassTurnOn", "GetLiveContext"]
    assert got.tools[0] == ToolSpec("HassTurnOn", "Turns on/opens a device or entity", HA_TOOLS[0]["parameters"])
    assert got.tool_choice == "auto" and got.parallel_tool_calls and got.response_format is None
    assert sampling_fields(req) == {"model": MODEL, "temperature": 1.0, "top_p": 1.0, "max_tokens": 150,
                                    "stream": True, "decoding": None}
    assert req.store is False


def test_home_assistant_second_turn_with_a_call_and_its_output():
    body = {**HA_FIRST, "input": [*HA_FIRST["input"], HA_CALL, HA_OUTPUT], "tool_choice": "none"}
    got = chat(body)
    call = ToolCall("call_abc", "HassTurnOn", '{"name": "kitchen light"}')
    assert got.messages[2:] == (Message("assistant", "", (call,)),
                                Message("tool", '{"success": true}', tool_call_id="call_abc", name="HassTurnOn"))
    assert got.tool_choice == "none" and not got.calls_allowed


def test_home_assistant_structured_output_with_nullable_types():
    schema = {"type": "object", "properties": {"name": {"type": ["string", "null"]}, "count": {"type": "integer"}},
              "required": ["name", "count"], "additionalProperties": False}
    body = {"model": MODEL, "input": [{"type": "message", "role": "user", "content": "Count the lights."}],
            "text": {"format": {"type": "json_schema", "name": "ha_task", "schema": schema, "strict": True}},
            "max_output_tokens": 3, "store": False}
    got = chat(body)
    assert got.response_format == ResponseFormat("json_schema", schema=schema, name="ha_task", strict=True)
    assert got.tools == ()


def test_string_input_instructions_and_role_only_items():
    got = chat({"model": MODEL, "input": "Say hello", "instructions": "Be brief."})
    assert got.messages == (Message("system", "Be brief."), Message("user", "Say hello"))
    got = chat({"model": MODEL, "input": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": [{"type": "output_text", "text": "Hey",
                                                                             "annotations": []}]},
                                          {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "input_text", "text": "b"}]}]})
    assert got.messages == (Message("user", "hi"), Message("assistant", "Hey"), Message("user", "ab"))


def test_calls_join_one_assistant_turn():
    body = {"model": MODEL, "input": [
        {"role": "user", "content": "Lights on in two rooms"},
        {"type": "message", "role": "assistant", "content": "Sure.", "id": "msg_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_1", "name": "HassTurnOn", "arguments": '{"area": "kitchen"}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "HassTurnOn", "arguments": '{"area": "hall"}'},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "ok"}]},
        {"type": "function_call_output", "call_id": "call_1", "output": "done"},
        {"type": "function_call", "call_id": "call_3", "name": "GetLiveContext", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_9", "output": "?"},
    ], "tools": HA_TOOLS}
    got = chat(body).messages
    assert got[1] == Message("assistant", "Sure.", (ToolCall("call_1", "HassTurnOn", '{"area": "kitchen"}'),
                                                    ToolCall("call_2", "HassTurnOn", '{"area": "hall"}')))
    assert got[2] == Message("tool", "ok", tool_call_id="call_2", name="HassTurnOn")
    assert got[3] == Message("tool", "done", tool_call_id="call_1", name="HassTurnOn")
    assert got[4] == Message("assistant", "", (ToolCall("call_3", "GetLiveContext", "{}"),))
    assert got[5] == Message("tool", "?", tool_call_id="call_9", name=None)  # an unknown call: no name
    assert len(got) == 6


def test_history_goes_after_the_instructions():
    call = ToolCall("call_7", "HassTurnOn", "{}")
    history = (Message("user", "Lights on"), Message("assistant", "", (call,)))
    got = chat({"model": MODEL, "instructions": "Be brief.", "previous_response_id": "resp_1",
                "input": [{"type": "function_call_output", "call_id": "call_7", "output": "ok"}]}, history)
    assert got.messages == (Message("system", "Be brief."), *history,
                            Message("tool", "ok", tool_call_id="call_7", name="HassTurnOn"))


def test_tool_choice_and_text_formats():
    got = chat({"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
                "text": {"format": {"type": "json_object"}}})
    assert got.tools == (ToolSpec("f"),)
    assert got.tools[0].parameters == {"type": "object", "properties": {}}
    assert got.tool_choice == ToolChoiceNamed("f") and not got.parallel_tool_calls
    assert got.response_format == ResponseFormat("json_object")
    got = chat({"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f"}],
                "tool_choice": "required", "text": {"format": {"type": "text"}, "verbosity": "low"}})
    assert got.tool_choice == "required" and got.response_format is None
    req = ResponsesRequest.model_validate({"model": MODEL, "input": "x", "tools": None, "tool_choice": None})
    assert (req.tools, req.tool_choice) == ([], "auto")


def test_decoding_extension_reaches_sampling_fields():
    req = ResponsesRequest.model_validate({"model": MODEL, "input": "x", "decoding": {"policy": "naive", "k": 2}})
    fields = sampling_fields(req)
    assert fields["decoding"] == {"policy": "naive", "k": 2}
    assert SamplingFields(**fields).policy_choice() == ("naive", {"k": 2})
    req = ResponsesRequest.model_validate({"model": MODEL, "input": "x", "decoding": "naive"})
    assert SamplingFields(**sampling_fields(req)).policy_choice() == ("naive", {})


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools"),
    ({"tools": ["f"]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": 3}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"tool_choice": {"type": "function", "name": "g"}, "tools": [{"type": "function", "name": "f"}]},
     "tool_choice"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input"),
    ({"input": [{"role": "user", "content": 3}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input"),
    ({"input": [{"content": "no role"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input"),  # no arguments
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input"),  # no output
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]}, "input"),
])
def test_bad_shapes_name_the_parameter(body, param):
    rejected({"model": MODEL, "input": "x", **body}, param)


def test_web_search_message_says_what_is_supported():
    assert "only function tools" in rejected({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]},
                                             "tools").message


@pytest.mark.parametrize("body, loc", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"input": 5}, "input"),
])
def test_field_ranges_are_pydantic_errors(body, loc):
    # the app turns these into 400s naming the field (server/errors.py)
    with pytest.raises(pydantic.ValidationError) as info:
        ResponsesRequest.model_validate({"model": MODEL, "input": "x", **body})
    assert info.value.errors()[0]["loc"][0] == loc
