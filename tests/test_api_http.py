"""End-to-end: the real server over plain HTTP (SSE framing, auth, limits, metrics, disconnects, concurrency)."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from edgespec.server.settings import ServeSettings

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": "Bearer test-key"}
MESSAGES = [{"role": "user", "content": "Name three rivers."}]
MAX_REQUEST_BYTES = 4 * 2**20


@pytest.fixture(scope="module")
def http(server_url):
    with httpx.Client(base_url=server_url, headers=AUTH, timeout=120) as c:
        yield c


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 8, **kw}


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code
    return err


def sse_events(raw: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing on the way."""
    assert raw.endswith("\n\n"), repr(raw[-40:])
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block, f"empty event in {raw!r}"
        lines = [line for line in block.split("\n") if not line.startswith(":")]  # ':' lines are comments/pings
        if not lines:
            continue
        assert len(lines) == 1, block
        assert lines[0].startswith("data: "), block
        events.append(lines[0][len("data: "):])
    return events


def metric(http, name: str, labels: str = "") -> float:
    """The value of one sample in GET /metrics (0 when absent)."""
    text = http.get("/metrics").text
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_idle(http, timeout_s: float = 10.0) -> None:
    """Poll /metrics until no generation runs and no KV cache is held but what prefix reuse keeps (kept
    prefixes may share blocks, which the pool counts once and the prefix cache once per entry)."""
    deadline = time.monotonic() + timeout_s
    while True:
        in_flight = metric(http, "edgespec_requests_in_flight")
        kv = metric(http, "edgespec_kv_cache_bytes") - metric(http, "edgespec_prefix_cache_bytes")
        if in_flight == 0 and kv <= 0:
            return
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s: in_flight={in_flight}, kv_bytes={kv}"
        time.sleep(0.2)


def test_sse_framing_chat(http):
    r = http.post("/v1/chat/completions", json=chat_body(stream=True))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert len({c["created"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["decoding"]["policy"] == ServeSettings.model_fields["policy"].default
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage

    whole = http.post("/v1/chat/completions", json=chat_body()).json()
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        whole["choices"][0]["message"]["content"]


def test_sse_framing_completion_with_usage(http):
    body = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    *content, usage = chunks
    assert all(c["usage"] is None for c in content)
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5


def test_streamed_request_that_cannot_start_is_a_json_error(http):
    r = http.post("/v1/chat/completions", json=chat_body(model="nope", stream=True))
    err = assert_error(r, 404, "model_not_found")
    assert err["param"] == "model"
    r = http.post("/v1/chat/completions", json=chat_body(stream=True, temperature=9))
    assert assert_error(r, 400)["param"] == "temperature"


def test_malformed_json(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                  headers={"content-type": "application/json"})
    assert assert_error(r, 400, "invalid_json")["param"] is None
    r = http.post("/v1/completions", content=b"[1, 2, 3]", headers={"content-type": "application/json"})
    assert_error(r, 400)


def test_missing_or_wrong_authorization(server_url):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"},
                    {"Authorization": "Basic test-key"}):
        r = httpx.post(server_url + "/v1/chat/completions", json=chat_body(), headers=headers)
        assert_error(r, 401, "invalid_api_key")
        assert assert_error(httpx.get(server_url + "/v1/models", headers=headers), 401)
    # the scheme is case-insensitive, as HTTP says
    r = httpx.get(server_url + "/v1/models", headers={"Authorization": "bearer test-key"})
    assert r.status_code == 200


def test_health_without_key(server_url):
    r = httpx.get(server_url + "/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "model": MODEL}


def test_unknown_route_is_an_error_object(http):
    assert_error(http.get("/v1/nothing-here"), 404)


def test_metrics(http):
    default = f'policy="{ServeSettings.model_fields["policy"].default}"'
    before = metric(http, "edgespec_generated_tokens_total", default)
    ok_before = metric(http, "edgespec_requests_total", 'route="/v1/chat/completions",status="200"')
    r = http.post("/v1/chat/completions", json=chat_body(max_tokens=4))
    assert r.status_code == 200
    m = http.get("/metrics")
    assert m.status_code == 200
    assert m.headers["content-type"].startswith("text/plain")
    for name in ("edgespec_generated_tokens", "edgespec_requests_in_flight", "edgespec_prompt_tokens",
                 "edgespec_time_to_first_token_seconds", "edgespec_kv_cache_bytes", "edgespec_sequences_running",
                 "edgespec_sequences_waiting", "edgespec_queue_wait_seconds", "edgespec_queue_refused"):
        assert name in m.text
    assert metric(http, "edgespec_step_rows") >= metric(http, "edgespec_steps") >= 2  # the prompt's pass, then steps
    assert metric(http, "edgespec_program_seconds") > 0  # the programs' sampling after the passes
    used, free = (metric(http, "edgespec_kv_pool_blocks", f'state="{s}"') for s in ("used", "free"))
    assert free > 0 and (used > 0) == (metric(http, "edgespec_kv_cache_bytes") > 0)  # bytes are used blocks'
    assert metric(http, "edgespec_generated_tokens_total", default) == before + 4
    assert metric(http, "edgespec_requests_total", 'route="/v1/chat/completions",status="200"') == ok_before + 1
    # /metrics needs no key
    assert httpx.get(str(http.base_url) + "/metrics").status_code == 200


def test_body_too_large(http):
    payload = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 10)}]))
    r = http.post("/v1/chat/completions", content=payload, headers={"content-type": "application/json"})
    err = assert_error(r, 413, "body_too_large")
    assert str(MAX_REQUEST_BYTES) in err["message"]
    assert http.post("/v1/chat/completions", json=chat_body(max_tokens=1)).status_code == 200


def test_chunked_body_too_large(http):
    payload = json.dumps(chat_body(messages=[{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 10)}])).encode()

    def chunks():  # no Content-Length: the size is only known as the body arrives
        for i in range(0, len(payload), 2**16):
            yield payload[i : i + 2**16]

    r = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "body_too_large")
    assert http.post("/v1/chat/completions", json=chat_body(max_tokens=1)).status_code == 200


def test_request_metrics_are_labelled_by_route_template(http):
    for name in ("no-such-model-1", "no-such-model-2"):
        assert http.get(f"/v1/models/{name}").status_code == 404
    text = http.get("/metrics").text
    assert 'route="/v1/models/{name:path}",status="404"' in text
    assert "no-such-model" not in text


def test_unknown_policy_option_and_top_logprobs_without_logprobs(http):
    r = http.post("/v1/chat/completions", json=chat_body(decoding={"policy": "naive", "draft_len": 9}))
    err = assert_error(r, 400, "invalid_policy_option")
    assert err["param"] == "decoding" and "draft_len" in err["message"]
    err = assert_error(http.post("/v1/chat/completions", json=chat_body(top_logprobs=2)), 400)
    assert err["param"] == "top_logprobs"


def test_client_disconnect_mid_stream_stops_generation(http, server_url):
    wait_idle(http)
    body = chat_body(messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
                     max_tokens=2000, stream=True)
    with httpx.Client(headers=AUTH, timeout=60) as c, c.stream("POST", server_url + "/v1/chat/completions",
                                                                   json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                assert metric(http, "edgespec_requests_in_flight") == 1
                assert metric(http, "edgespec_kv_cache_bytes") > 0
            if seen >= 4:
                break  # dropping the line iterator closes the connection (httpcore), as does leaving the block
    # 2000 tokens would take well over a minute: the generation must stop and free its KV cache at once
    wait_idle(http, timeout_s=10)
    r = http.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 2


def test_client_disconnect_non_streamed_stops_generation(http, server_url):
    wait_idle(http)
    body = chat_body(messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
                     max_tokens=2000)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=1.5))
    wait_idle(http, timeout_s=10)
    assert http.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200


def test_concurrent_requests_match_single(http):
    budgets = (16, 24, 32)  # long enough that the three overlap

    def run(n: int) -> tuple[str, int]:  # (text, completion tokens); cached_tokens may differ: the first is cold
        r = http.post("/v1/chat/completions", json=chat_body(max_tokens=n))
        assert r.status_code == 200, r.text
        body = r.json()
        sharing.append(body["decoding"].get("shared_with_mean", 0))
        return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]

    sharing: list[float] = []

    def shared() -> float:
        text = http.get("/metrics").text
        return float(re.search(r"^edgespec_shared_passes (\S+)$", text, re.M).group(1))

    alone = [run(n) for n in budgets]
    assert sharing == [0, 0, 0]  # alone: no other request in its passes
    before = shared()
    with ThreadPoolExecutor(len(budgets)) as pool:
        together = list(pool.map(run, budgets))
    assert together == alone  # sharing passes changes no bit of any answer
    assert [n for _, n in together] == list(budgets)
    assert shared() > before, "concurrent requests never shared a forward pass"
    assert max(sharing[3:]) > 0  # the `decoding` object says so too
    wait_idle(http)
