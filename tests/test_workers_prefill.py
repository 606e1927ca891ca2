"""Pipelined prefill and prefix reuse over real worker processes (tiny model, SmolLM2's tokenizer, float32):
the same outputs as the in-process model, whatever the cuts; a worker applies a session's steps in order
even when they arrive out of order. Runs after test_workers.py (its name sorts after), whose two- and
three-worker servers it shares (processes.Servers)."""

from __future__ import annotations

import re
import secrets

import httpx
import pytest
import torch
from links import TestLink
from model_fixtures import make_feature_drafter, make_medusa_heads
from processes import greedy, local_workers, model_id, start_server, start_worker

from edgespec.workers.wire import encode

SYSTEM = "You are a helpful assistant for a smart home. " * 12  # about 130 tokens
QUESTIONS = ["Turn on the kitchen lights.", "Is the front door locked?"]


def ask(url: str, question: str, max_tokens: int = 16) -> dict:
    body = {"model": model_id(url), "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(tiny, servers):
    """Cold, monolithic, in-process answers (test_workers.py's reference server)."""
    url = servers.url("--model", tiny, "--prefix-cache-mib", "0")
    return {q: ask(url, q)["choices"][0]["message"]["content"] for q in QUESTIONS}


def prefix_hits(url: str) -> float:
    return float(re.search(r"^edgespec_prefix_cache_hits (\S+)$", httpx.get(url + "/metrics").text, re.M).group(1))


# the two- and three-worker servers are test_workers.py's (Servers): their earlier requests share under
# prefix_min_tokens with these prompts, so the first question finds nothing cached, as on a new server
@pytest.mark.parametrize("workers,segment,shared", [(2, "5", False), (3, "1", True), (2, None, True)],
                         ids=["2w-cut5", "3w-cut1", "2w-plan"])
def test_pipelined_prefill_over_workers_matches_in_process(tiny, reference, servers, tmp_path, workers, segment,
                                                           shared):
    args = local_workers(tiny, workers, *(("--prefill-segment", segment) if segment else ()))
    proc, url = (None, servers.url(*args)) if shared else start_server(tmp_path, "dist", *args)
    try:
        hits = prefix_hits(url)
        for q in QUESTIONS:
            answer = ask(url, q)
            assert answer["choices"][0]["message"]["content"] == reference[q]
        # the second question shared the system prompt with the first: its KV came from the workers' caches
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
        assert answer["decoding"]["cached_prompt_tokens"] == answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert prefix_hits(url) - hits == 1
        assert "edgespec_time_to_first_token_seconds" in httpx.get(url + "/metrics").text
    finally:
        if proc is not None:
            proc.stop()


def test_worker_applies_steps_in_order(tiny, tmp_path):
    token = secrets.token_hex(8)
    proc, url = start_worker(tmp_path, token, tiny, "w")
    auth = {"authorization": f"Bearer {token}"}
    try:
        assert httpx.post(url + "/assign", json={"first": 0, "last": 4, "dtype": "float32"}, headers=auth,
                          timeout=60).status_code == 200
        early, late = TestLink(url, token), TestLink(url, token)  # steps of one session on two links
        assert early.op("open", session="s", step=1, capacity=64)["ok"]

        def send(link: TestLink, sid: str, step: int, start: int, n: int) -> None:
            link.send({"op": "forward", "session": sid, "step": step, "start": start},
                      encode({"hidden": torch.randn(1, n, 64)}))

        send(late, "s", 3, 5, 4)  # step 3 (slots 5..8) first: applied alone it would leave a gap at slots 0..4
        with pytest.raises(TimeoutError):
            late.answer("s", 3, timeout=0.5)  # it waits for step 2
        send(early, "s", 2, 0, 5)
        assert early.answer("s", 2)[0]["op"] == "result"
        assert late.answer("s", 3)[0]["op"] == "result"
        # a fork of its first 9 slots (prefix reuse) starts its own steps, also applied in order
        assert early.op("fork", session="s", step=4, child="c", prefix_len=9, capacity=64)["ok"]
        send(late, "c", 2, 12, 2)
        with pytest.raises(TimeoutError):
            late.answer("c", 2, timeout=0.5)
        send(early, "c", 1, 9, 3)
        assert early.answer("c", 1)[0]["op"] == "result"
        assert late.answer("c", 2)[0]["op"] == "result"
        info = httpx.get(url + "/info", headers=auth).json()
        assert info["sessions"] == 2
        assert info["memory"]["kv_blocks"]["used"] == 2  # the session's block, and the child's copy it wrote into
    finally:
        proc.stop()


LONG = ("Summarise the following notes in one sentence. " + " ".join(
    f"Note {i}: the sensor in room {i % 7} read {20 + i % 5} degrees at {i % 24}:00." for i in range(40)))


@pytest.fixture(scope="module")
def smollm2_reference(servers):
    """Cold, in-process (test_workers.py's reference server of SmolLM2)."""
    return greedy(servers.url("--prefix-cache-mib", "0"), LONG, 24)


# Two workers of one thread: the cluster test_outline.py and test_lost_worker.py serve, whose profile is cached by
# then (a start measures a cluster it has no profile of); four of all cores each: test_workers.py's
@pytest.mark.slow
@pytest.mark.parametrize("workers,extra", [(2, ("--worker-threads", "1")), (4, ("--prefill-segment", "97"))],
                         ids=["2w-plan", "4w-cut97"])
def test_smollm2_pipelined_prefill_and_reuse_match_in_process(smollm2_reference, tmp_path, workers, extra):
    proc, url = start_server(tmp_path, "dist", "--local-workers", str(workers), "--placement", "even", *extra)
    try:
        assert greedy(url, LONG, 24) == smollm2_reference
        assert greedy(url, LONG, 24) == smollm2_reference  # the second time from the kept prefix
        assert "edgespec_prefix_cache_hits 1.0" in httpx.get(url + "/metrics").text
    finally:
        proc.stop()


MEDUSA_PROMPT = [(i % 7) + 100 for i in range(30)]


@pytest.fixture(scope="module")
def drafting(tiny, tiny_loaded, tmp_path_factory):
    """Two workers serving with a random EAGLE drafter (its drafts mostly rejected) and Medusa heads proposing the
    tokens naive emits for MEDUSA_PROMPT and as many others (the trees hit, so paths get compacted): (url, naive's
    40 tokens in-process). One server for the speculative and the Medusa test: neither policy reads the other's
    weights."""
    import asyncio

    from edgespec.decoding.naive import NaivePolicy
    from edgespec.decoding.types import GenerationRequest, SamplingParams
    from edgespec.engine.engine import Engine

    request = GenerationRequest(MEDUSA_PROMPT, 40, SamplingParams(temperature=0.0))

    async def naive():
        return [t async for e in NaivePolicy().generate(request, Engine(tiny_loaded.executor), tiny_loaded.tokenizer)
                for t in e.token_ids]

    tokens = asyncio.run(naive())
    tmp = tmp_path_factory.mktemp("drafting")
    eagle = make_feature_drafter(tiny, tmp / "eagle.safetensors")
    vocab = sorted(set(tokens) | set(range(1000, 1000 + len(set(tokens)))))
    heads = make_medusa_heads(tiny, tmp / "heads.safetensors", vocab, [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]])
    proc, url = start_server(tmp, "drafting", *local_workers(tiny, 2, "--eagle", str(eagle), "--medusa", str(heads)))
    try:
        yield url, tokens
    finally:
        proc.stop()


def test_speculative_over_workers_equals_naive(drafting):
    url, _ = drafting
    body = {"model": model_id(url), "temperature": 0, "max_tokens": 40,
            "messages": [{"role": "user", "content": "Repeat after me: one two three, one two three, one two"}]}
    naive = httpx.post(url + "/v1/chat/completions", json={**body, "decoding": "naive"}, timeout=300).json()
    for drafter in ("ngram", "eagle"):
        spec = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            **body, "decoding": {"policy": "speculative", "k": 4, "drafter": drafter}}).json()
        assert spec["choices"][0]["message"]["content"] == naive["choices"][0]["message"]["content"]
        assert spec["decoding"]["policy"] == "speculative" and spec["decoding"]["drafter"] == drafter
    plain = httpx.post(url + "/v1/chat/completions", json={**body, "decoding": {"policy": "speculative"}},
                       timeout=300).json()
    assert plain["choices"][0]["message"]["content"] == naive["choices"][0]["message"]["content"]
    assert plain["decoding"]["drafter"] == "eagle+ngram"  # the plain policy's default
    bad = httpx.post(url + "/v1/chat/completions", json={**body, "decoding": {"policy": "speculative",
                                                                              "drafter": "nope"}}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "decoding"
    assert "ngram" in bad.json()["error"]["message"]


def test_medusa_over_workers_equals_naive(tiny_loaded, drafting):
    url, tokens = drafting
    body = {"model": model_id(url), "prompt": MEDUSA_PROMPT, "temperature": 0, "max_tokens": 40}
    naive_text = httpx.post(url + "/v1/completions", json={**body, "decoding": "naive"},
                            timeout=300).json()["choices"][0]["text"]
    assert naive_text == tiny_loaded.tokenizer.decode(tokens)
    for tree in (None, [[0], [1], [0, 0]]):
        decoding = {"policy": "medusa", **({"tree": tree} if tree else {})}
        r = httpx.post(url + "/v1/completions", json={**body, "decoding": decoding}, timeout=300).json()
        assert r["choices"][0]["text"] == naive_text
        assert r["decoding"]["tokens_per_step"] > 1 and r["decoding"]["wire_requests_per_token"] > 0
