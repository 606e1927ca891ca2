"""HeadSplit blocks over real worker processes (workers/head_routes.py, workers/head_client.py): KV groups
split across workers give exactly the in-process model's outputs (float32), with and without speculation at
epsilon 0, gathered at a projection worker or by the controller; a worker past its memory threshold hands
groups and their caches to another; the routes want the cluster token and refuse bad input without disturbing
a session."""

from __future__ import annotations

import secrets

import httpx
import pytest
import torch
from model_fixtures import smollm2_folder
from processes import start_worker
from test_headsplit_exec import watch_for

from edgespec.model.config import ModelConfig
from edgespec.model.headsplit import HeadSplitPipeline, blocks_of
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source
from edgespec.planning.headsplit import LayerPlace
from edgespec.workers.head_client import remote_headsplit
from edgespec.workers.wire import encode

IDS = [(i * 13) % 300 + 400 for i in range(12)]


def exact(folder, ids: list[int], prefill: int) -> list[torch.Tensor]:
    cfg = ModelConfig.from_folder(folder)
    src = open_source(folder)
    stack, ends = LayerStack.load(src, cfg, 0, cfg.n_layers, torch.float32), TokenEnds.load(src, cfg, torch.float32)
    cache = stack.new_cache(len(ids))
    outs = [stack(ends.embed_tokens(torch.tensor([ids[:prefill]])), torch.arange(prefill)[None], cache, 0)]
    for p in range(prefill, len(ids)):
        outs.append(stack(ends.embed_tokens(torch.tensor([[ids[p]]])), torch.tensor([[p]]), cache, p))
    return outs


def run(pipe, folder, ids: list[int], prefill: int, epsilon: float) -> tuple[list[torch.Tensor], int]:
    """The outputs of a prefill then one token at a time, and how many speculations were discarded."""
    cfg = ModelConfig.from_folder(folder)
    ends = TokenEnds.load(open_source(folder), cfg, torch.float32)
    pipe.open("s", len(ids), epsilon=epsilon)
    try:
        outs = [pipe.forward("s", ends.embed_tokens(torch.tensor([ids[:prefill]])), torch.arange(prefill)[None], 0)]
        for p in range(prefill, len(ids)):
            outs.append(pipe.forward("s", ends.embed_tokens(torch.tensor([[ids[p]]])), torch.tensor([[p]]), p))
        return outs, sum(pipe.stats["s"].discarded)
    finally:
        pipe.release("s")


@pytest.fixture
def workers(request, tmp_path):
    n, model = request.param
    token = secrets.token_hex(8)
    procs = [start_worker(tmp_path, token, model, f"w{i}") for i in range(n)]
    yield token, {f"w{i}": url for i, (_, url) in enumerate(procs)}
    for proc, _ in procs:
        proc.stop()


def spread(cfg: ModelConfig, names: list[str], speculate: bool, one_proj: bool = False) -> list[LayerPlace]:
    """KV groups dealt over the workers (rotating per layer), FFN and projection rotating too (with one_proj,
    every layer gathers at the first worker: a step never goes back to the controller in between)."""
    out = []
    for layer in range(cfg.n_layers):
        groups: dict[str, list[int]] = {}
        for g in range(cfg.n_kv_heads):
            groups.setdefault(names[(g + layer) % len(names)], []).append(g)
        out.append(LayerPlace(groups, names[0 if one_proj else layer % len(names)], names[(layer + 1) % len(names)],
                              speculate and layer > 0))
    return out


@pytest.mark.parametrize("workers", [(2, "tiny")], indirect=True, ids=["tiny-2w"])
def test_tiny_over_two_workers(workers, tiny):
    token, urls = workers
    folder = tiny
    cfg = ModelConfig.from_folder(folder)
    want = exact(folder, IDS, 5)
    steps = len(IDS) - 5 + 1
    for gathered in (False, True):  # the controller gathers every layer, or the projection workers do
        for speculate, eps in ((False, 0.05), (True, 0.0)):
            layers = spread(cfg, list(urls), speculate, one_proj=gathered)
            pipe = remote_headsplit(urls, token, layers, cfg, model=folder, gathered=gathered)
            got, discarded = run(pipe, folder, IDS, 5, eps)
            pipe.close()
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
            assert discarded == (len(IDS) - 5) * (cfg.n_layers - 1) * speculate
    # a projection device that changes every layer: the step goes back through the controller each time, and
    # a layer after such a hand-over does not speculate
    pipe = remote_headsplit(urls, token, spread(cfg, list(urls), True), cfg, model=folder)
    got, discarded = run(pipe, folder, IDS, 5, 0.0)
    pipe.close()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert discarded == 0
    # gathered at one worker with speculation kept: the same outputs and counts as the schedule in-process,
    # and the controller sends one call per step
    layers = spread(cfg, list(urls), True, one_proj=True)
    local = HeadSplitPipeline.local(open_source(folder), cfg, torch.float32, layers)
    pipe = remote_headsplit(urls, token, layers, cfg, model=folder)
    for p in (local, pipe):
        p.open("s", len(IDS), epsilon=1.0)
    ends = TokenEnds.load(open_source(folder), cfg, torch.float32)
    for p in range(5, len(IDS) + 1):
        ids, pos = (IDS[:5], torch.arange(5)[None]) if p == 5 else ([IDS[p - 1]], torch.tensor([[p - 1]]))
        start = 0 if p == 5 else p - 1
        hidden = ends.embed_tokens(torch.tensor([ids]))
        torch.testing.assert_close(pipe.forward("s", hidden, pos, start), local.forward("s", hidden, pos, start),
                                   atol=1e-5, rtol=1e-5)
    assert pipe.stats["s"] == local.stats["s"] and sum(local.stats["s"].kept) > 0
    assert pipe.wire("s")["controller-w0"][1] == steps and pipe.wire("s")["w0-peers"][1] > 0
    pipe.release("s")
    pipe.close()
    # step numbers: a device refuses a call older than the last step it saw (409); the same step again is applied
    auth = {"authorization": f"Bearer {token}"}
    assert httpx.post(urls["w0"] + "/heads/sessions/t/open", json={"capacity": 8}, headers=auth).status_code == 200
    body = encode({"x": torch.randn(1, 1, cfg.hidden_size), "positions": torch.tensor([[0]])})

    def attend(step: int) -> httpx.Response:  # w0 holds layer 0's group 0 in this placement
        return httpx.post(urls["w0"] + "/heads/sessions/t/attend", params={"layer": 0, "start": 0, "step": step},
                          content=body, headers=auth)

    first, again, stale = attend(2), attend(2), attend(1)
    assert first.status_code == again.status_code == 200 and first.content == again.content
    assert stale.status_code == 409 and "older than the last" in stale.json()["error"]["message"]
    # w0 holds every block and passes 85% of its memory: groups move to w1 with their caches, over HTTP
    start = [LayerPlace({"w0": list(range(cfg.n_kv_heads))}, "w0", "w0") for _ in range(cfg.n_layers)]
    pipe = remote_headsplit(urls, token, start, cfg, model=folder)
    pipe.memory = watch_for(pipe, cfg, "w0")
    got, _ = run(pipe, folder, IDS, 5, 0.05)
    assert pipe.replacements == 1 and blocks_of(pipe.layers, "w1")[0]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    pipe.close()
    # the cluster's token only; bad input is a clear 400 and the session goes on
    url = urls["w0"]
    assert httpx.post(url + "/heads/assign", json={"groups": {}}, timeout=30).status_code == 401
    assert httpx.post(url + "/heads/sessions/s/open", json={"capacity": 8}, headers=auth).status_code == 200
    bad = httpx.post(url + "/heads/sessions/s/attend", params={"layer": 0, "start": 0, "step": 1}, content=b"junk",
                     headers=auth)
    assert bad.status_code == 400 and "safetensors" in bad.json()["error"]["message"]
    held = httpx.get(url + "/heads/memory", headers=auth).json()["used_bytes"]
    for path, kw in (("/heads/reshape", {"headers": {**auth, "x-blocks": "{"}}),
                     ("/heads/reshape", {"headers": {**auth, "x-blocks": '{"groups": {"0": [0]}}'}, "content": b"x"}),
                     ("/heads/export", {"headers": auth, "json": {"groups": {"99": [0]}}}),
                     ("/heads/placement", {"headers": auth, "json": [{"groups": {}, "proj": "w0", "ffn": "w0"}]})):
        r = httpx.post(url + path, **kw)
        assert r.status_code == 400, (path, r.text)
    assert httpx.get(url + "/heads/memory", headers=auth).json()["used_bytes"] == held  # nothing changed


@pytest.mark.slow
@pytest.mark.parametrize("workers", [(2, None), (3, None)], indirect=True, ids=["smollm2-2w", "smollm2-3w"])
def test_smollm2_head_level_over_workers_equals_the_model(workers):
    token, urls = workers
    folder = smollm2_folder()
    cfg = ModelConfig.from_folder(folder)
    want = exact(folder, IDS, 5)
    for speculate, eps in ((False, 0.05), (True, 0.0)):  # head-level; every speculation discarded
        pipe = remote_headsplit(urls, token, spread(cfg, list(urls), speculate, one_proj=speculate), cfg)
        got, discarded = run(pipe, folder, IDS, 5, eps)
        pipe.close()
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        assert discarded == (len(IDS) - 5) * (cfg.n_layers - 1) * speculate
