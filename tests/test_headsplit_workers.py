"""HeadSplit blocks over real worker processes (workers/head_relay.py, workers/head_routes.py,
workers/head_client.py): KV groups split across workers give exactly the in-process model's outputs (float32),
with and without speculation at epsilon 0, gathered at a projection worker or by the controller (Gemma 3's
output norms and sliding layers too), the per-step
calls on links; a worker past its memory threshold hands groups and their caches to another; the control
routes want the cluster token, and routes and link calls refuse bad input without disturbing a session; a
lost peer fails the step at once."""

from __future__ import annotations

import asyncio
import secrets
import time

import httpx
import pytest
import torch
from links import TestLink
from model_fixtures import make_tiny_model, smollm2_folder
from processes import start_worker
from test_headsplit_exec import watch_for
from websockets.asyncio.server import serve

from edgespec.model.config import ModelConfig
from edgespec.model.head_blocks import StepRows
from edgespec.model.headsplit import HeadSplitPipeline, blocks_of
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.stage import BatchEntry, StageFailure
from edgespec.model.weights import open_source
from edgespec.planning.headsplit import LayerPlace
from edgespec.workers.frames import unpack
from edgespec.workers.head_client import batch_of, call_ms, remote_headsplit
from edgespec.workers.head_relay import HeadRelay
from edgespec.workers.host import StageHost
from edgespec.workers.settings import WorkerSettings

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
    yield token, {f"w{i}": url for i, (_, url) in enumerate(procs)}, {f"w{i}": p for i, (p, _) in enumerate(procs)}
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
    token, urls, procs = workers
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
    # what compare-headsplit's planner takes as a call's cost: a frame on a link, a hidden state out, its answer back
    assert 0 < call_ms(urls["w1"], token, 4 * cfg.hidden_size, n=3) < 1000
    # step numbers: a device refuses a call older than the last step it saw (409); the same step again is applied
    auth = {"authorization": f"Bearer {token}"}
    link = TestLink(urls["w0"], token)
    assert link.call("head_open", session="t", capacity=8)[0]["ok"]
    x = torch.randn(1, cfg.hidden_size)

    def rows(session: str, step: int) -> bytes:  # one row at slot 0, as a step's batch message
        return batch_of([StepRows(session, 0, 1, None, step)], x, torch.tensor([0]))

    def attend(step: int) -> tuple[dict, bytes]:  # w0 holds layer 0's group 0 in this placement
        return link.call("attend", rows("t", step), layer=0)

    first, again, stale = attend(2), attend(2), attend(1)
    assert first[0]["ok"] and again[0]["ok"] and first[1] == again[1]
    assert stale[0]["status"] == 409 and "older than the last" in stale[0]["message"]
    # w0 holds every block and passes 85% of its memory: groups move to w1 with their caches, over HTTP
    start = [LayerPlace({"w0": list(range(cfg.n_kv_heads))}, "w0", "w0") for _ in range(cfg.n_layers)]
    pipe = remote_headsplit(urls, token, start, cfg, model=folder)
    pipe.watch(watch_for(pipe, cfg, "w0"))
    got, _ = run(pipe, folder, IDS, 5, 0.05)
    assert pipe.replacements == 1 and blocks_of(pipe.layers, "w1")[0]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    pipe.close()
    # the cluster's token only; bad input is a clear 400 and the session goes on
    url = urls["w0"]
    assert httpx.post(url + "/heads/assign", json={"groups": {}}, timeout=30).status_code == 401
    assert link.call("head_open", session="s", capacity=8)[0]["ok"]
    bad, _ = link.call("attend", b"junk", layer=0)
    assert bad["status"] == 400 and "safetensors" in bad["message"]
    assert link.call("head_open", session="s", capacity=10**6)[0]["status"] == 400  # past the context
    assert link.call("head_commit", session="s", kept="x", dest=0, step=1)[0]["status"] == 400
    assert link.call("attend", rows("s", 1), layer=0)[0]["ok"]  # undisturbed
    held = httpx.get(url + "/heads/memory", headers=auth).json()["used_bytes"]
    for path, kw in (("/heads/reshape", {"headers": {**auth, "x-blocks": "{"}}),
                     ("/heads/reshape", {"headers": {**auth, "x-blocks": '{"groups": {"0": [0]}}'}, "content": b"x"}),
                     ("/heads/export", {"headers": auth, "json": {"groups": {"99": [0]}}}),
                     ("/heads/placement", {"headers": auth, "json": [{"groups": {}, "proj": "w0", "ffn": "w0"}]})):
        r = httpx.post(url + path, **kw)
        assert r.status_code == 400, (path, r.text)
    assert httpx.get(url + "/heads/memory", headers=auth).json()["used_bytes"] == held  # nothing changed
    # the old HTTP data plane is gone: the per-step calls travel on links only
    for path in ("/heads/sessions/s/attend", "/heads/sessions/s/run", "/heads/ffn", "/heads/sessions/s/open"):
        assert httpx.post(url + path, content=rows("s", 2), headers=auth).status_code == 404, path
    link.close()
    # a lost peer: w0 gathers every layer and calls w1 over its link; once w1 is gone the step fails at once
    # (a StageFailure for the engine to re-place on), not after the stage timeout
    pipe = remote_headsplit(urls, token, spread(cfg, list(urls), False, one_proj=True), cfg, model=folder,
                            timeout_s=60)
    pipe.open("s", 8, epsilon=0.0)
    ends = TokenEnds.load(open_source(folder), cfg, torch.float32)
    pipe.forward("s", ends.embed_tokens(torch.tensor([IDS[:2]])), torch.arange(2)[None], 0)
    procs["w1"].stop()
    t0 = time.monotonic()
    with pytest.raises(StageFailure):
        pipe.forward("s", ends.embed_tokens(torch.tensor([[IDS[2]]])), torch.tensor([[2]]), 2)
    assert time.monotonic() - t0 < 10
    pipe.close()


def shared_steps(pipe, ends, prompts: list[list[int]], epsilons: list[float], n: int) -> list[torch.Tensor]:
    """Sessions s0.. opened at their epsilons: their prompts in one shared step, then n shared decoding steps
    (token 7 + i each) -> every step's output [M, H]."""
    for s, (prompt, eps) in enumerate(zip(prompts, epsilons, strict=True)):
        pipe.open(f"s{s}", len(prompt) + n + 8, epsilon=eps)
    steps = [[(s, p, 0) for s, p in enumerate(prompts)]]
    steps += [[(s, [7 + i], len(p) + i) for s, p in enumerate(prompts)] for i in range(n)]
    outs = []
    for step in steps:
        entries = [BatchEntry(f"s{s}", start, len(ids)) for s, ids, start in step]
        ids = [t for _, rows, _ in step for t in rows]
        positions = torch.cat([torch.arange(start, start + len(rows)) for _, rows, start in step])
        outs.append(pipe.forward_batch(entries, ends.embed_tokens(torch.tensor([ids]))[0], positions))
    return outs


@pytest.mark.parametrize("workers", [(2, "tiny")], indirect=True, ids=["tiny-2w"])
def test_shared_steps_forks_commits_and_kv_figures_over_two_workers(workers, tiny):
    """Over workers, a step of several sessions is one call per device (gathered: one `run` per projection
    worker for all of them) with the in-process schedule's bits; a fork copies a prefix on every worker and a
    commit moves slots as in-process; each worker reports its caches' blocks with its acks and after a release."""
    token, urls, _ = workers
    cfg = ModelConfig.from_folder(tiny)
    ends = TokenEnds.load(open_source(tiny), cfg, torch.float32)
    prompts = [IDS[:5], IDS[3:11], IDS[:2]]
    epsilons, n = [0.0, float("inf"), 0.0], 3
    with torch.inference_mode():
        for gathered in (True, False):
            layers = spread(cfg, list(urls), True, one_proj=gathered)
            local = HeadSplitPipeline.local(open_source(tiny), cfg, torch.float32, layers)
            pipe = remote_headsplit(urls, token, layers, cfg, model=tiny, gathered=gathered)
            try:
                for got, want in zip(shared_steps(pipe, ends, prompts, epsilons, n),
                                     shared_steps(local, ends, prompts, epsilons, n), strict=True):
                    assert torch.equal(got, want)
                assert all(pipe.stats[s] == local.stats[s] for s in ("s0", "s1", "s2"))
                assert sum(pipe.stats["s1"].kept) == n * (cfg.n_layers - 1) and sum(pipe.stats["s0"].kept) == 0
                if gathered:  # one run call per shared step, counted by each session with its share of the bytes
                    assert all(pipe.wire(s)[f"controller-{layers[0].proj}"][1] == n + 1 for s in ("s0", "s1"))
                # a fork of s1's first 6 slots, and a commit of s0's slots [5, 7] to 5, then a token each
                rest = ends.embed_tokens(torch.tensor([IDS[3 + 6:11]]))
                for p in (pipe, local):
                    p.fork("s1", "c", 6, 16)
                    p.commit("s0", [5, 7], 5)
                    assert p.epsilons["c"] == float("inf")
                assert torch.equal(pipe.forward("c", rest, torch.arange(6, 8)[None], 6),
                                   local.forward("c", rest, torch.arange(6, 8)[None], 6))
                x = ends.embed_tokens(torch.tensor([[9]]))
                assert torch.equal(pipe.forward("s0", x, torch.tensor([[7]]), 7),
                                   local.forward("s0", x, torch.tensor([[7]]), 7))
                # the workers' reports: the caches of 4 sessions, what in-process devices count
                assert pipe.pool_blocks()[0] == local.pool_blocks()[0] > 0 and pipe.pool_blocks()[1] > 0
                assert pipe.kv_bytes() == local.kv_bytes()
                for s in ("s0", "s1", "s2", "c"):
                    pipe.release(s)
                deadline = time.monotonic() + 10  # a release has no ack: its report follows it
                while pipe.pool_blocks()[0] and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert pipe.pool_blocks()[0] == 0 and pipe.kv_bytes() == 0
            finally:
                pipe.close()


@pytest.mark.parametrize("workers", [(2, "tiny")], indirect=True, ids=["gemma3-2w"])
def test_gemma3_over_two_workers(workers, tmp_path):
    # the norm of the attention's output is applied where a layer's groups are summed: at the controller, or at
    # the projection worker; the FFN's by the FFN worker; the sliding layers' groups attend within the window
    token, urls, _ = workers
    folder = str(make_tiny_model(tmp_path / "gemma3", arch="gemma3", vocab_size=800, num_hidden_layers=4,
                                 sliding_window=3, sliding_window_pattern=2, query_pre_attn_scalar=48))
    cfg = ModelConfig.from_folder(folder)
    assert any(cfg.sliding_layers) and not all(cfg.sliding_layers)
    want = exact(folder, IDS, 5)
    for gathered in (False, True):  # every speculation discarded at epsilon 0: the exact model
        pipe = remote_headsplit(urls, token, spread(cfg, list(urls), True, one_proj=gathered), cfg, model=folder,
                                gathered=gathered)
        got, discarded = run(pipe, folder, IDS, 5, 0.0)
        pipe.close()
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        assert discarded == (len(IDS) - 5) * (cfg.n_layers - 1)


def test_a_peer_link_closing_fails_the_calls_waiting_on_it(tiny):
    """A projection worker's call waits for its peer's ack; when the link closes first (the peer died mid-call)
    the call fails with ConnectionError at once, however long the downstream timeout."""
    settings = WorkerSettings(port=0, token="t", model=tiny, downstream_timeout_s=60)

    async def scenario() -> float:
        got = []

        async def peer(ws):  # takes one call, then goes away without answering
            got.append(unpack(await ws.recv())[0])
            await ws.close()

        async with serve(peer, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            relay = HeadRelay(StageHost(settings), settings)
            t0 = time.monotonic()
            with pytest.raises(ConnectionError, match="closed"):
                await relay.call_peer(f"http://127.0.0.1:{port}", {"op": "ffn", "layer": 0}, b"")
            seconds = time.monotonic() - t0
            assert got and got[0]["op"] == "ffn" and not relay.calls
            with pytest.raises(ConnectionError):  # and a peer that is not there at all
                await relay.call_peer("http://127.0.0.1:9", {"op": "ffn", "layer": 0}, b"")
            await relay.close()
        return seconds

    assert asyncio.run(scenario()) < 5


@pytest.mark.slow
@pytest.mark.parametrize("workers", [(2, None), (3, None)], indirect=True, ids=["smollm2-2w", "smollm2-3w"])
def test_smollm2_head_level_over_workers_equals_the_model(workers):
    token, urls, _ = workers
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
