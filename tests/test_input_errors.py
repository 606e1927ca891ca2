"""Bad input answered as OpenAI error objects naming the parameter, in-process on the tiny model: the cases fuzzing
found (each was a plain-text 500 before), the fields that change the answer (echo supported; suffix, best_of and
others refused by name), the bounds on what a request may list, and a fault's 500 with its log line."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from inprocess import LoopClient, assert_error_object, controller_app
from pydantic_core import PydanticCustomError

from edgespec.server import protocol

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tiny):
    app, service = controller_app(tiny, served_model_name=MODEL)
    client = LoopClient(app)
    yield client, service
    client.close()
    service.engine.close()


@pytest.fixture
def http(served):
    return served[0]


def post(http, path: str, body: dict):
    # as a client may send it: NaN and lone surrogates included
    return http.post(path, content=json.dumps({"model": MODEL, **body}), headers={"content-type": "application/json"})


def chat(http, **body):
    return post(http, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, **body})


def completion(http, **body):
    return post(http, "/v1/completions", {"prompt": "The sea", "max_tokens": 2, **body})


def refused(r, param: str, code: str | None = None) -> dict:
    assert r.status_code == 400, r.text
    err = assert_error_object(r)
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_the_reported_500s_are_400s_naming_the_parameter(http):
    err = refused(chat(http, messages=[{"role": "user", "content": "a\u0000b\ud800"}]), "messages.0.content")
    assert "surrogate" in err["message"]
    refused(chat(http, seed=2**80), "seed")
    refused(completion(http, seed=-(2**63) - 1), "seed")
    # the same with the NUL alone, and the seed's whole int64 range, are served
    assert chat(http, messages=[{"role": "user", "content": "a\u0000b"}]).status_code == 200
    for seed in (2**63 - 1, -(2**63)):
        assert chat(http, seed=seed, temperature=1).status_code == 200


def test_lone_surrogates_anywhere_are_refused_where_they_are(http):
    refused(chat(http, stop=["ok", "\udfff"]), "stop.1")
    refused(post(http, "/v1/embeddings", {"input": ["fine", "x\ud800"]}), "input.1")
    refused(post(http, "/v1/responses", {"input": "hi", "instructions": "\ud800"}), "instructions")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "\ud800": {"type": "string"}}}}}
    err = refused(chat(http, tools=[tool]), "tools.0.function.parameters.properties")
    assert "key" in err["message"]


def test_sampling_values_at_the_edges_are_served(http):
    # each was a 500: logits / 1e-300 overflow to inf; a top_p of 5e-324 is 0 in float32 and kept no token
    for body in ({"temperature": 1e-300}, {"top_p": 5e-324}, {"top_p": 5e-324, "temperature": 2, "seed": 1},
                 {"min_p": 1, "temperature": 2}, {"top_k": 10**9, "temperature": 1}):
        r = chat(http, **body)
        assert r.status_code == 200, (body, r.text)
    refused(chat(http, temperature=float("nan")), "temperature")
    refused(chat(http, logit_bias={"5": float("inf")}), "logit_bias")


def test_empty_prompts_and_odd_policy_options(http):
    refused(completion(http, prompt=[""]), "prompt")  # a model without BOS has nothing to continue from
    refused(chat(http, decoding={"policy": "auto", "question": 5}), "decoding", "invalid_policy_option")


def test_echo_returns_the_prompt_before_the_completion(served):
    http, service = served
    plain = completion(http, temperature=0).json()["choices"][0]["text"]
    echoed = completion(http, temperature=0, echo=True).json()["choices"][0]["text"]
    assert echoed == "The sea" + plain
    ids = completion(http, prompt=[504, 3287], temperature=0, echo=True).json()["choices"][0]["text"]
    assert ids.startswith(service.tokenizer.decode([504, 3287]))
    stream = completion(http, temperature=0, echo=True, stream=True).text
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"] == "The sea"
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed
    err = refused(completion(http, echo=True, logprobs=1), "echo", "unsupported_parameter")
    assert "logprobs" in err["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"messages": HI, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": HI, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"messages": HI, "web_search_options": {}}, "web_search_options"),
    ("/v1/responses", {"input": "x", "background": True}, "background"),
    ("/v1/responses", {"input": "x", "conversation": "conv_1"}, "conversation"),
    ("/v1/responses", {"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ("/v1/responses", {"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ("/v1/responses", {"input": "x", "max_tool_calls": 1}, "max_tool_calls"),
    ("/v1/responses", {"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
])
def test_fields_that_would_change_the_answer_are_refused_by_name(http, path, body, param):
    refused(post(http, path, body), param, "unsupported_parameter")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "x", "suffix": None, "best_of": 1, "echo": False, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": HI, "modalities": ["text"], "audio": None, "max_tokens": 1}),
    ("/v1/responses", {"input": "x", "background": False, "include": ["reasoning.encrypted_content"],
                       "max_output_tokens": 1}),
])
def test_their_neutral_values_are_served(http, path, body):
    r = post(http, path, body)
    assert r.status_code == 200, r.text


def test_what_a_request_may_list_is_bounded(http):
    refused(chat(http, messages=HI * (protocol.MAX_MESSAGES + 1)), "messages")
    refused(chat(http, stop="x" * (protocol.MAX_STOP_CHARS + 1)), "stop")
    refused(chat(http, logit_bias={str(i): 1 for i in range(protocol.MAX_LOGIT_BIAS + 1)}), "logit_bias")
    tool = {"type": "function", "function": {"name": "f"}}
    refused(chat(http, tools=[tool] * (protocol.MAX_TOOLS + 1)), "tools")
    refused(post(http, "/v1/embeddings", {"input": ["a"] * (protocol.MAX_EMBEDDING_INPUTS + 1)}), "input")
    refused(post(http, "/v1/responses", {"input": [{"role": "user", "content": "a"}] * (protocol.MAX_MESSAGES + 1)}),
            "input")
    deep = {"type": "string"}
    for _ in range(protocol.MAX_DEPTH):
        deep = {"type": "array", "items": deep}
    err = refused(chat(http, response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}),
                  "response_format")
    assert "nested" in err["message"]


def test_bodies_that_are_not_requests(http):
    for content in (b"[1, 2]", b'"text"', b"null", b"{", b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe"):
        r = http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, (content[:20], r.text)
        assert_error_object(r)
    for r in (http.get("/v1/chat/completions"), http.get("/v1/nope"), http.request("PUT", "/v1/models")):
        assert 400 <= r.status_code < 500
        assert_error_object(r)


def test_a_fault_is_a_logged_500_error_object(served, monkeypatch, caplog):
    http, service = served

    def broken(*_):
        raise RuntimeError("a bug")

    monkeypatch.setattr(service, "completion_prompt", broken)
    with caplog.at_level(logging.ERROR, logger="edgespec.server.errors"):
        r = completion(http)
    assert r.status_code == 500
    err = assert_error_object(r)
    assert err["code"] == "internal_error" and "a bug" not in err["message"]  # the details stay in the log
    logged = [rec for rec in caplog.records if rec.name == "edgespec.server.errors"]
    assert logged and logged[0].exc_info[1].args == ("a bug",) and "/v1/completions" in logged[0].getMessage()


def test_a_fault_mid_stream_is_an_error_event_then_done(served, monkeypatch, caplog):
    http, service = served
    deltas = service.deltas

    async def failing(gen, extractor):
        async for delta in deltas(gen, extractor):
            yield delta
            raise RuntimeError("mid-stream bug")

    monkeypatch.setattr(service, "deltas", failing)
    with caplog.at_level(logging.ERROR, logger="edgespec.server.streaming"):
        lines = [line for line in chat(http, stream=True).text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert any(rec.exc_info and rec.exc_info[1].args == ("mid-stream bug",) for rec in caplog.records)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                           max_leaves=20)


def at(value, path: list):
    for part in path:
        value = value[part]
    return value


def paths(value, prefix=()) -> list[tuple]:
    """Every place in a JSON value where a string could stand (the value itself, each item, each member)."""
    out = [prefix]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        out += paths(item, (*prefix, key))
    return out


@given(body=st.dictionaries(st.text(min_size=1), json_values, min_size=1, max_size=4), data=st.data())
@settings(max_examples=50, deadline=None, derandomize=True)
def test_check_body_finds_the_one_lone_surrogate_and_names_its_place(body, data):
    protocol.check_body(body)  # hypothesis' text has no lone surrogates: all of it is valid
    where = data.draw(st.sampled_from([p for p in paths(body) if p]))
    parent = at(body, list(where[:-1]))
    parent[where[-1]] = "ok\ud800"
    with pytest.raises(PydanticCustomError) as found:
        protocol.check_body(body)
    assert found.value.context["param"] == ".".join(map(str, where))
