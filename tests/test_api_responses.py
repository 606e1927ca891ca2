"""End-to-end: POST /v1/responses on the real server, driven by the official `openai` client the way the SDK's
users and Home Assistant's openai_conversation drive it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
FINAL = ("response.completed", "response.incomplete")

# Home Assistant's intent tools as openai_conversation sends them (voluptuous schemas converted, strict false).
NAME_AREA_DOMAIN = {"type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                                                     "domain": {"type": "array", "items": {"type": "string"}}},
                    "required": []}
HA_TOOLS = [
    {"type": "function", "name": "HassTurnOn", "description": "Turns on/opens a device or entity",
     "parameters": NAME_AREA_DOMAIN, "strict": False},
    {"type": "function", "name": "HassTurnOff", "description": "Turns off/closes a device or entity",
     "parameters": NAME_AREA_DOMAIN, "strict": False},
    {"type": "function", "name": "GetLiveContext", "description": "Provides real-time information about the "
     "current state of devices", "parameters": {"type": "object", "properties": {}, "required": []},
     "strict": False},
]
HA_INPUT = [
    {"type": "message", "role": "developer", "content": "You are a voice assistant for Home Assistant. "
     "Answer questions about the world truthfully. Use the tools to control the home."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Turn on the kitchen light."}]},
]


def create(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 16)
    return client.responses.create(model=MODEL, **kw)


def assert_error(exc: openai.APIStatusError, status: int, param: str | None, code: str | None = None) -> dict:
    """The status code and the OpenAI error object, as the SDK parses it."""
    assert exc.status_code == status
    err = exc.response.json()["error"]
    assert err["param"] == param and isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    assert exc.param == param
    return err


def assert_usage(usage, max_output: int):
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= max_output
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0


def collect(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in FINAL and sum(e.type in FINAL for e in events) == 1
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    return events


def test_create_whole(client):
    response = create(client, input="Say hello")
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text
    assert [item.type for item in response.output] == ["message"]
    assert_usage(response.usage, 16)
    assert "decoding" in response.model_extra  # the server's statistics extension
    assert response.max_output_tokens == 16 and response.temperature == 0 and response.tools == []


def test_create_streamed(client):
    events = collect(create(client, input="Say hello", stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text
    assert_usage(final.usage, 16)


def test_sdk_stream_helper(client):
    with client.responses.stream(model=MODEL, input="Say hello", max_output_tokens=96, temperature=0) as stream:
        events = collect(stream)
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        if events[-1].type == "response.completed":
            final = stream.get_final_response()
            assert final.output_text == text and final.id == events[0].response.id
        else:  # the SDK's helper only builds a final response from response.completed
            with pytest.raises(RuntimeError):
                stream.get_final_response()
    assert text


def test_home_assistant_tool_conversation(client):
    first = client.responses.create(model=MODEL, input=HA_INPUT, tools=HA_TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=128, temperature=0, top_p=1.0,
                                    user="01JCONVERSATION", store=False, stream=True)
    events = collect(first)
    assert events[-1].type == "response.completed"
    # as Home Assistant reads a call: the added item, the argument deltas appended to it, json.loads at .done
    current, calls = None, []
    for e in events:
        if e.type == "response.output_item.added" and e.item.type == "function_call":
            current = e.item
            assert current.arguments == ""
        elif e.type == "response.function_call_arguments.delta":
            current.arguments += e.delta
        elif e.type == "response.function_call_arguments.done":
            calls.append((current.call_id, current.name, json.loads(current.arguments)))
    assert len(calls) == 1
    call_id, name, args = calls[0]
    tool = next(t for t in HA_TOOLS if t["name"] == name)
    jsonschema.validate(args, tool["parameters"])
    items = [i for i in events[-1].response.output if i.type == "function_call"]
    assert [(i.call_id, i.name, json.loads(i.arguments)) for i in items] == calls
    assert call_id.startswith("call_") and items[0].id.startswith("fc_")

    second_input = [*HA_INPUT,
                    {"type": "function_call", "name": name, "arguments": items[0].arguments, "call_id": call_id},
                    {"type": "function_call_output", "call_id": call_id, "output": json.dumps({"success": True})}]
    second = client.responses.create(model=MODEL, input=second_input, tools=HA_TOOLS, tool_choice="none",
                                     max_output_tokens=32, temperature=0, store=False)
    assert second.status in ("completed", "incomplete")
    assert [i.type for i in second.output] == ["message"]
    assert second.output_text


def test_previous_response_id(client):
    first = create(client, input="My name is Ada. Say hi to me.")
    assert first.store is not False
    follow_up = create(client, input="What is my name?", previous_response_id=first.id)
    assert follow_up.previous_response_id == first.id and follow_up.status in ("completed", "incomplete")
    alone = create(client, input="What is my name?")
    # the stored conversation (the first question and its answer) is in the follow-up's prompt
    assert follow_up.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens

    with pytest.raises(openai.BadRequestError) as info:
        create(client, input="Hi", previous_response_id="resp_does_not_exist")
    assert_error(info.value, 400, "previous_response_id", "previous_response_not_found")

    unstored = create(client, input="Say hi.", store=False)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input="Again", previous_response_id=unstored.id)
    assert_error(info.value, 400, "previous_response_id", "previous_response_not_found")


def test_text_format_json_schema(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["capital", "sure"],
              "properties": {"capital": {"type": "string", "enum": ["Paris", "London", "Rome", "Berlin"]},
                             "sure": {"type": "boolean"}}}
    response = create(client, input="What is the capital of France?", max_output_tokens=64,
                      text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "answer"


@pytest.mark.parametrize("stream", [False, True])
def test_non_function_tool_is_a_400(client, stream):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input="What's the weather?", tools=[{"type": "web_search"}], stream=stream)
    assert_error(info.value, 400, "tools")


def test_bad_input_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input=[{"role": "user", "content": [{"type": "input_image",
                                                            "image_url": "http://example.com/a.png"}]}])
    assert_error(info.value, 400, "input")
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input="x", text={"format": {"type": "json_schema", "name": "a"}})
    assert_error(info.value, 400, "text.format.schema")
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="no-such-model", input="x")
    assert_error(info.value, 404, "model", "model_not_found")
