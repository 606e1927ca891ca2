"""HeadSplit steps shared by several sessions, and its KV operations, in-process (tiny model, float32, the
compiled row-invariant kernels): a step of 4 sessions runs the schedule once (one call per device per layer, a
second only for the sessions whose speculation is discarded) and gives each session bitwise what it gets alone,
speculations kept and discarded alike, its cache included; a fork copies a session's first slots into caches of
the child's own, and a commit moves kept slots as KVCache.commit does; the devices count their blocks."""

from __future__ import annotations

import pytest
import torch

from edgespec.model.headsplit import HeadSplitPipeline
from edgespec.model.stage import BatchEntry, StepError
from edgespec.model.weights import open_source
from edgespec.planning.headsplit import LayerPlace

PROMPTS = [[(7 * i + 3 * s) % 600 + 50 for i in range(3 + 2 * s)] for s in range(4)]
STEPS = 6  # decoding steps after the prompts


def placement(n_layers: int) -> list[LayerPlace]:
    # each layer's two KV groups on two devices, the FFN alternating, every layer after the first speculating
    return [LayerPlace({"a": [0], "b": [1]}, "a", "ab"[i % 2], i > 0) for i in range(n_layers)]


class Counting:
    """A device that counts the calls the schedule starts on it."""

    def __init__(self, device):
        self.device, self.attends, self.ffns = device, 0, 0

    def start_attend(self, *args):
        self.attends += 1
        return self.device.start_attend(*args)

    def start_ffn(self, *args):
        self.ffns += 1
        return self.device.start_ffn(*args)

    def __getattr__(self, name):
        return getattr(self.device, name)


@pytest.fixture(scope="module")
def parts(tiny, tiny_loaded):
    cfg = tiny_loaded.cfg
    return open_source(tiny), cfg, tiny_loaded.executor.ends


def pipeline(parts) -> HeadSplitPipeline:
    src, cfg, _ = parts
    return HeadSplitPipeline.local(src, cfg, torch.float32, placement(cfg.n_layers))


def token(s: int, step: int) -> int:
    return (31 * s + 17 * step) % 600 + 40  # the token a session feeds at a decoding step (fixed, not sampled)


def alone(parts, s: int, epsilon: float) -> tuple[list[torch.Tensor], HeadSplitPipeline]:
    """Session s's prompt, then STEPS tokens, in passes of its own: each pass's output [T, H]."""
    _, _, ends = parts
    pipe = pipeline(parts)
    prompt = PROMPTS[s]
    pipe.open("x", len(prompt) + STEPS, epsilon=epsilon)
    with torch.inference_mode():
        outs = [pipe.forward("x", ends.embed_tokens(torch.tensor([prompt])), torch.arange(len(prompt))[None], 0)[0]]
        for step in range(STEPS):
            p = len(prompt) + step
            outs.append(pipe.forward("x", ends.embed_tokens(torch.tensor([[token(s, step)]])), torch.tensor([[p]]),
                                     p)[0])
    return outs, pipe


@pytest.mark.parametrize("epsilons", [[0.0] * 4, [float("inf")] * 4, [0.0, float("inf"), 0.0, float("inf")]],
                         ids=["discarded", "kept", "both"])
def test_a_batched_step_gives_each_session_its_bits_alone(parts, epsilons):
    ends = parts[2]
    want = [alone(parts, s, eps) for s, eps in enumerate(epsilons)]
    pipe = pipeline(parts)
    counted = {name: Counting(d) for name, d in pipe.devices.items()}
    pipe.devices = counted
    for s, eps in enumerate(epsilons):
        pipe.open(f"s{s}", len(PROMPTS[s]) + STEPS, epsilon=eps)
    got: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    fed = [0] * 4  # decoding steps each session has run

    def step(sessions: list[int]) -> None:
        # one batched pass: a session not yet started feeds its prompt, the others their next token
        entries, ids, positions = [], [], []
        for s in sessions:
            if not got[s]:
                rows, start = PROMPTS[s], 0
            else:
                rows, start = [token(s, fed[s])], len(PROMPTS[s]) + fed[s]
                fed[s] += 1
            entries.append(BatchEntry(f"s{s}", start, len(rows)))
            ids += rows
            positions += range(start, start + len(rows))
        with torch.inference_mode():
            out = pipe.forward_batch(entries, ends.embed_tokens(torch.tensor([ids]))[0], torch.tensor(positions))
        for s, part in zip(sessions, out.split([e.length for e in entries]), strict=True):
            got[s].append(part)

    step([0, 1, 2])  # three prompts in one pass
    step([0, 1, 2, 3])  # three decoding rows beside a prompt: the prompt's rows never speculate, as alone
    before = {name: (d.attends, d.ffns) for name, d in counted.items()}
    step([0, 1, 2, 3])  # four decoding rows: one call per device and layer, and one more where any discards
    for name, d in counted.items():
        speculating = sum(lp.speculate for lp in pipe.layers)
        again = speculating if any(eps == 0 for eps in epsilons) else 0
        groups_here = sum(1 for lp in pipe.layers if lp.groups.get(name))
        assert d.attends - before[name][0] == groups_here + again, name
        assert d.ffns - before[name][1] == sum(lp.ffn == name for lp in pipe.layers), name
    while min(fed) < STEPS:
        step([s for s in range(4) if fed[s] < STEPS])
    for s, (outs, ref) in enumerate(want):
        assert len(got[s]) == len(outs)
        for g, w in zip(got[s], outs, strict=True):
            assert torch.equal(g, w), s
        assert pipe.stats[f"s{s}"] == ref.stats["x"]
        for name, device in pipe.devices.items():  # the caches hold what alone they hold, staged entries included
            for layer, cache in device.sessions[f"s{s}"].items():
                other = ref.devices[name].sessions["x"][layer]
                assert cache.length == other.length
                for g in range(len(cache.pool.k)):
                    assert all(torch.equal(a, b) for a, b in zip(cache.read(g, cache.length),
                                                                 other.read(g, other.length), strict=True))
    kept = sum(sum(pipe.stats[f"s{s}"].kept) for s in range(4))
    discarded = sum(sum(pipe.stats[f"s{s}"].discarded) for s in range(4))
    speculating = sum(lp.speculate for lp in pipe.layers)
    assert kept == speculating * STEPS * sum(eps > 0 for eps in epsilons)
    assert discarded == speculating * STEPS * sum(eps == 0 for eps in epsilons)


def test_a_fork_copies_the_prefix_into_caches_of_its_own(parts):
    ends = parts[2]
    prompt = PROMPTS[3] + PROMPTS[2]
    pipe = pipeline(parts)
    pipe.open("p", 32, epsilon=0.0)
    with torch.inference_mode():
        pipe.forward("p", ends.embed_tokens(torch.tensor([prompt])), torch.arange(len(prompt))[None], 0)
        pipe.speculate("p", 0.25)
        pipe.fork("p", "c", 6, 20)
        assert pipe.epsilons["c"] == 0.25 and pipe.lengths["c"] == 6 and sum(pipe.stats["c"].kept) == 0
        for device in pipe.devices.values():
            for layer, cache in device.sessions["c"].items():
                parent = device.sessions["p"][layer]
                assert cache.pool is not parent.pool and cache.length == 6 and cache.capacity == 20
                for g in range(len(cache.pool.k)):
                    assert all(torch.equal(a, b) for a, b in zip(cache.read(g, 6), parent.read(g, 6), strict=True))
        pipe.release("p")  # the child reads nothing of the parent's: it goes on alone
        rest = ends.embed_tokens(torch.tensor([prompt[6:]]))
        got = pipe.forward("c", rest, torch.arange(6, len(prompt))[None], 6)
        cold = pipeline(parts)
        cold.open("c", 20, epsilon=0.25)
        cold.forward("c", ends.embed_tokens(torch.tensor([prompt[:6]])), torch.arange(6)[None], 0)
        assert torch.equal(got, cold.forward("c", rest, torch.arange(6, len(prompt))[None], 6))


def test_a_commit_moves_kept_slots_as_the_kv_cache_does(parts):
    ends = parts[2]
    ids = PROMPTS[3]  # 9 tokens
    pipe = pipeline(parts)
    pipe.open("t", 16)
    with torch.inference_mode():
        pipe.forward("t", ends.embed_tokens(torch.tensor([ids])), torch.arange(len(ids))[None], 0)
    kept, dest = [5, 7, 8], 4
    before = {(name, layer): [cache.read(g, len(ids)) for g in range(len(cache.pool.k))]
              for name, d in pipe.devices.items() for layer, cache in d.sessions["t"].items()}
    pipe.commit("t", kept, dest)
    assert pipe.lengths["t"] == dest + len(kept)
    index = torch.tensor(list(range(dest)) + kept)
    for (name, layer), groups in before.items():
        cache = pipe.devices[name].sessions["t"][layer]
        assert cache.length == dest + len(kept)
        for g, (k, v) in enumerate(groups):  # slot dest+i holds what slot kept[i] held; slots before dest stay
            got_k, got_v = cache.read(g, cache.length)
            assert torch.equal(got_k, k[:, :, index]) and torch.equal(got_v, v[:, :, index])
    device = pipe.devices["a"]
    step = pipe.steps["t"]
    snapshot = [c.read(0, c.length) for c in device.sessions["t"].values()]
    device.commit("t", [4, 5], 3, step)  # the same step again: a retry, applied already
    assert all(torch.equal(a[0], c.read(0, c.length)[0]) for a, c in zip(snapshot, device.sessions["t"].values(),
                                                                          strict=True))
    with pytest.raises(StepError, match="older than the last"):
        device.commit("t", [4, 5], 3, step - 1)


def test_the_devices_count_their_blocks(parts):
    _, cfg, _ = parts
    per_slot = cfg.kv_bytes_per_token()  # float32 keys and values of every layer
    src = parts[0]
    pipe = HeadSplitPipeline.local(src, cfg, torch.float32, placement(cfg.n_layers), kv_budget_bytes=256 * per_slot)
    # the budget: each device's half holds 2 blocks of 64 slots of each group it has
    assert pipe.pool_blocks() == (0, 4 * cfg.n_layers * cfg.n_kv_heads)
    pipe.open("a", 60)  # one block of 64 slots per group and layer
    assert pipe.pool_blocks() == (cfg.n_layers * cfg.n_kv_heads, 3 * cfg.n_layers * cfg.n_kv_heads)
    assert pipe.kv_bytes() == 64 * per_slot
    pipe.fork("a", "b", 0, 100)  # two blocks each
    assert pipe.pool_blocks()[0] == 3 * cfg.n_layers * cfg.n_kv_heads
    pipe.release("a")
    pipe.release("b")
    assert pipe.pool_blocks() == (0, 4 * cfg.n_layers * cfg.n_kv_heads) and pipe.kv_bytes() == 0
