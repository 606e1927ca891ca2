"""POST /v1/embeddings on the real server: float and base64 (the OpenAI SDK's default), string, list and token
inputs, unit vectors that depend only on the input, usage counted, bad input a 400 naming the parameter."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": "Bearer test-key"}
HIDDEN = 576


@pytest.fixture
def http(server_url):
    with httpx.Client(base_url=server_url, headers=AUTH, timeout=120) as c:
        yield c


def embed(http, **body) -> httpx.Response:
    return http.post("/v1/embeddings", json={"model": MODEL, **body})


def test_float_and_base64_give_the_same_unit_vectors(http):
    texts = ["Turn on the living room light.", "What is the weather like today?"]
    floats = embed(http, input=texts)
    assert floats.status_code == 200, floats.text
    body = floats.json()
    assert body["object"] == "list" and body["model"] == MODEL and [d["index"] for d in body["data"]] == [0, 1]
    vectors = [d["embedding"] for d in body["data"]]
    assert all(len(v) == HIDDEN and abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vectors)
    assert vectors[0] != vectors[1]
    each = [embed(http, input=t).json() for t in texts]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(e["usage"]["prompt_tokens"]
                                                                                 for e in each)
    # one input alone, or beside another in the same steps: the same vector
    assert [e["data"][0]["embedding"] for e in each] == vectors
    b64 = embed(http, input=texts, encoding_format="base64").json()
    decoded = [list(struct.unpack(f"<{HIDDEN}f", base64.b64decode(d["embedding"]))) for d in b64["data"]]
    assert all(math.isclose(a, b, abs_tol=1e-7) for u, v in zip(decoded, vectors, strict=True)
               for a, b in zip(u, v, strict=True))


def test_token_inputs_equal_their_text(http):
    from model_fixtures import smollm2_folder
    from transformers import AutoTokenizer

    text = "Set the thermostat to 21 degrees."
    ids = AutoTokenizer.from_pretrained(smollm2_folder()).encode(text, add_special_tokens=False)
    want = embed(http, input=text).json()
    got = embed(http, input=ids).json()  # one list of ids is one input
    assert got["data"][0]["embedding"] == want["data"][0]["embedding"]
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] == len(ids)
    assert embed(http, input=[[1, 2, 3], [4, 5]]).json()["usage"]["prompt_tokens"] == 5


def test_the_openai_sdk_default_is_base64_and_decodes(client):
    out = client.embeddings.create(model=MODEL, input=["kitchen lights off", "play some jazz"])
    assert len(out.data) == 2 and all(len(d.embedding) == HIDDEN for d in out.data)
    assert abs(sum(x * x for x in out.data[0].embedding) - 1) < 1e-3
    assert out.usage.prompt_tokens > 0


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"),
    ({"input": [10**9]}, "input"), ({"input": "hi", "dimensions": 3}, "dimensions"),
    ({"input": "hi", "encoding_format": "hex"}, None),
])
def test_bad_input_is_a_400_and_the_server_goes_on(http, body, param):
    r = embed(http, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param)
    assert embed(http, input="still fine").status_code == 200
    assert http.post("/v1/embeddings", json={"model": "nope", "input": "x"}).status_code == 404
