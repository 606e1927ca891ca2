"""The `headsplit` policy served as the engine's second lane, on the tiny model with a HeadSplit profile that has
its layers speculate: in-process and over 2 local workers, a request sharing a long prompt prefix with an
earlier one starts from its cached blocks (cached_tokens) and gives the text it gives cold, at epsilon 0 and
at the default epsilon; concurrent headsplit streams share passes and give their texts alone; and /metrics
shows the KV blocks a stream holds while it runs, for the layer pipeline's workers and for HeadSplit's lane."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from inprocess import LoopClient, controller_app
from processes import model_id, start_server

SYSTEM = ("You are the assistant of a smart home. The living room has three lamps, a thermostat and a television; "
          "the kitchen has a kettle, an oven and two lamps; the garden has a sprinkler and a gate. Answer briefly, "
          "name the devices you act on, and never turn the oven on without asking first.")
QUESTIONS = ["Turn on the lamps.", "Is the gate open?", "Start the kettle.", "Water the garden."]
# the servers' default tolerance: on the tiny random model's drift (||Z - X|| / ||X|| near 1) a tolerance this
# loose keeps every speculation, so that the default runs keep them and epsilon 0 discards them all
EPSILON = 1000.0


def profile(tmp: Path) -> Path:
    """A HeadSplit profile of the tiny model's 4 layers: every speculation likely kept (alpha 1 from epsilon 0
    on), and an FFN slow enough that speculating gains: the placement speculates at every layer after the
    first."""
    record = {"alpha": {"0.0": [1.0] * 4},
              "block_ms": {"by_context": {"0": {"group_ms": 1.0, "proj_ms": 0.0, "ffn_ms": 100.0}}}}
    path = tmp / "tiny-headsplit.json"
    path.write_text(json.dumps(record))
    return path


def chat(question: str, epsilon: float | None = None, max_tokens: int = 12, system: str = SYSTEM) -> dict:
    decoding = {"policy": "headsplit"} | ({"epsilon": epsilon} if epsilon is not None else {})
    return {"model": "tiny", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "temperature": 0, "max_tokens": max_tokens, "min_tokens": max_tokens, "decoding": decoding}


def prefix_reuse(post) -> None:
    """post(body) -> the response's JSON. At epsilon 0 and the default one: a cold request, another sharing its
    system prompt (cached), and the first again (cached): the same text as cold."""
    for epsilon, (first, second) in ((0.0, QUESTIONS[:2]), (None, QUESTIONS[2:])):
        system = f"({epsilon}) {SYSTEM}"  # a system prompt of its own: nothing cached before its cold request
        cold = post(chat(first, epsilon, system=system))
        other = post(chat(second, epsilon, system=system))
        warm = post(chat(first, epsilon, system=system))
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            other["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
        assert warm["decoding"]["headsplit"]["speculating_layers"] == 3
        assert warm["decoding"]["headsplit"] == {**cold["decoding"]["headsplit"]}  # the same speculations
        kept = warm["decoding"]["headsplit"]["speculations_kept"]
        assert kept == (0 if epsilon == 0 else 3 * 11)  # 11 decoding steps after the first token


def shared_streams(post) -> None:
    """4 headsplit requests at once (each its own system prompt: nothing cached to share) share passes and give
    the texts they give alone."""
    bodies = [chat(q, max_tokens=16, system=f"{i}. {SYSTEM}") for i, q in enumerate(QUESTIONS)]
    alone = [post(b) for b in bodies]
    assert all(r["decoding"].get("shared_with_mean", 0) == 0 for r in alone)
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(post, bodies))
    assert [r["choices"][0]["message"]["content"] for r in together] == \
        [r["choices"][0]["message"]["content"] for r in alone]
    assert all(r["decoding"]["shared_with_mean"] > 0 for r in together), [r["decoding"] for r in together]
    assert [r["decoding"]["headsplit"] for r in together] == [r["decoding"]["headsplit"] for r in alone]
    assert all(r["decoding"]["headsplit"]["speculations_kept"] == 3 * 15 for r in together)


@pytest.fixture(scope="module")
def in_process(tiny, tmp_path_factory):
    app, service = controller_app(tiny, served_model_name="tiny", headsplit=True, prefix_min_tokens=16,
                                  headsplit_epsilon=EPSILON,
                                  headsplit_profile=str(profile(tmp_path_factory.mktemp("hs-profile"))))
    client = LoopClient(app)
    yield client
    client.close()
    service.engine.close()


def posting(client: LoopClient):
    def post(body: dict) -> dict:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    return post


def test_prefix_reuse_over_headsplit_in_process(in_process):
    prefix_reuse(posting(in_process))


def test_concurrent_headsplit_streams_share_passes_in_process(in_process):
    shared_streams(posting(in_process))


def sample(text: str, name: str, labels: str) -> float:
    found = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def blocks_during_a_stream(url: str, body: dict) -> str:
    """/metrics scraped after the stream's first chunks, before its end."""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as s:
        chunks = 0
        for line in s.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                chunks += 1
                if chunks == 3:
                    text = httpx.get(url + "/metrics", timeout=30).text
            if line == "data: [DONE]":
                break
    assert chunks > 3
    return text


def test_headsplit_and_kv_figures_over_two_workers(tiny, tmp_path):
    proc, url = start_server(tmp_path, "hs-workers", "--model", tiny, "--local-workers", "2", "--worker-threads", "1",
                             "--placement", "even", "--prefix-min-tokens", "16", "--headsplit-epsilon", str(EPSILON),
                             "--headsplit-profile", str(profile(tmp_path)))
    try:
        name = model_id(url)

        def post(body: dict) -> dict:
            r = httpx.post(url + "/v1/chat/completions", json={**body, "model": name}, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()

        # the layer pipeline's workers: their pools' blocks while a stream runs
        naive = {**chat("Tell me about the lamps.", max_tokens=40), "model": name, "decoding": "naive"}
        text = blocks_during_a_stream(url, naive)
        assert sample(text, "edgespec_kv_pool_blocks", 'state="used"') > 0
        assert sample(text, "edgespec_kv_blocks", 'lane="layers",state="used"') > 0
        assert sample(text, "edgespec_kv_pool_blocks", 'state="free"') > 0
        assert sample(text, "edgespec_kv_lane_bytes", 'lane="layers"') > 0
        # HeadSplit's devices on the workers: their caches' blocks while a stream runs
        text = blocks_during_a_stream(url, {**chat("Tell me about the oven.", max_tokens=40), "model": name})
        assert sample(text, "edgespec_kv_blocks", 'lane="headsplit",state="used"') > 0
        assert sample(text, "edgespec_kv_lane_bytes", 'lane="headsplit"') > 0
        prefix_reuse(post)
        shared_streams(post)
    finally:
        proc.stop()
