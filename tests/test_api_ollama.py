"""The Ollama API (server/ollama_routes.py) driven by the official `ollama` Python client: a test per route, on the
tiny model in-process behind uvicorn (a real HTTP server, as Ollama's clients need) and a tiny Qwen3 that thinks;
on the real default model (slow tier), a Home-Assistant-shaped turn and an answer against the OpenAI routes'.

The tiny model is random, so what it says is no test; where an answer must be checked the same request through
the OpenAI routes is the reference (same engine, same greedy tokens). Its server is started with a tool-call
threshold that makes every request with tools a call: a random model cannot choose, and the choice is
bench/tools.py's to measure. The file runs against the `ollama` client installed (the test lock's: 0.6.3), and
against the 0.4.7 that Home Assistant 2025.4.4 pins (PYTHONPATH to a copy of it and of httpx 0.28.1): the calls
used here exist in both, but thinking, which 0.4.7 predates.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest
import uvicorn
from inprocess import controller_app
from model_fixtures import make_tiny_model, smollm2_folder
from processes import free_port

from edgespec.server.service import CompletionService

MODEL = "tiny"
KEY = "ollama-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 512  # the tiny model's
HIDDEN = 64
GREEDY = {"temperature": 0, "num_predict": 6}
HI = [{"role": "user", "content": "Hello there"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {}}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CALL_TOKENS = 200  # a forced call of the tiny model: up to 48 random characters of city
OPENS = ("{%- if add_generation_prompt and not (enable_thinking is defined and enable_thinking is false) %}"
         "{{- '<think>\\n' }}{%- endif %}")


@contextmanager
def serving(model: str, name: str, **settings) -> Iterator[tuple[str, CompletionService]]:
    """(base URL, service) of `model` served in-process behind uvicorn on loopback, API key KEY."""
    app, service = controller_app(model, served_model_name=name, api_key=[KEY], **settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.config.port}", service
    finally:
        server.should_exit = True
        thread.join(30)
        service.engine.close()


@pytest.fixture(scope="module")
def served(tiny):
    with serving(tiny, MODEL, tool_call_threshold=-1e9) as url_and_service:
        yield url_and_service


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> Iterator[str]:
    """The URL of a tiny random Qwen3 with Qwen3's chat template and <think> tokens (as tests/test_reasoning.py
    builds it), whose template opens the thinking block unless enable_thinking is false: a random model then
    thinks for as long as it is let."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("ollama-thinker")
    tok = AutoTokenizer.from_pretrained(smollm2_folder())
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text() + OPENS
    make_tiny_model(folder, arch="qwen3", vocab_size=len(tok), max_position_embeddings=CONTEXT, bos_token_id=1,
                    eos_token_id=2)
    tok.save_pretrained(folder)
    with serving(str(folder), "thinker") as (url, _):
        yield url


@pytest.fixture
def url(served) -> str:
    return served[0]


@pytest.fixture
def client(url) -> ollama.Client:
    return ollama.Client(host=url, headers=AUTH, timeout=120)


def post(url: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body)
    headers = kw.pop("headers", {**AUTH, "content-type": "application/json"})
    return httpx.post(url + path, content=content, headers=headers, timeout=120, **kw)


def openai_chat(url: str, messages: list[dict], tokens: int, **kw) -> dict:
    """The reference: the same chat through /v1/chat/completions, greedy."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": tokens, **kw}
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def error(r: httpx.Response, status: int) -> str:
    """Ollama's error JSON, {"error": message}, with `status`; returns the message."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    return body["error"]


def done_object(r, prompt_tokens: int | None = None) -> None:
    """The statistics of a last object as Ollama gives them: counts, and durations in nanoseconds that add up."""
    assert r.done is True and r.done_reason in ("stop", "length")
    assert r.model and datetime.fromisoformat(r.created_at.replace("Z", "+00:00")).tzinfo is not None
    assert r.prompt_eval_count > 0 and r.eval_count > 0
    if prompt_tokens is not None:
        assert r.prompt_eval_count == prompt_tokens
    for name in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(r[name], int) and r[name] >= 0, name
    assert r.load_duration + r.prompt_eval_duration + r.eval_duration <= r.total_duration


# general and the model routes


def test_root_and_version_answer_without_a_key(url):
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert httpx.head(url + "/").status_code == 200
    version = httpx.get(url + "/api/version").json()["version"]
    assert all(part.isdigit() for part in version.split("."))


def test_list(client, served):
    models = client.list().models
    assert [m.model for m in models] == [f"{MODEL}:latest"]
    m = models[0]
    assert m.size > 0 and len(m.digest) == 64 and m.modified_at.year > 2000
    assert m.details.family == "llama" and m.details.format == "safetensors" and m.details.parameter_size.endswith("M")


@pytest.mark.parametrize("name", [MODEL, f"{MODEL}:latest", "TINY:Latest"])
def test_show_takes_every_name_of_the_model(client, name):
    r = client.show(name)
    assert r.modelinfo["llama.context_length"] == CONTEXT and r.modelinfo["llama.embedding_length"] == HIDDEN
    assert r.details.family == "llama" and "{%" in r.template  # the model's own chat template
    assert {"completion", "tools"} <= set(r.get("capabilities") or ["completion", "tools"])  # 0.4.7 has none


def test_ps(client):
    (m,) = client.ps().models
    assert m.model == f"{MODEL}:latest" and m.size > 0 and m.size_vram == 0
    assert m.expires_at > datetime.now(UTC)  # kept loaded
    assert m.get("context_length", CONTEXT) == CONTEXT


# chat


def test_chat_not_streamed_is_the_openai_routes_answer(client, url):
    r = client.chat(model=MODEL, messages=HI, options=GREEDY, stream=False)
    reference = openai_chat(url, HI, GREEDY["num_predict"])
    assert r.message.role == "assistant" and r.message.content == reference["choices"][0]["message"]["content"]
    done_object(r, reference["usage"]["prompt_tokens"])
    assert r.model == MODEL and r.eval_count == GREEDY["num_predict"] and r.done_reason == "length"


def test_chat_streamed(client, url):
    chunks = list(client.chat(model=f"{MODEL}:latest", messages=HI, options=GREEDY, stream=True))
    *deltas, last = chunks
    assert deltas and all(not c.done and c.message.role == "assistant" for c in deltas)
    assert last.message.content == "" and last.model == f"{MODEL}:latest"
    done_object(last)
    whole = client.chat(model=MODEL, messages=HI, options=GREEDY, stream=False)
    assert "".join(c.message.content for c in deltas) == whole.message.content
    with httpx.stream("POST", url + "/api/chat", json={"model": MODEL, "messages": HI, "options": GREEDY},
                      headers=AUTH) as raw:  # streamed unless stream: false, one JSON object a line
        assert raw.headers["content-type"] == "application/x-ndjson"
        assert [json.loads(line)["done"] for line in raw.iter_lines()][-1] is True


def test_chat_with_the_async_client_home_assistant_uses(url):
    async def turn():
        client = ollama.AsyncClient(host=url, headers=AUTH)
        stream = await client.chat(model=MODEL, messages=HI, stream=True, keep_alive="300s",
                                   options={"num_ctx": 8192, **GREEDY})
        return [c async for c in stream]

    chunks = asyncio.run(turn())
    assert chunks[-1].done and chunks[-1].eval_count == GREEDY["num_predict"]


def test_empty_messages_load_the_model(client):
    r = client.chat(model=MODEL, messages=[], stream=False)
    assert r.done and r.done_reason == "load" and r.message.content == ""
    assert client.generate(model=MODEL, prompt="").done_reason == "load"


def test_thinking_of_a_model_that_thinks(thinker):
    if "thinking" not in ollama.Message.model_fields:
        pytest.skip("this ollama client predates thinking (0.4.x)")
    client = ollama.Client(host=thinker, headers=AUTH, timeout=120)
    r = client.chat(model="thinker", messages=HI, options=GREEDY, stream=False)
    # the block the template opened is not closed by a random model in 6 tokens: all of them are thinking
    assert r.message.thinking and r.message.content == "" and "</think>" not in r.message.thinking
    streamed = list(client.chat(model="thinker", messages=HI, options=GREEDY, stream=True))
    assert "".join(c.message.thinking or "" for c in streamed) == r.message.thinking
    assert client.chat(model="thinker", messages=HI, options=GREEDY, think="high", stream=False).message.thinking
    off = client.chat(model="thinker", messages=HI, options=GREEDY, think=False, stream=False)
    assert not off.message.thinking and off.message.content  # enable_thinking false: the template closed it
    assert client.show("thinker").capabilities == ["completion", "tools", "thinking"]
    generated = client.generate(model="thinker", prompt="Hello", options=GREEDY)
    assert generated.thinking and generated.response == ""


# tools and format


def test_tool_call_then_its_result_answered(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    options = {"temperature": 0, "num_predict": CALL_TOKENS}
    r = client.chat(model=MODEL, messages=messages, tools=[WEATHER, TIME], options=options, stream=False)
    (call,) = r.message.tool_calls[:1]
    assert call.function.name in ("get_weather", "get_time") and isinstance(call.function.arguments, dict)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    jsonschema.validate(dict(call.function.arguments), params[call.function.name])
    assert r.done_reason == "stop" and r.message.content == ""
    streamed = list(client.chat(model=MODEL, messages=messages, tools=[WEATHER], options=options, stream=True))
    calls = [c for chunk in streamed for c in chunk.message.tool_calls or ()]
    assert calls and {c.function.name for c in calls} == {"get_weather"} and streamed[-1].done
    # the call and its result go back (arguments as an object, the result as a tool turn naming the tool)
    history = [*messages, {"role": "assistant", "content": "", "tool_calls": [call.model_dump(exclude_none=True)]},
               {"role": "tool", "content": json.dumps({"temperature": 21}), "tool_name": call.function.name}]
    answer = client.chat(model=MODEL, messages=history, options=GREEDY, stream=False)
    assert answer.message.content and not answer.message.tool_calls and answer.done_reason == "length"
    again = client.chat(model=MODEL, messages=history, tools=[WEATHER], options=options, stream=False)
    assert again.done  # with the tools still offered (as Home Assistant sends them): answered too


@pytest.mark.parametrize("route", ["chat", "generate"])
def test_format_schema_and_json(client, route):
    def ask(fmt) -> tuple[str, str]:
        options = {"temperature": 0, "num_predict": 120}
        if route == "chat":
            r = client.chat(model=MODEL, messages=[{"role": "user", "content": "A person, as JSON"}], format=fmt,
                            options=options, stream=False)
            return r.message.content, r.done_reason
        r = client.generate(model=MODEL, prompt="A person, as JSON", format=fmt, options=options)
        return r.response, r.done_reason

    text, reason = ask(PERSON)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    # any object: the random model's greedy key may run on until num_predict cuts it, so only its start is sure
    text, reason = ask("json")
    assert text.startswith("{") and (reason == "length" or isinstance(json.loads(text), dict))


# generate


def test_generate(client, url):
    r = client.generate(model=MODEL, prompt="The sea is", options=GREEDY)
    reference = openai_chat(url, [{"role": "user", "content": "The sea is"}], GREEDY["num_predict"])
    assert r.response == reference["choices"][0]["message"]["content"]
    done_object(r, reference["usage"]["prompt_tokens"])
    assert all(isinstance(t, int) for t in r.context) and len(r.context) > r.prompt_eval_count
    streamed = list(client.generate(model=MODEL, prompt="The sea is", options=GREEDY, stream=True))
    assert "".join(c.response for c in streamed) == r.response and streamed[-1].context == r.context
    follow = client.generate(model=MODEL, prompt="And then?", context=r.context, options=GREEDY)
    assert follow.prompt_eval_count > len(r.context)  # the earlier exchange comes first
    raw = client.generate(model=MODEL, prompt="The sea is", raw=True, options=GREEDY)
    assert raw.response and raw.context is None and raw.prompt_eval_count < r.prompt_eval_count


# embeddings


def test_embed_and_the_older_embeddings(client, url):
    r = client.embed(model=MODEL, input=["The sea", "A ship"])
    assert len(r.embeddings) == 2 and all(len(v) == HIDDEN for v in r.embeddings)
    reference = post(url, "/v1/embeddings", {"model": MODEL, "input": ["The sea", "A ship"]}).json()
    for got, want in zip(r.embeddings, reference["data"], strict=True):
        assert got == pytest.approx(want["embedding"], abs=1e-6)
    assert r.prompt_eval_count == reference["usage"]["prompt_tokens"]
    assert client.embeddings(model=MODEL, prompt="The sea").embedding == pytest.approx(r.embeddings[0], abs=1e-6)
    assert client.embed(model=MODEL, input="").embeddings == []
    cut = post(url, "/api/embed", {"model": MODEL, "input": "The sea", "dimensions": 16}).json()["embeddings"][0]
    assert len(cut) == 16 and math.isclose(sum(x * x for x in cut), 1.0, rel_tol=1e-5)
    long = "word " * 600  # over the context: cut to it by default, refused with truncate: false
    assert len(post(url, "/api/embed", {"model": MODEL, "input": long}).json()["embeddings"]) == 1
    assert "exceeds" in error(post(url, "/api/embed", {"model": MODEL, "input": long, "truncate": False}), 400)


# pull and what is refused


def test_pull_answers_the_served_model_and_names_it_for_any_other(client):
    assert client.pull(MODEL).status == "success"
    assert [p.status for p in client.pull(f"{MODEL}:latest", stream=True)][-1] == "success"
    with pytest.raises(ollama.ResponseError) as caught:
        client.pull("llama3.2:latest")
    assert caught.value.status_code == 404 and f"{MODEL}:latest" in caught.value.error


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/api/create", {"model": "mario", "from": MODEL}), ("POST", "/api/copy", {"source": MODEL,
                                                                                        "destination": "b"}),
    ("DELETE", "/api/delete", {"model": MODEL}), ("POST", "/api/push", {"model": MODEL}),
    ("POST", "/api/blobs/sha256:00", {})])
def test_model_management_is_refused(url, client, method, path, body):
    r = httpx.request(method, url + path, json=body, headers=AUTH)
    assert "does not" in error(r, 403)
    with pytest.raises(ollama.ResponseError) as caught:
        client.delete(MODEL) if path == "/api/delete" else client.copy(MODEL, "b")
    assert caught.value.status_code == 403


# bad input: Ollama's error JSON with a 4xx, and nothing else disturbed

BAD = {
    "unknown model": ({"model": "llama3.2", "messages": HI}, 404, "not found"),
    "no model": ({"messages": HI}, 400, "model is required"),
    "messages not a list": ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    "content not a string": ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "content"),
    "bad role": ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    "images": ({"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400, "images"),
    "think on a model that does not": ({"model": MODEL, "messages": HI, "think": True}, 400, "does not support"),
    "think level": ({"model": MODEL, "messages": HI, "think": "extreme"}, 400, "think"),
    "option of the wrong type": ({"model": MODEL, "messages": HI, "options": {"temperature": "hot"}}, 400,
                                 "temperature"),
    "option out of range": ({"model": MODEL, "messages": HI, "options": {"presence_penalty": 5}}, 400,
                            "presence_penalty"),
    "stop not a list": ({"model": MODEL, "messages": HI, "options": {"stop": "\n"}}, 400, "stop"),
    "typical_p": ({"model": MODEL, "messages": HI, "options": {"typical_p": 0.5}}, 400, "typical_p"),
    "bad format": ({"model": MODEL, "messages": HI, "format": "yaml"}, 400, "format"),
    "tool arguments as a string": ({"model": MODEL, "messages": [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        *HI]}, 400, "arguments"),
    "logprobs": ({"model": MODEL, "messages": HI, "logprobs": True}, 400, "logprobs"),
    "prompt over num_ctx": ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 100}],
                             "options": {"num_ctx": 32}}, 400, "context window"),
}
BAD_GENERATE = {
    "template": ({"model": MODEL, "prompt": "hi", "template": "{{ .Prompt }}"}, 400, "template"),
    "suffix": ({"model": MODEL, "prompt": "def f(", "suffix": "return 1"}, 400, "suffix"),
    "raw with system": ({"model": MODEL, "prompt": "hi", "raw": True, "system": "be brief"}, 400, "raw"),
    "images": ({"model": MODEL, "prompt": "hi", "images": ["aGk="]}, 400, "images"),
    "context out of the vocabulary": ({"model": MODEL, "prompt": "hi", "context": [10**9]}, 400, "context"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_chat_input_is_an_ollama_error(url, client, case):
    body, status, words = BAD[case]
    assert words in error(post(url, "/api/chat", body), status)
    assert client.chat(model=MODEL, messages=HI, options=GREEDY, stream=False).done  # nothing disturbed


@pytest.mark.parametrize("case", BAD_GENERATE)
def test_bad_generate_input_is_an_ollama_error(url, client, case):
    body, status, words = BAD_GENERATE[case]
    assert words in error(post(url, "/api/generate", body), status)
    assert client.generate(model=MODEL, prompt="hi", options=GREEDY).done


def test_bodies_keys_and_unknown_paths(url):
    assert "missing request body" in error(post(url, "/api/chat", b""), 400)
    assert "JSON" in error(post(url, "/api/chat", b"{nope"), 400)
    form = httpx.post(url + "/api/chat", content=json.dumps({"model": MODEL, "messages": HI, "stream": False,
                                                             "options": GREEDY}),
                      headers={**AUTH, "content-type": "application/x-www-form-urlencoded"})  # as `curl -d` sends
    assert form.status_code == 200 and form.json()["done"]
    upper = post(url, "/api/chat", {"model": MODEL, "messages": [{"role": "USER", "content": "hi"}], "stream": False,
                                    "options": GREEDY})
    assert upper.status_code == 200  # roles in any case, as Ollama lowercases them
    assert "API key" in error(httpx.get(url + "/api/tags"), 401)
    assert "API key" in error(httpx.get(url + "/api/tags", headers={"Authorization": "Bearer wrong"}), 401)
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}  # over the 4 MiB bound
    assert "exceeds" in error(post(url, "/api/chat", huge), 413)
    error(httpx.get(url + "/api/nothing", headers=AUTH), 404)
    error(httpx.get(url + "/api/chat", headers=AUTH), 405)
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=url).list()
    assert caught.value.status_code == 401


def test_num_ctx_drops_the_oldest_messages_as_ollama(client, url):
    turns = [{"role": "system", "content": "You are brief."}]
    for i in range(8):
        turns += [{"role": "user", "content": f"Question {i}: " + "tell me more " * 4},
                  {"role": "assistant", "content": "More words " * 4}]
    turns.append({"role": "user", "content": "Last question?"})
    full = client.chat(model=MODEL, messages=turns, options=GREEDY, stream=False)
    fitted = client.chat(model=MODEL, messages=turns, options={**GREEDY, "num_ctx": 160}, stream=False)
    assert fitted.prompt_eval_count < 160 < full.prompt_eval_count
    assert fitted.eval_count + fitted.prompt_eval_count <= 160
    kept_tail = openai_chat(url, [turns[0], *turns[-3:]], 1)["usage"]["prompt_tokens"]
    assert fitted.prompt_eval_count >= kept_tail  # the system message and the latest turns are kept
    body = {"model": MODEL, "messages": turns, "options": {"num_ctx": 160}, "truncate": False}
    assert "context window" in error(post(url, "/api/chat", body), 400)


def test_a_fault_mid_stream_is_a_last_error_line():
    """Once the status line is out, an error (a worker lost, say) is Ollama's last line {"error": ...}, which its
    clients raise."""
    from edgespec.server.chat_input import ChatDelta
    from edgespec.server.errors import APIError
    from edgespec.server.ollama_render import OllamaRenderer, Timings, ndjson

    async def deltas():
        yield ChatDelta(content="Hi", tokens=1)
        raise APIError(503, "a worker failed during generation")

    async def lines():
        return [json.loads(line) async for line in ndjson(deltas(), OllamaRenderer("chat", MODEL, 3, Timings()))]

    first, last = asyncio.run(lines())
    assert first["message"] == {"role": "assistant", "content": "Hi"} and not first["done"]
    assert last == {"error": "a worker failed during generation"}


def test_requests_are_counted_in_the_metrics(client, url):
    client.list()
    metrics = httpx.get(url + "/metrics").text
    assert 'edgespec_requests_total{route="/api/tags",status="200"}' in metrics


# the real default model, as Home Assistant's Ollama integration asks it (slow tier: the session's real server)


@pytest.mark.slow
def test_home_assistant_turn_on_the_real_model(server_url):
    ha = json.loads((Path(__file__).resolve().parents[1] / "bench/prompts/home_assistant.json").read_text())
    client = ollama.Client(host=server_url, headers={"Authorization": "Bearer test-key"}, timeout=300)
    (listed,) = [m.model for m in client.list().models]
    messages = [{"role": "system", "content": ha["system"]}, {"role": "user", "content": "Turn on the kitchen light"}]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in ha["tools"]}
    chunks = list(client.chat(model=listed, messages=messages, tools=ha["tools"], stream=True, keep_alive="300s",
                              options={"num_ctx": 8192, "temperature": 0, "num_predict": 96}))
    calls = [c for chunk in chunks for c in chunk.message.tool_calls or ()]
    assert calls and chunks[-1].done
    for call in calls:
        jsonschema.validate(dict(call.function.arguments), params[call.function.name])
    messages += [{"role": "assistant", "content": "", "tool_calls": [c.model_dump(exclude_none=True) for c in calls]},
                 *({"role": "tool", "content": json.dumps({"success": True})} for _ in calls)]
    final = client.chat(model=listed, messages=messages, tools=ha["tools"], stream=False,
                        options={"num_ctx": 8192, "temperature": 0, "num_predict": 96})
    assert final.done and (final.message.content or final.message.tool_calls)


@pytest.mark.slow
def test_the_real_models_answer_is_the_openai_routes(server_url):
    """The OpenAI SDK on the same real server is the reference."""
    import openai

    client = ollama.Client(host=server_url, headers={"Authorization": "Bearer test-key"}, timeout=300)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat(model="SmolLM2-135M-Instruct", messages=messages, stream=False,
                    options={"temperature": 0, "num_predict": 24})
    sdk = openai.OpenAI(base_url=server_url + "/v1", api_key="test-key", max_retries=0, timeout=300)
    reference = sdk.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
                                               max_tokens=24)
    assert r.message.content == reference.choices[0].message.content
    assert r.eval_count == reference.usage.completion_tokens


def test_server_options_fill_what_a_request_leaves_unset(tiny):
    """`serve --ollama-options` (a Modelfile's PARAMETER lines, for clients that set none, as Home Assistant's
    integration): a chat without options answers as one that gives them, and a request's own options win."""
    with serving(tiny, MODEL, ollama_options={"temperature": 0, "num_predict": 5}) as (url, _):
        client = ollama.Client(host=url, headers=AUTH, timeout=120)
        bare = client.chat(model=MODEL, messages=HI, stream=False, options={"num_ctx": 512})
        given = client.chat(model=MODEL, messages=HI, stream=False, options={"temperature": 0, "num_predict": 5})
        assert bare.eval_count == 5 and bare.message.content == given.message.content
        assert client.chat(model=MODEL, messages=HI, stream=False, options={"num_predict": 2}).eval_count == 2
