"""Exact policies through the API on the real model in its default format (Q4_1 layers, Q8_0 head, prefix
cache on), against the live server of conftest: at temperature 0 every exact policy streams naive's tokens;
the same request twice gives the same answer, greedy or seeded, the second from the prefix cache."""

from __future__ import annotations

import pytest

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "Give me three tips for a healthy breakfast.",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "Write a short poem about the sea.",
]
EXACT = [
    "speculative",
    {"policy": "speculative", "drafter": "ngram"},
    {"policy": "speculative", "drafter": "eagle"},
    {"policy": "speculative", "k": 8},
    {"policy": "medusa", "acceptance": "exact"},
]


def answer(client, prompt: str, decoding, stream: bool = False, **kw) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 64,
            "temperature": 0, "extra_body": {"decoding": decoding}} | kw
    if not stream:
        return client.chat.completions.create(**body).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **body)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_exact_policy_streams_naives_greedy_tokens(client, prompt):
    naive = answer(client, prompt, "naive")
    for decoding in EXACT:
        assert answer(client, prompt, decoding, stream=True) == naive, decoding


@pytest.mark.slow
@pytest.mark.parametrize("decoding", ["naive", "speculative"])
def test_identical_requests_give_identical_answers(client, decoding):
    prompt = "Name three rivers in Europe and one fact about each."
    first = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=48, temperature=0, extra_body={"decoding": decoding})
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=48, temperature=0, extra_body={"decoding": decoding})
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the second one's prompt came from the cache
    assert again.choices[0].message.content == first.choices[0].message.content
    seeded = [answer(client, prompt, decoding, temperature=0.9, seed=11, max_tokens=48) for _ in range(2)]
    assert seeded[0] == seeded[1]
