"""End-to-end: the real server driven by the official `openai` client (chat, completions, errors)."""

from __future__ import annotations

import httpx
import openai
import pytest

from edgespec.server.settings import ServeSettings

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 8192
RIVERS = [{"role": "user", "content": "Name three rivers."}]
FRANCE = "The capital of France is"
DEFAULT_POLICY = ServeSettings.model_fields["policy"].default  # what a request without `decoding` gets


def chat(client, messages=RIVERS, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 16)
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def assert_error(exc: openai.APIStatusError, status: int, param: str | None = None, code: str | None = None):
    """The status code and the OpenAI error object {"error": {message, type, param, code}}."""
    assert exc.status_code == status
    body = exc.response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    # the SDK parses the same object
    assert exc.message and exc.param == err["param"] and exc.code == err["code"]
    return err


@pytest.fixture(scope="module")
def greedy_chat(client):
    """The greedy 16-token answer to RIVERS, computed once."""
    return chat(client)


# models


def test_list_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = models[0]
    assert card.object == "model"
    assert card.model_extra["context_length"] == CONTEXT
    assert "naive" in card.model_extra["policies"]
    assert client.models.retrieve(MODEL).id == MODEL


# chat


def test_chat_non_streamed(greedy_chat):
    r = greedy_chat
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0
    assert 0 < u.completion_tokens <= 16
    assert u.completion_tokens == u.total_tokens - u.prompt_tokens
    decoding = r.model_extra["decoding"]
    assert decoding["policy"] == DEFAULT_POLICY
    for key in ("steps", "acceptance_rate", "ttft_ms", "decode_tokens_per_s", "wire_bytes_per_token",
                "wire_requests_per_token"):
        assert key in decoding


def test_chat_streamed_matches_non_streamed(client, greedy_chat):
    chunks = list(chat(client, stream=True))
    assert chunks, "no chunks"
    assert {c.id for c in chunks} == {chunks[0].id}
    assert chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert all(len(c.choices) == 1 for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == greedy_chat.choices[0].finish_reason
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == greedy_chat.choices[0].message.content
    assert chunks[-1].model_extra["decoding"]["policy"] == DEFAULT_POLICY


def test_chat_streamed_include_usage(client, greedy_chat):
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    *content, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) == \
        greedy_chat.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
    assert all(c.usage is None for c in content)
    assert content[-1].choices[0].finish_reason is not None
    assert "".join(c.choices[0].delta.content or "" for c in content) == greedy_chat.choices[0].message.content
    assert last.model_extra["decoding"]["policy"] == DEFAULT_POLICY


def test_chat_max_tokens_length(client):
    r = chat(client, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_chat_max_completion_tokens(client):
    r = chat(client, max_tokens=None, max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    # max_completion_tokens wins over the deprecated max_tokens
    r = chat(client, max_tokens=10, max_completion_tokens=4)
    assert r.usage.completion_tokens == 4


def test_chat_stop_string(client, greedy_chat):
    text = greedy_chat.choices[0].message.content
    words = [w for w in text.split() if len(w) >= 3 and w.isalpha()]
    assert len(words) >= 3, text
    stop = words[len(words) // 2]
    at = text.find(stop)
    assert at > 0
    r = chat(client, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:at]
    assert r.usage.completion_tokens < greedy_chat.usage.completion_tokens
    # streamed, the text held back while it might start the stop string is never shown past the stop
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, stop=stop, stream=True))
    assert streamed == text[:at]


def test_chat_seed_reproducible(client):
    def sample(seed, prompt="Tell me a story."):
        r = chat(client, messages=[{"role": "user", "content": prompt}], temperature=1.0, max_tokens=20, seed=seed)
        return r.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
    # the first request of each prompt finds no prefix cached, the second finds it: the same answer (the default
    # policy's feature drafter sees the same features either way)
    for seed, prompt in enumerate(["Write a poem about the sea.", "Describe a walk in the forest.",
                                   "Explain why the sky is blue."]):
        assert sample(seed, prompt) == sample(seed, prompt)


def test_chat_logprobs(client, greedy_chat):
    r = chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 8
    for e in entries:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 3
        assert all(t.logprob <= 0 for t in e.top_logprobs)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        # greedy: the chosen token is the most likely one
        assert e.token == e.top_logprobs[0].token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert e.bytes == list(e.token.encode())
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    assert greedy_chat.choices[0].message.content.startswith(r.choices[0].message.content)


def test_chat_logprobs_streamed(client):
    chunks = list(chat(client, max_tokens=6, logprobs=True, top_logprobs=1, stream=True))
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 6
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 1 for e in entries)


@pytest.mark.parametrize("decoding", ["naive", {"policy": "naive"}])
def test_decoding_field(client, greedy_chat, decoding):
    r = chat(client, extra_body={"decoding": decoding})
    stats = r.model_extra["decoding"]
    assert stats["policy"] == "naive" and stats["tokens_per_step"] in (None, 1.0)
    assert stats["steps"] == r.usage.completion_tokens - 1  # one step per token after the first
    assert r.choices[0].message.content == greedy_chat.choices[0].message.content  # the default is exact


# text completions


def test_completion_non_streamed_and_streamed(client):
    r = client.completions.create(model=MODEL, prompt=FRANCE, temperature=0, max_tokens=8)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    choice = r.choices[0]
    assert choice.text.strip()
    assert "Paris" in choice.text
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.model_extra["decoding"]["policy"] == DEFAULT_POLICY

    chunks = list(client.completions.create(model=MODEL, prompt=FRANCE, temperature=0, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    *content, last = chunks
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in content) == choice.text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert last.choices == []
    assert last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == r.usage.prompt_tokens


def test_completion_prompt_forms(client):
    ids = [504, 3575, 282, 4649, 314]
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=3)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 3
    # a one-element list of strings is the string itself
    one = client.completions.create(model=MODEL, prompt=[FRANCE], temperature=0, max_tokens=3)
    plain = client.completions.create(model=MODEL, prompt=FRANCE, temperature=0, max_tokens=3)
    assert one.choices[0].text == plain.choices[0].text
    assert one.usage == plain.usage


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=FRANCE, temperature=0, max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the most likely token
        assert token in top
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]


# errors


def test_wrong_api_key(server_url):
    bad = openai.OpenAI(base_url=server_url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.chat.completions.create(model=MODEL, messages=RIVERS, max_tokens=1)
    assert_error(ei.value, 401, code="invalid_api_key")
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.models.list()
    assert_error(ei.value, 401)


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="gpt-4o", messages=RIVERS, max_tokens=1)
    err = assert_error(ei.value, 404, param="model", code="model_not_found")
    assert "gpt-4o" in err["message"]
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="nope", prompt="x", max_tokens=1, stream=True)
    assert_error(ei.value, 404, param="model")
    with pytest.raises(openai.NotFoundError) as ei:
        client.models.retrieve("nope")
    assert_error(ei.value, 404, param="model")


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": 5}, "temperature"),
    ({"n": 2}, "n"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
])
def test_invalid_parameter(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, **kwargs)
    err = assert_error(ei.value, 400, param=param)
    assert param in err["message"]


def test_empty_messages(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=[])
    assert_error(ei.value, 400, param="messages")


def test_bad_message_role(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=1)
    err = assert_error(ei.value, 400)
    assert err["param"].startswith("messages")


def test_context_length_exceeded(client):
    prompt_tokens = chat(client, max_tokens=1).usage.prompt_tokens
    max_tokens = CONTEXT - prompt_tokens + 10
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, max_tokens=max_tokens)
    err = assert_error(ei.value, 400, param="max_tokens", code="context_length_exceeded")
    assert str(CONTEXT) in err["message"]
    assert str(prompt_tokens + max_tokens) in err["message"]
    assert str(max_tokens) in err["message"]
    # streamed: refused before the stream starts
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, max_tokens=max_tokens, stream=True)
    assert_error(ei.value, 400, param="max_tokens")


def test_prompt_alone_beyond_context(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt=[1] * (CONTEXT + 1), max_tokens=1)
    err = assert_error(ei.value, 400, code="context_length_exceeded")
    assert str(CONTEXT) in err["message"]


def test_prompt_token_ids_out_of_range(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt=[1, 10**9], max_tokens=1)
    assert_error(ei.value, 400, param="prompt")


@pytest.mark.parametrize("decoding", ["medusa-9000", {"policy": "nope"}])
def test_unknown_decoding_policy(client, decoding):
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, max_tokens=1, extra_body={"decoding": decoding})
    err = assert_error(ei.value, 400, param="decoding", code="unknown_policy")
    assert "naive" in err["message"]


def test_server_undisturbed_after_errors(client, greedy_chat):
    again = chat(client)
    assert again.choices[0].message.content == greedy_chat.choices[0].message.content
    assert (again.usage.prompt_tokens, again.usage.completion_tokens) == \
           (greedy_chat.usage.prompt_tokens, greedy_chat.usage.completion_tokens)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: its prefix is reused


def test_medusa_with_the_shipped_heads_gives_naive_tokens(client, server_url):
    # SmolLM2 in its default format with decoding/trained's heads, through the SDK, streamed and not
    naive = chat(client, max_tokens=48)
    medusa = chat(client, max_tokens=48, extra_body={"decoding": "medusa"})
    assert medusa.choices[0].message.content == naive.choices[0].message.content
    stats = medusa.model_extra["decoding"]
    assert stats["policy"] == "medusa" and stats["exact"] is True and stats["tokens_per_step"] > 1
    assert sum(stats["accepted_length_histogram"].values()) == stats["steps"]
    chunks = list(chat(client, max_tokens=48, stream=True, extra_body={"decoding": {"policy": "medusa",
                                                                                     "tree": [[0], [1], [0, 0]]}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == naive.choices[0].message.content
    metrics = httpx.get(server_url + "/metrics", headers={"Authorization": "Bearer test-key"}).text
    assert 'edgespec_accepted_length_count{policy="medusa"}' in metrics


@pytest.mark.parametrize("options", [{"tree": [[0, 0]]}, {"tree": [[0]] * 2}, {"acceptance": "lenient"},
                                     {"tree": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]}])
def test_bad_medusa_options(client, options):
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, max_tokens=1, extra_body={"decoding": {"policy": "medusa", **options}})
    assert_error(ei.value, 400, param="decoding")
