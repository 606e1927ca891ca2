"""The Responses API renderer on synthetic generations (no server, no model): every event and the final object
validate as the SDK's models, the SDK's own stream accumulation accepts the stream, Home Assistant's way of
reading call arguments works, and the real SDK client parses it through a mock transport. Also the store."""

from __future__ import annotations

import json

import httpx2
import openai
import pydantic
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from edgespec.server.chat_input import ChatDelta, Message, ToolCall
from edgespec.server.errors import APIError
from edgespec.server.responses_protocol import ResponsesRequest, to_chat_input
from edgespec.server.responses_render import ResponsesRenderer
from edgespec.server.responses_store import ResponseStore, conversation_after

MODEL = "SmolLM2-135M-Instruct"
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "HassTurnOn", "description": "Turns on a device", "strict": False,
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": []}}
REQ = ResponsesRequest(model=MODEL, input="Turn on the kitchen light.", tools=[TOOL], instructions="Be brief.",
                       max_output_tokens=64, temperature=0)
CALL_1 = ToolCall("call_1", "HassTurnOn", '{"name": "kitchen light"}')
CALL_2 = ToolCall("call_2", "HassTurnOn", '{"name": "hall light"}')
STATS = {"policy": "naive", "cached_prompt_tokens": 3}

CASES = {
    "text": [ChatDelta("Hel", tokens=1), ChatDelta("lo", tokens=1), ChatDelta(" there", tokens=2,
                                                                               finish_reason="stop", stats=STATS)],
    "call": [ChatDelta(calls=[CALL_1], tokens=9, finish_reason="tool_calls")],
    "text_then_call": [ChatDelta("Sure.", tokens=2), ChatDelta(calls=[CALL_1], tokens=9, finish_reason="tool_calls")],
    "two_calls": [ChatDelta(calls=[CALL_1], tokens=9), ChatDelta(calls=[CALL_2], tokens=9, finish_reason="tool_calls")],
    "two_calls_in_one_step": [ChatDelta(tokens=5), ChatDelta(calls=[CALL_1, CALL_2], tokens=13,
                                                             finish_reason="tool_calls")],
    "length": [ChatDelta("a", tokens=1), ChatDelta("b", tokens=1, finish_reason="length")],
    "empty": [ChatDelta(finish_reason="stop")],
    # a reasoning model's thinking (server/reasoning.py): a reasoning item before the answer
    "thought_then_text": [ChatDelta(reasoning="Greet", tokens=1), ChatDelta(reasoning=" them.", tokens=2),
                          ChatDelta("Hi", reasoning=" Briefly.", tokens=2, finish_reason="stop")],
    "thought_then_call": [ChatDelta(reasoning="Lights.", tokens=3), ChatDelta(tokens=2),
                          ChatDelta(calls=[CALL_1], tokens=9, finish_reason="tool_calls")],
    "length_while_thinking": [ChatDelta(reasoning="Hmm", tokens=1), ChatDelta(reasoning=", well", tokens=2,
                                                                             finish_reason="length")],
}
TEXTS = {"text": "Hello there", "text_then_call": "Sure.", "length": "ab", "thought_then_text": "Hi"}
CALLS = {"call": [CALL_1], "text_then_call": [CALL_1], "two_calls": [CALL_1, CALL_2],
         "two_calls_in_one_step": [CALL_1, CALL_2], "thought_then_call": [CALL_1]}
THOUGHTS = {"thought_then_text": ("Greet them. Briefly.", 3), "thought_then_call": ("Lights.", 5),
            "length_while_thinking": ("Hmm, well", 3)}  # (text, the tokens of the steps that only thought)


def stream(deltas, req=REQ, usage=None):
    renderer = ResponsesRenderer(MODEL, req, prompt_tokens=7)
    events = renderer.start()
    for d in deltas[:-1]:
        events += renderer.delta(d)
    events += renderer.finish(deltas[-1], usage)
    return renderer, events


def without_ids(obj):
    """The object with its generated ids and times blanked, to compare two renderings."""
    if isinstance(obj, dict):
        return {k: "*" if k in ("id", "item_id", "created_at", "completed_at") else without_ids(v)
                for k, v in obj.items()}
    return [without_ids(v) for v in obj] if isinstance(obj, list) else obj


@pytest.mark.parametrize("case", CASES)
def test_stream_events_validate_and_the_sdk_accumulates_them(case):
    renderer, events = stream(CASES[case])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    parsed = [EVENTS.validate_python(e) for e in events]
    assert [p.type for p in parsed] == [e["type"] for e in events]
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    incomplete = case.startswith("length")
    assert events[-1]["type"] == ("response.incomplete" if incomplete else "response.completed")
    assert sum(e["type"] in ("response.completed", "response.incomplete") for e in events) == 1
    for e in events[:2]:
        assert e["response"]["status"] == "in_progress" and e["response"]["output"] == []
        assert e["response"]["usage"] is None and e["response"]["id"] == renderer.id

    final = events[-1]["response"]
    response = Response.model_validate(final)
    assert response.id == renderer.id and response.status == ("incomplete" if incomplete else "completed")
    assert response.output_text == TEXTS.get(case, "")
    done = sorted((e for e in events if e["type"] == "response.output_item.done"), key=lambda e: e["output_index"])
    assert final["output"] == [e["item"] for e in done]
    assert [e["output_index"] for e in done] == list(range(len(final["output"])))
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    assert [(i["call_id"], i["name"], i["arguments"]) for i in calls] == [tuple(vars(c).values())
                                                                           for c in CALLS.get(case, [])]
    assert all(i["id"].startswith("fc_") and i["status"] == "completed" for i in calls)
    messages = [i for i in final["output"] if i["type"] == "message"]
    assert all(i["id"].startswith("msg_") for i in messages)
    assert final["incomplete_details"] == ({"reason": "max_output_tokens"} if incomplete else None)
    if incomplete:
        assert messages[0]["status"] == "incomplete"
    thoughts = [i for i in final["output"] if i["type"] == "reasoning"]
    text, tokens = THOUGHTS.get(case, ("", 0))
    assert [c["text"] for i in thoughts for c in i["content"]] == ([text] if text else [])
    assert all(i["id"].startswith("rs_") for i in thoughts) and final["output"][:len(thoughts)] == thoughts
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == text
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == tokens

    # the SDK's responses.stream() accumulation: raises on changed ids, unfinished items, bad order
    state = ResponseStreamState(input_tools=[TOOL], text_format=openai.omit)
    for p in parsed:
        state.handle_event(p)
    snapshot = state._ResponseStreamState__current_snapshot
    if incomplete:
        assert state._completed_response is None  # the SDK's get_final_response() wants response.completed
    else:
        assert state._completed_response.model_dump(exclude_none=True) == response.model_dump(exclude_none=True)
    assert [i.type for i in snapshot.output] == [i["type"] for i in final["output"]]
    assert "".join(c.text for i in snapshot.output if i.type == "message" for c in i.content) == TEXTS.get(case, "")


@pytest.mark.parametrize("case", CASES)
def test_whole_response_equals_the_streamed_one(case):
    _, events = stream(CASES[case])
    whole = ResponsesRenderer(MODEL, REQ, prompt_tokens=7).response(CASES[case])
    Response.model_validate(whole)
    assert without_ids(whole) == without_ids(events[-1]["response"])


def test_call_items_are_added_with_empty_arguments_as_home_assistant_needs():
    _, events = stream(CASES["two_calls"])
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["type"], i["arguments"], i["status"]) for i in added] == [("function_call", "", "in_progress")] * 2
    # Home Assistant's openai_conversation: keep the added item, append the deltas, json.loads at .done
    current, got = None, []
    for e in events:
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call":
            current = dict(e["item"])
        elif e["type"] == "response.function_call_arguments.delta":
            current["arguments"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.done":
            got.append((current["call_id"], current["name"], json.loads(current["arguments"])))
    assert got == [("call_1", "HassTurnOn", {"name": "kitchen light"}),
                   ("call_2", "HassTurnOn", {"name": "hall light"})]


def test_text_then_call_closes_the_message_before_the_call():
    _, events = stream(CASES["text_then_call"])
    kinds = [e["type"] for e in events[2:]]
    assert kinds == ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["output_index"] for e in events[2:-1]] == [0] * 6 + [1] * 4


def test_text_events_carry_the_text():
    _, events = stream(CASES["text"])
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [e["delta"] for e in deltas] == ["Hel", "lo", " there"]
    assert all(e["content_index"] == 0 and e["output_index"] == 0 and e["logprobs"] == [] for e in deltas)
    added = next(e for e in events if e["type"] == "response.output_item.added")["item"]
    assert added["content"] == [] and added["status"] == "in_progress"
    part = next(e for e in events if e["type"] == "response.content_part.added")["part"]
    assert part == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    assert next(e for e in events if e["type"] == "response.output_text.done")["text"] == "Hello there"


def test_usage_echoes_and_decoding_statistics():
    _, events = stream(CASES["text"])
    final = events[-1]["response"]
    assert final["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
                              "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 11}
    assert final["decoding"] == STATS
    assert final["tools"] == [TOOL] and final["tool_choice"] == "auto" and final["parallel_tool_calls"] is True
    assert final["text"] == {"format": {"type": "text"}} and final["instructions"] == "Be brief."
    assert (final["max_output_tokens"], final["temperature"], final["top_p"]) == (64, 0, 1)
    assert final["object"] == "response" and final["model"] == MODEL and final["error"] is None
    _, events = stream(CASES["text"], usage=(20, 5, 8))
    usage = events[-1]["response"]["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (20, 5, 25)
    assert usage["input_tokens_details"]["cached_tokens"] == 8


def test_text_format_echo_gets_a_name_the_sdk_requires():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    req = ResponsesRequest(model=MODEL, input="x", text={"format": {"type": "json_schema", "schema": schema}},
                           previous_response_id="resp_0", metadata={"k": "v"}, user="u1")
    final = ResponsesRenderer(MODEL, req, 1).response([ChatDelta('{"n": 1}', finish_reason="stop")])
    assert final["text"]["format"] == {"type": "json_schema", "schema": schema, "name": "response"}
    assert (final["previous_response_id"], final["metadata"], final["user"]) == ("resp_0", {"k": "v"}, "u1")
    assert Response.model_validate(final).text.format.type == "json_schema"


def test_failed_stream():
    renderer = ResponsesRenderer(MODEL, REQ, 7)
    events = renderer.start() + renderer.delta(ChatDelta("Hi"))
    events += renderer.failed(APIError(503, "no room in the KV cache", None, "kv_cache_full"))
    last = EVENTS.validate_python(events[-1])
    assert last.type == "response.failed" and last.response.status == "failed"
    assert "kv_cache_full" in last.response.error.message and last.sequence_number == len(events) - 1


def test_assistant_message_and_the_stored_conversation():
    renderer, _ = stream(CASES["text_then_call"])
    reply = renderer.assistant_message()
    assert reply == Message("assistant", "Sure.", (CALL_1,))
    chat = to_chat_input(REQ)
    assert conversation_after(chat, REQ.instructions, reply) == (Message("user", REQ.input), reply)
    plain = ResponsesRequest(model=MODEL, input="hi")
    assert conversation_after(to_chat_input(plain), None, reply) == (Message("user", "hi"), reply)


def test_store_put_get_and_lru_eviction():
    store = ResponseStore(max_entries=2)
    a, b, c = (Message("user", "a"),), (Message("user", "b"),), (Message("user", "c"),)
    store.put("resp_a", a)
    store.put("resp_b", b)
    assert store.get("resp_a") == a  # now the most recently used
    store.put("resp_c", c)
    assert "resp_b" not in store and len(store) == 2
    assert store.get("resp_a") == a and store.get("resp_c") == c
    with pytest.raises(APIError) as info:
        store.get("resp_b")
    err = info.value
    assert (err.status, err.param, err.code) == (400, "previous_response_id", "previous_response_not_found")
    assert "'resp_b'" in err.message and "last 2 responses" in err.message


# the real SDK client against the renderer, through a mock transport (the route's framing: event + data lines)


def sdk_client(deltas) -> openai.OpenAI:
    def handle(request: httpx2.Request) -> httpx2.Response:
        req = ResponsesRequest.model_validate(json.loads(request.content))
        to_chat_input(req)
        renderer = ResponsesRenderer(MODEL, req, prompt_tokens=7)
        if not req.stream:
            return httpx2.Response(200, json=renderer.response(deltas))
        events = renderer.start()
        for d in deltas[:-1]:
            events += renderer.delta(d)
        events += renderer.finish(deltas[-1])
        body = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)
        return httpx2.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

    return openai.OpenAI(base_url="http://edgespec.test/v1", api_key="k", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(handle)),
                         _strict_response_validation=True)


def test_sdk_create_and_stream_parse_it():
    client = sdk_client(CASES["text"])
    response = client.responses.create(model=MODEL, input="Say hello", max_output_tokens=16, temperature=0)
    assert response.output_text == "Hello there" and response.usage.output_tokens == 4
    kinds = [e.type for e in client.responses.create(model=MODEL, input="Say hello", stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    with client.responses.stream(model=MODEL, input="Say hello") as s:
        texts = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(texts) == final.output_text == "Hello there"


def test_sdk_stream_parses_calls_and_text_format():
    strict_tool = {**TOOL, "strict": True}
    with sdk_client(CASES["two_calls"]).responses.stream(model=MODEL, input="x", tools=[strict_tool]) as s:
        final = s.get_final_response()
    assert [c.parsed_arguments for c in final.output] == [{"name": "kitchen light"}, {"name": "hall light"}]

    class Answer(pydantic.BaseModel):
        n: int

    deltas = [ChatDelta('{"n":', tokens=3), ChatDelta(" 4}", tokens=2, finish_reason="stop")]
    with sdk_client(deltas).responses.stream(model=MODEL, input="x", text_format=Answer) as s:
        assert s.get_final_response().output_parsed == Answer(n=4)
