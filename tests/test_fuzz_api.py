"""Fuzzing the controller's HTTP API in-process on the tiny model: schemathesis over its own OpenAPI schema, and
hypothesis bodies for the streamed (SSE) paths. Whatever the input, no answer is a 5xx, every error is an OpenAI
error object, and every stream is well framed to its end.

Examples are bounded (CI runs the whole suite in 30 minutes on 2 cores) and derandomized, so that a run is
repeatable; generations are FUZZ_MAX_TOKENS long. The boundary values found by fuzzing are kept as plain cases in
tests/test_input_errors.py.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from inprocess import FUZZ_MAX_TOKENS, LoopClient, assert_error_object, controller_app, short_answers

API_KEY = "fuzz-key"
MODEL = "tiny"
AUTH = {"authorization": f"Bearer {API_KEY}"}
FUZZ = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def app(tiny):
    app, service = controller_app(tiny, api_key=[API_KEY], served_model_name=MODEL)
    yield app
    service.engine.close()


@pytest.fixture(scope="module")
def api_schema(app):
    async def as_served(scope, receive, send):
        # Starlette re-raises a fault after its handler answered it (for the server to log); uvicorn logs it and
        # goes on, and so does this, so that the test sees the answer the client would
        try:
            await app(scope, receive, send)
        except Exception:
            if scope["type"] != "http":
                raise

    schema = schemathesis.openapi.from_asgi("/openapi.json", as_served)
    # the coverage phase (~1000 boundary cases) would add ~15 s on 2 cores: what it found is kept as plain cases in
    # tests/test_input_errors.py
    schema.config.phases.coverage.enabled = False
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@FUZZ
def test_no_server_errors_and_every_error_is_an_error_object(case):
    case.body = short_answers(case.path, case.body)
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = MODEL  # the served model: else every request ends at its 404
    response = case.call(headers=AUTH)
    where = f"{case.method} {case.formatted_path} {case.body!r}"[:2000]
    assert response.status_code < 500, (where, response.text[:500])
    if response.status_code >= 400:
        assert_error_object(response, where)


# Streamed requests: valid bodies (any text, NUL and SSE look-alikes included) and, as often, the same with one
# field replaced by something hostile: a lone surrogate, NaN, an out-of-range number, a wrong type

NASTY = ["", "a\u0000b\ud800", "\ud800", "\udfff", "\u2028\u2029", "x" * 3000]
SAFE = ["\x00", "\r\ndata: [DONE]\r\n\r\n", "event: error\n\nid: 1", "<|im_end|>", "<tool_call>[{", "\U0001f600"]
text = st.one_of(st.sampled_from(SAFE), st.text(max_size=30))
hostile = st.one_of(st.sampled_from(NASTY), st.none(), st.booleans(), st.integers(-3, 2**70), st.floats(),
                    st.sampled_from([1e-300, 5e-324, 2**63, -(2**63) - 1, 2**64, [], {}]))
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def fields(required: dict, optional: dict) -> st.SearchStrategy[dict]:
    """Valid bodies with any subset of the optional fields; half of them with one field made hostile."""
    valid = st.fixed_dictionaries(required, optional=optional)
    keys = sorted({*required, *optional})
    spoiled = st.tuples(valid, st.sampled_from(keys), hostile).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(valid, spoiled)


SAMPLING = {"temperature": st.floats(0, 2), "top_p": st.floats(0, 1, exclude_min=True), "top_k": st.integers(0, 50),
            "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**63 - 1),
            "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
            "stop": st.one_of(text, st.lists(text, max_size=4)),
            "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
            "decoding": st.one_of(st.sampled_from(["naive", "speculative", "auto", "outline"]),
                                  st.fixed_dictionaries({"policy": st.sampled_from(["naive", "speculative"])})),
            "max_tokens": st.integers(1, FUZZ_MAX_TOKENS)}
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                                 "content": st.one_of(text, st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": text}), min_size=1, max_size=2))})
chat_body = fields({"messages": st.lists(message, min_size=1, max_size=3)}, {
    **SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3), "tools": st.just([TOOL]),
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "response_format": st.just({"type": "json_object"})})
completion_body = fields({"prompt": st.one_of(text.filter(bool), st.lists(st.integers(0, 49151), min_size=1,
                                                                           max_size=5))},
                         {**SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, 3)})
responses_body = fields({"input": st.one_of(text, st.lists(message, min_size=1, max_size=2))}, {
    "instructions": text, "temperature": st.floats(0, 2), "top_p": st.floats(0, 1, exclude_min=True),
    "max_output_tokens": st.integers(1, FUZZ_MAX_TOKENS), "tools": st.just([{"type": "function", **TOOL["function"]}]),
    "text": st.just({"format": {"type": "json_object"}}), "decoding": st.sampled_from(["naive", "speculative"])})


@pytest.fixture(scope="module")
def http(app):
    client = LoopClient(app, headers=AUTH)
    yield client
    client.close()


def post_streamed(http, path: str, body: dict):
    """POST a streamed request (sent as JSON that may hold NaN and lone surrogates, as a hostile client can);
    returns the response, its 4xx checked as an error object."""
    body = short_answers(path, {"model": MODEL, **body, "stream": True})
    content = json.dumps(body, allow_nan=True)  # ensure_ascii: lone surrogates travel as \ud800 escapes
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    event(f"status {r.status_code}")  # the mix of answers: pytest --hypothesis-show-statistics
    assert r.status_code < 500, (body, r.text[:500])
    if r.status_code != 200:
        assert_error_object(r, repr(body)[:500])
    else:
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
    return r


def events(raw: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE event, checking the framing: every event ends with a blank line, and its
    data is one line (no data can break out of its event)."""
    assert raw.endswith("\n\n"), raw[-200:]
    out = []
    for block in raw.split("\n\n")[:-1]:
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]  # ':' lines are pings
        if not lines:
            continue
        fields = dict(line.split(": ", 1) for line in lines)
        assert set(fields) <= {"event", "data"} and len(fields) == len(lines), block
        out.append((fields.get("event"), fields["data"]))
    return out


def check_chunks(raw: str, kind: str) -> None:
    found = events(raw)
    assert found[-1] == (None, "[DONE]"), found[-3:]
    for _, data in found[:-1]:
        chunk = json.loads(data)
        if "error" in chunk:  # a failure after the stream started: an error object, then [DONE]
            assert set(chunk["error"]) == {"message", "type", "param", "code"}, chunk
        else:
            assert chunk["object"] == kind, chunk


@given(body=chat_body)
@FUZZ
def test_streamed_chat_is_an_error_object_or_a_framed_stream(http, body):
    r = post_streamed(http, "/v1/chat/completions", body)
    if r.status_code == 200:
        check_chunks(r.text, "chat.completion.chunk")


@given(body=completion_body)
@FUZZ
def test_streamed_completion_is_an_error_object_or_a_framed_stream(http, body):
    r = post_streamed(http, "/v1/completions", body)
    if r.status_code == 200:
        check_chunks(r.text, "text_completion")
        if body.get("echo") is True and isinstance(body["prompt"], str):
            first = json.loads(events(r.text)[0][1])
            assert first["choices"][0]["text"] == body["prompt"]  # the prompt comes first, as sent


@given(body=responses_body)
@FUZZ
def test_streamed_response_is_an_error_object_or_a_framed_stream(http, body):
    r = post_streamed(http, "/v1/responses", body)
    if r.status_code == 200:
        found = events(r.text)
        names = [name for name, _ in found]
        assert names[0] == "response.created" and names[-1] in (
            "response.completed", "response.incomplete", "response.failed"), names
        for name, data in found:
            assert json.loads(data)["type"] == name
