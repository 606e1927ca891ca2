"""HeadSplit execution in-process (model/headsplit.py) on the tiny model (float32): head-level blocks split
over devices equal the plain model; epsilon 0 (every speculation discarded) equals it too, caches included;
kept speculations are what the whole-sequence speculating pass computes; the bookkeeping counts them; a device
past its memory threshold hands groups to another with their caches, and the outputs stay exact."""

from __future__ import annotations

import pytest
import torch

from edgespec.model.drift import speculating_forward
from edgespec.model.head_blocks import HeadBlocks
from edgespec.model.headsplit import HeadSplitPipeline, MemoryWatch, blocks_of
from edgespec.model.kv_pool import CapacityError
from edgespec.model.stage import StepError
from edgespec.model.timing import model_card
from edgespec.model.weights import open_source
from edgespec.planning.headsplit import LayerPlace, head_card, place, profiled_devices

IDS = [(i * 11) % 70 + 100 for i in range(14)]


def placements(n_layers: int, speculate: bool) -> dict[str, list[LayerPlace]]:
    return {
        "2 devices": [LayerPlace({"a": [0], "b": [1]}, "a", "ab"[i % 2], speculate and i > 0)
                      for i in range(n_layers)],
        "3 devices": [LayerPlace({"b": [1], "c": [0]}, "c", "abc"[i % 3], speculate and i > 0)
                      for i in range(n_layers)],
    }


def exact_run(loaded, ids: list[int], prefill: int) -> list[torch.Tensor]:
    """Last-layer outputs of the plain stack: a prefill of `prefill` tokens, then one token at a time."""
    stack = loaded.executor.pipeline.stages[0].stack
    ends = loaded.executor.ends
    cache = stack.new_cache(len(ids))
    with torch.inference_mode():
        outs = [stack(ends.embed_tokens(torch.tensor([ids[:prefill]])), torch.arange(prefill)[None], cache, 0)]
        for p in range(prefill, len(ids)):
            outs.append(stack(ends.embed_tokens(torch.tensor([[ids[p]]])), torch.tensor([[p]]), cache, p))
    return outs


def split_run(loaded, pipe: HeadSplitPipeline, ids: list[int], prefill: int, epsilon: float) -> list[torch.Tensor]:
    ends = loaded.executor.ends
    pipe.open("s", len(ids), epsilon=epsilon)
    with torch.inference_mode():
        outs = [pipe.forward("s", ends.embed_tokens(torch.tensor([ids[:prefill]])), torch.arange(prefill)[None], 0)]
        for p in range(prefill, len(ids)):
            outs.append(pipe.forward("s", ends.embed_tokens(torch.tensor([[ids[p]]])), torch.tensor([[p]]), p))
    return outs


@pytest.fixture(scope="module")
def src(tiny):
    return open_source(tiny)


@pytest.mark.parametrize("where", ["2 devices", "3 devices"])
def test_head_level_blocks_equal_the_model(tiny_loaded, src, where):
    cfg = tiny_loaded.cfg
    pipe = HeadSplitPipeline.local(src, cfg, torch.float32, placements(cfg.n_layers, False)[where])
    for got, want in zip(split_run(tiny_loaded, pipe, IDS, 6, 0.05), exact_run(tiny_loaded, IDS, 6), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert sum(pipe.stats["s"].kept) == sum(pipe.stats["s"].discarded) == 0  # nothing speculated


@pytest.mark.parametrize("where", ["2 devices", "3 devices"])
def test_epsilon_zero_discards_every_speculation_and_is_exact(tiny_loaded, src, where):
    cfg = tiny_loaded.cfg
    pipe = HeadSplitPipeline.local(src, cfg, torch.float32, placements(cfg.n_layers, True)[where])
    got = split_run(tiny_loaded, pipe, IDS, 6, 0.0)
    for g, want in zip(got, exact_run(tiny_loaded, IDS, 6), strict=True):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
    steps = len(IDS) - 6
    assert pipe.stats["s"].discarded == [0] + [steps] * (cfg.n_layers - 1) and sum(pipe.stats["s"].kept) == 0
    # the staged entries were overwritten: every device's cache holds the exact keys and values
    plain = HeadSplitPipeline.local(src, cfg, torch.float32, placements(cfg.n_layers, False)[where])
    split_run(tiny_loaded, plain, IDS, 6, 0.0)
    for name, device in pipe.devices.items():
        for layer, cache in device.sessions["s"].items():
            want = plain.devices[name].sessions["s"][layer]
            torch.testing.assert_close(cache.read(0, len(IDS)), want.read(0, len(IDS)))


def test_kept_speculation_is_the_speculating_pass(tiny_loaded, src):
    # every speculation kept, one token at a time from the start: what the whole-sequence pass of
    # model/drift.py computes with the same decisions (its perplexity figures rest on this)
    cfg = tiny_loaded.cfg
    pipe = HeadSplitPipeline.local(src, cfg, torch.float32, placements(cfg.n_layers, True)["2 devices"])
    got = torch.cat(split_run(tiny_loaded, pipe, IDS, 1, float("inf")), dim=1)  # [1, T, H]
    stack = tiny_loaded.executor.pipeline.stages[0].stack
    want, kept = speculating_forward(stack, tiny_loaded.executor.ends.embed_tokens(torch.tensor([IDS])), float("inf"),
                                     [True] * cfg.n_layers)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert pipe.stats["s"].kept == kept == [0] + [len(IDS)] * (cfg.n_layers - 1)
    assert not torch.allclose(got, torch.cat(exact_run(tiny_loaded, IDS, 1), dim=1), atol=1e-4)


def test_a_placement_must_hold_every_group_once(tiny_loaded, src):
    cfg = tiny_loaded.cfg
    bad = [LayerPlace({"a": [0], "b": [0]}, "a", "a") for _ in range(cfg.n_layers)]
    with pytest.raises(ValueError, match="each of the 2 KV groups once"):
        HeadSplitPipeline.local(src, cfg, torch.float32, bad)


def watch_for(pipe: HeadSplitPipeline, cfg, hot: str) -> MemoryWatch:
    """A watch that finds `hot` past 85% as soon as it holds any cache, and re-places with the planner."""
    total = sum(d.memory_bytes() for d in pipe.devices.values())
    capacities = dict.fromkeys(pipe.devices, 10 * total)
    capacities[hot] = int(pipe.devices[hot].memory_bytes() / 0.85) + 1
    card = head_card(model_card(cfg, "tiny", torch.float32))

    def replan(slots: int) -> list[LayerPlace]:
        room = {name: int(0.85 * c) for name, c in capacities.items()}
        return place(profiled_devices(None, room), card, [0.0] * cfg.n_layers, lambda a, b: 0.0, slots)

    return MemoryWatch(capacities, replan, every=1)


def test_a_device_past_its_memory_threshold_moves_groups_with_their_caches(tiny_loaded, src):
    cfg = tiny_loaded.cfg
    start = [LayerPlace({"a": list(range(cfg.n_kv_heads))}, "a", "a") for _ in range(cfg.n_layers)]
    pipe = HeadSplitPipeline({"a": HeadBlocks(src, cfg, torch.float32, *blocks_of(start, "a")),
                              "b": HeadBlocks(src, cfg, torch.float32, {}, [])}, start, cfg)
    pipe.watch(watch_for(pipe, cfg, "a"))
    got = split_run(tiny_loaded, pipe, IDS, 6, 0.05)
    # the first check after the prompt found a past 85%: groups moved to b with their caches, and every output
    # since equals the model's (a cache left behind or misplaced would change them)
    assert pipe.replacements == 1 and pipe.layers != start
    moved = blocks_of(pipe.layers, "b")[0]
    assert moved and all(len(pipe.devices["b"].sessions["s"][layer].pool.k) == 1 for layer in moved)
    assert all(pipe.devices["b"].sessions["s"][layer].length == len(IDS) for layer in moved)
    for g, w in zip(got, exact_run(tiny_loaded, IDS, 6), strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown devices"):
        pipe.move_to([LayerPlace({"z": list(range(cfg.n_kv_heads))}, "z", "z") for _ in range(cfg.n_layers)])


def test_the_kv_budget_bounds_the_devices_caches_as_the_layer_pipeline_does(tiny_loaded, src):
    """HeadSplit's caches have the layer pipeline's bound: an open that would cross it gets a CapacityError
    naming the numbers (the API's 503, after the admission queue), and the sessions held stay intact."""
    cfg = tiny_loaded.cfg
    per_slot = cfg.kv_bytes_per_token()  # float32 keys and values of every layer
    pipe = HeadSplitPipeline.local(src, cfg, torch.float32, placements(cfg.n_layers, False)["2 devices"],
                                   kv_budget_bytes=100 * per_slot)
    pipe.open("a", 60)  # each device holds its share of the 60 slots, in a block of 64
    with pytest.raises(CapacityError, match="MiB more but only"):
        pipe.open("b", 60)
    assert "b" not in next(iter(pipe.devices.values())).sessions and pipe.kv_bytes() == 64 * per_slot
    pipe.release("a")
    pipe.open("b", 60)  # fits once the other is gone


def test_a_device_refuses_a_call_older_than_the_last_step_it_saw(tiny_loaded, src):
    """Step numbers fence a device's cache: the same step again (another layer, a recompute, a retry) is applied
    and gives the same bits; an older one, late or retried after a rollback, is refused before it writes."""
    cfg = tiny_loaded.cfg
    x, y = torch.randn(1, 1, cfg.hidden_size), torch.randn(1, 1, cfg.hidden_size)
    devices = [HeadBlocks(src, cfg, torch.float32, {0: list(range(cfg.n_kv_heads))}, []) for _ in range(2)]
    fenced, clean = devices
    for d in devices:
        d.open("s", 8)
    first = fenced.attend("s", 0, x, torch.tensor([[0]]), 0, None, step=3)
    assert torch.equal(fenced.attend("s", 0, x, torch.tensor([[0]]), 0, None, step=3), first)
    with pytest.raises(StepError, match=r"step 2 .* older than the last one here, 3"):
        fenced.attend("s", 0, y, torch.tensor([[0]]), 0, None, step=2)  # would overwrite slot 0 with y's entry
    clean.attend("s", 0, x, torch.tensor([[0]]), 0, None, step=1)
    nxt = [d.attend("s", 0, y, torch.tensor([[1]]), 1, None, step=4) for d in devices]  # reads slot 0
    assert torch.equal(nxt[0], nxt[1])
