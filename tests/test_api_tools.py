"""End-to-end: tools, tool_choice, the legacy functions and response_format through POST /v1/chat/completions on
the real server, in the request shapes of extended_openai_conversation, home-llm, the OpenAI SDK and curl
(../shared/notes/tools.md, §3.6 and §6). Every call must be a listed tool whose arguments validate against its
parameters; which tool the model picks is measured by bench/tools.py, not tested here (except a named one)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
HA = json.loads((REPO / "bench/prompts/home_assistant.json").read_text())
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": "Bearer test-key"}
COMMANDS = [c["prompt"] for c in HA["commands"]]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in HA["tools"]}
CALL_TOKENS = 96  # a call takes 20-40 tokens

# in EOC's key order: the schema is printed in the prompt, and with "required" first the greedy call looped in
# entity_id's digits to the 48-character cap (101 tokens, past max_tokens)
SERVICE = {"type": "object", "properties": {"domain": {"type": "string"}, "service": {"type": "string"},
                                            "service_data": {"type": "object",
                                                             "properties": {"entity_id": {"type": "string"}},
                                                             "required": ["entity_id"]}},
           "required": ["domain", "service", "service_data"]}
EXECUTE_SERVICES = {"name": "execute_services",  # extended_openai_conversation's function
                    "description": "Use this function to execute service of devices in Home Assistant.",
                    "parameters": {"type": "object", "properties": {"list": {"type": "array", "items": SERVICE}},
                                   "required": ["list"]}}
EXEC_TOOLS, EXEC_PARAMS = [{"type": "function", "function": EXECUTE_SERVICES}], {
    "execute_services": EXECUTE_SERVICES["parameters"]}
HA_TASK = {"type": "object", "properties": {  # a home-llm style structured answer
    "to_say": {"type": "string", "maxLength": 60}, "service": {"enum": ["turn_on", "turn_off", "none"]},
    "target_device": {"type": ["string", "null"]}}, "required": ["to_say", "service", "target_device"],
    "additionalProperties": False}


def ha_body(prompt, tools=HA["tools"], system=HA["system"], **kw) -> dict:
    """A greedy Home Assistant request: its system prompt (None: none), a user message, the intent tools (None:
    no tools field)."""
    messages = [{"role": "system", "content": system}] * bool(system) + [{"role": "user", "content": prompt}]
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": CALL_TOKENS} | kw
    return body if tools is None else {**body, "tools": tools}


def create(client, body: dict, **kw):
    """Through the SDK (`decoding` as extra_body); plain JSON back, the server's `decoding` statistics kept. With
    stream=True: the chunks."""
    body = {**body, **kw}
    extra = {"decoding": body.pop("decoding")} if "decoding" in body else None
    r = client.chat.completions.create(**body, extra_body=extra)
    return [c.model_dump() for c in r] if body.get("stream") else r.model_dump()


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def sse(url: str, body: dict) -> list[dict]:  # a raw stream's chunks, up to the [DONE] it must end with
    chunks, done = [], False
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                assert not done, "data after [DONE]"
                done = line == "data: [DONE]"
                chunks += [] if done else [json.loads(line[6:])]
    assert done
    return chunks


def join(chunks: list[dict]) -> dict:
    """A stream put back together by OpenAI's accumulation rule: a call's id, type and name from its first
    delta (later ones must not repeat them, or a client would double the name), arguments concatenated."""
    content, calls, finishes = "", {}, []
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    for choice in choices:
        content += choice["delta"].get("content") or ""
        for part in choice["delta"].get("tool_calls") or []:
            fn = part.get("function") or {}
            if part["index"] not in calls:
                assert part["id"] and part["type"] == "function" and fn.get("name"), part
                calls[part["index"]] = {"id": part["id"], "type": "function",
                                        "function": {"name": fn["name"], "arguments": ""}}
            else:
                assert not part.get("id") and not fn.get("name"), part
            calls[part["index"]]["function"]["arguments"] += fn.get("arguments") or ""
        if choice["finish_reason"] is not None:
            finishes.append(choice["finish_reason"])
    assert len(finishes) == 1 and choices[-1]["finish_reason"] == finishes[0]
    assert sorted(calls) == list(range(len(calls)))
    usage = [c["usage"] for c in chunks if not c["choices"]]
    return {"content": content, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finishes[0],
            "usage": usage[0] if usage else None}


def valid_calls(tool_calls: list[dict], params: dict) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, checked: a listed tool, arguments that validate against its parameters."""
    out = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]
    for call, (name, args) in zip(tool_calls, out, strict=True):
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 5, call
        assert name in params, f"{name!r} is not a listed tool"
        jsonschema.validate(args, params[name])
    return out


def answer(r: dict, params: dict = PARAMS) -> list[tuple[str, dict]]:
    """A non-streamed answer's calls, checked: valid calls and finish tool_calls, or text (stop or length)."""
    choice, message = r["choices"][0], r["choices"][0]["message"]
    assert message["role"] == "assistant" and message.get("function_call") is None
    calls = valid_calls(message.get("tool_calls") or [], params)
    if calls:
        assert choice["finish_reason"] == "tool_calls"
        assert message["content"] is None or isinstance(message["content"], str)
    else:
        assert choice["finish_reason"] in ("stop", "length")
        assert isinstance(message["content"], str) and "<tool_call>" not in message["content"]
    return calls


def same_answer(r: dict) -> tuple:
    """What two runs of one greedy request must share (call ids are random)."""
    choice = r["choices"][0]
    return (choice["message"]["content"], choice["finish_reason"], answer(r), r["usage"]["completion_tokens"])


@pytest.fixture(scope="module")
def required(client) -> dict[str, dict]:
    """Each device command with tool_choice required (speculative), asked once for the tests that compare."""
    return {p: create(client, ha_body(p, tool_choice="required", decoding="speculative")) for p in COMMANDS}


# 1. extended_openai_conversation: non-streamed, execute_services, then the legacy functions


def test_eoc_call_then_its_result(client):
    first = create(client, ha_body(COMMANDS[1], tools=EXEC_TOOLS, tool_choice="auto"))
    assert answer(first, EXEC_PARAMS) and first["choices"][0]["finish_reason"] == "tool_calls"
    assert first["decoding"]["tool_choice"]["call"] is True and "route" not in first["decoding"]["tool_choice"]
    call = first["choices"][0]["message"]["tool_calls"][0]
    messages = [*ha_body(COMMANDS[1])["messages"], {"role": "assistant", "tool_calls": [call]},  # no `content` key
                {"role": "tool", "tool_call_id": call["id"], "name": "execute_services",
                 "content": '{"success": true}'},
                {"role": "user", "name": "alice", "content": "Thanks. Did it work?"}]
    r = create(client, ha_body("", tools=EXEC_TOOLS, messages=messages, tool_choice="none", max_tokens=24))
    # words, not the result's markup: unconstrained, the 135M model's greedy reply here is a copy of the result
    # block (server/structured.py, _SPOKEN)
    assert answer(r, EXEC_PARAMS) == [] and r["choices"][0]["message"]["content"].strip()
    assert "<tool_" not in r["choices"][0]["message"]["content"]


def test_eoc_legacy_functions(client):
    body = ha_body(COMMANDS[1], tools=None, functions=[EXECUTE_SERVICES], function_call="auto")
    r = create(client, body)
    choice, message = r["choices"][0], r["choices"][0]["message"]
    assert message.get("tool_calls") is None
    fc = message.get("function_call") or {"name": "execute_services", "arguments": '{"list":[]}'}
    if message.get("function_call") is not None:
        assert choice["finish_reason"] == "function_call" and fc["name"] == "execute_services"
        jsonschema.validate(json.loads(fc["arguments"]), EXECUTE_SERVICES["parameters"])
    else:  # the trigger did not fire: text
        assert choice["finish_reason"] in ("stop", "length") and isinstance(message["content"], str)
    # the follow-up: the call as the assistant's function_call, its result as a `function` message
    follow = [*body["messages"], {"role": "assistant", "content": None, "function_call": fc},
              {"role": "function", "name": "execute_services", "content": '{"success": true}'}]
    again = create(client, {**body, "messages": follow, "max_tokens": 8})["choices"][0]
    assert again["finish_reason"] in ("stop", "length", "function_call") and again["message"]["tool_calls"] is None


# 2. home-llm: streamed, raw SSE


def test_home_llm_streamed_required(server_url, required):
    prompt = COMMANDS[5]
    cut = prompt.index(" in ")  # two text parts
    body = ha_body([{"type": "text", "text": prompt[:cut]}, {"type": "text", "text": prompt[cut:]}],
                   tool_choice="required")
    got = join(sse(server_url, body))
    assert got["finish_reason"] == "tool_calls" and got["content"] == ""
    calls = valid_calls(got["tool_calls"], PARAMS)
    assert calls and calls == answer(required[prompt])  # the parts join into the same prompt


def test_home_llm_streamed_json_schema(server_url):
    fmt = {"type": "json_schema", "json_schema": {"name": "ha_task", "strict": True, "schema": HA_TASK}}
    body = ha_body([{"type": "text", "text": COMMANDS[1]}], tools=None, response_format=fmt)
    got = join(sse(server_url, body))
    assert got["finish_reason"] == "stop" and got["tool_calls"] == []
    jsonschema.validate(json.loads(got["content"]), HA_TASK)


# 3. the OpenAI SDK


def test_required_calls_a_listed_tool(required):
    for prompt, r in required.items():
        calls = answer(r)
        assert calls and r["choices"][0]["finish_reason"] == "tool_calls", prompt
        assert r["decoding"]["policy"] == "speculative"
        choice = r["decoding"]["tool_choice"]
        assert "trigger_logprob" not in choice  # required: no trigger to score
        route = choice["route"]  # the route decides which tool the first call is
        assert calls[0][0] == route["chose"] == max(route["scores"], key=route["scores"].get), prompt


@pytest.mark.parametrize("prompt", [COMMANDS[0], COMMANDS[6]])
def test_named_tool_choice(client, prompt):
    r = create(client, ha_body(prompt, tool_choice={"type": "function", "function": {"name": "HassTurnOff"}}))
    assert answer(r) and answer(r)[0][0] == "HassTurnOff"


def test_tool_choice_none_is_text_as_without_tools(client):
    none = create(client, ha_body(COMMANDS[1], tool_choice="none", max_tokens=16))
    plain = create(client, ha_body(COMMANDS[1], tools=None, max_tokens=16))
    assert answer(none) == [] and "tool_choice" not in none["decoding"]
    # the tools are left out of the prompt: the answer without them
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert none["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"] != ""


@pytest.mark.parametrize("prompt", COMMANDS)
def test_auto_call_or_text(client, required, prompt):
    r = create(client, ha_body(prompt, tool_choice="auto", decoding="speculative"))
    calls = answer(r)
    choice = r["decoding"]["tool_choice"]
    assert choice["call"] == (choice["trigger_logprob"] >= choice["threshold"])
    if choice["call"]:  # a fired trigger decodes under the required grammar: the required answer
        assert calls and calls == answer(required[prompt])
        assert calls[0][0] == choice["route"]["chose"]
    else:
        assert "route" not in choice


def test_parallel_tool_calls_false(client):
    r = create(client, ha_body(COMMANDS[3], tool_choice="required", parallel_tool_calls=False))
    assert len(answer(r)) == 1


def test_streamed_required_with_usage_matches_non_streamed(client, required):
    prompt = COMMANDS[1]
    chunks = create(client, ha_body(prompt, tool_choice="required", decoding="speculative"), stream=True,
                    stream_options={"include_usage": True})
    got, whole = join(chunks), required[prompt]
    assert got["finish_reason"] == "tool_calls" and got["content"] == ""
    calls, alone = got["tool_calls"], whole["choices"][0]["message"]["tool_calls"]
    assert valid_calls(calls, PARAMS) == answer(whole)
    assert [c["function"] for c in calls] == [c["function"] for c in alone]  # the same JSON strings
    assert {c["id"] for c in calls}.isdisjoint(c["id"] for c in alone)
    assert chunks[-1]["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
    assert 0 < got["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_response_format_json_object(client):
    prompt = 'Reply in JSON with the keys "name" and "age" for Alice, who is 30.'
    r = create(client, ha_body(prompt, None, None, max_tokens=64, response_format={"type": "json_object"}))
    assert r["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize("prompt", HA["structured"]["prompts"])
def test_response_format_json_schema(client, prompt):
    schema = HA["structured"]["schema"]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}}
    r = create(client, ha_body(prompt, None, None, max_tokens=128, response_format=fmt))
    assert r["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), schema)


# 4. curl: raw JSON over httpx


def with_string(**kw) -> dict:  # a tool whose one parameter, a string, llguidance cannot compile
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", **kw}}}}}


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": HA["tools"][:2], "tool_choice": {"type": "function", "function": {"name": "HassNope"}}}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [with_string(format="no-such-format")]}, "tools"),
    ({"tools": [*HA["tools"][:1], with_string(pattern="(?<=a)b")], "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/x"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": HA["tools"], "decoding": "outline"}, "decoding"),
    ({"functions": [EXECUTE_SERVICES], "function_call": {"name": "nope"}}, "function_call"),
])
def test_bad_request(server_url, extra, param):
    r = post(server_url, ha_body(COMMANDS[1], tools=None, max_tokens=4) | extra)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and {"message", "type", "param", "code"} <= set(r.json()["error"])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"], err
    ok = post(server_url, ha_body("Hi", None, None, max_tokens=2))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]  # still serving


def test_empty_tools_with_auto_is_text(server_url):
    r = post(server_url, ha_body("Hello!", tools=[], tool_choice="auto", max_tokens=8))
    assert r.status_code == 200, r.text
    assert answer(r.json()) == [] and "tool_choice" not in r.json()["decoding"]


def test_tools_with_json_object_give_a_call_or_an_object(server_url):
    r = post(server_url, ha_body(COMMANDS[1], tool_choice="auto", response_format={"type": "json_object"}))
    assert r.status_code == 200, r.text
    if not answer(r.json()):
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_auto_policy_with_tools_does_not_pick_outline(server_url):
    r = post(server_url, ha_body("Hello!", decoding="auto", max_tokens=8))
    assert r.status_code == 200, r.text
    answer(r.json())
    assert r.json()["decoding"]["auto"]["chose"] != "outline"


# 5. max_tokens inside a call


@pytest.mark.parametrize("max_tokens", [6, 2])  # 2: cut inside the open tag
def test_max_tokens_inside_a_call(client, server_url, max_tokens):
    body = ha_body(COMMANDS[1], tool_choice="required", max_tokens=max_tokens)
    r = create(client, body)
    choice = r["choices"][0]  # the same non-streamed and streamed
    assert choice["finish_reason"] == "length" and r["usage"]["completion_tokens"] == max_tokens
    assert not choice["message"].get("tool_calls") and choice["message"]["content"] in (None, "")
    got = join(sse(server_url, body))
    assert got["finish_reason"] == "length" and got["tool_calls"] == [] and got["content"] == ""


# 6. exactness with tools


@pytest.mark.parametrize("prompt", [COMMANDS[1], COMMANDS[3]])
def test_exact_policies_give_the_same_calls(client, required, prompt):
    want = answer(required[prompt])
    for decoding, name in [("naive", "naive"), ({"policy": "medusa"}, "medusa")]:
        r = create(client, ha_body(prompt, tool_choice="required", decoding=decoding))
        assert r["decoding"]["policy"] == name
        assert answer(r) == want, decoding


def test_same_request_twice(client, required):
    prompt = COMMANDS[2]
    again = create(client, ha_body(prompt, tool_choice="required", decoding="speculative"))
    assert same_answer(again) == same_answer(required[prompt])


def test_concurrent_requests_equal_each_alone(client, required):
    prompts = [COMMANDS[i] for i in (0, 4, 6, 7)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(
            lambda p: create(client, ha_body(p, tool_choice="required", decoding="speculative")), prompts))
    for prompt, r in zip(prompts, results, strict=True):
        assert same_answer(r) == same_answer(required[prompt]), prompt
