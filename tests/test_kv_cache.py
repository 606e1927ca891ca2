"""KV cache operations on the tiny model in float32: every cached result equals a recompute from scratch."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import load_blocks, make_tiny_model

from edgespec.model.kv_cache import KVCache, KVCacheError
from edgespec.model.stage import CapacityError, LocalStage, Pipeline, SessionError

TOL = 1e-5


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    return load_blocks(make_tiny_model(tmp_path_factory.mktemp("tiny-kv")))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() < TOL


# --- truncate -----------------------------------------------------------------------------------------


def test_truncate_then_reappend_equals_recompute(blocks):
    prefix, rejected, accepted = tokens(10, 1), tokens(6, 2), tokens(5, 3)
    cache = blocks.new_cache(32)
    blocks.forward(prefix, cache, 0)
    blocks.forward(rejected, cache, 10)  # a draft that is rejected ...
    assert cache.length == 16
    cache.truncate(10)  # ... and rolled back
    assert cache.length == 10
    got = blocks.forward(accepted, cache, 10)[0]
    want = blocks.logits_from_scratch(prefix + accepted)[10:]
    assert close(got, want)
    # and decoding one token at a time continues correctly from there
    nxt = tokens(3, 4)
    steps = torch.cat([blocks.forward([t], cache, cache.length)[0] for t in nxt])
    assert close(steps, blocks.logits_from_scratch(prefix + accepted + nxt)[15:])


def test_truncate_to_shorter_than_written_then_one_token(blocks):
    seq = tokens(12, 5)
    cache = blocks.new_cache(12)
    blocks.forward(seq, cache, 0)
    cache.truncate(4)
    other = tokens(1, 6)
    got = blocks.forward(other, cache, 4)[0, -1]
    assert close(got, blocks.logits_from_scratch(seq[:4] + other)[-1])


def test_truncate_bounds(blocks):
    cache = blocks.new_cache(16)
    blocks.forward(tokens(5, 7), cache, 0)
    with pytest.raises(KVCacheError):
        cache.truncate(6)  # longer than what is cached
    with pytest.raises(KVCacheError):
        cache.truncate(-1)
    cache.truncate(5)
    cache.truncate(0)
    assert cache.length == 0


# --- commit (Medusa tree) ----------------------------------------------------------------------------


def test_commit_moves_kept_slots_into_place(blocks):
    prefix = tokens(9, 8)
    big_l = len(prefix)
    a, x, b = tokens(3, 9)
    cache = blocks.new_cache(big_l + 4)
    blocks.forward(prefix, cache, 0)
    # tree: a at slot L; two alternatives after it, x (slot L+1) and b (slot L+2), both at position L+1
    mask = torch.ones(1, 3, big_l + 3, dtype=torch.bool)
    mask[0, 0, big_l + 1 :] = False  # a sees the prefix and itself
    mask[0, 1, big_l + 2] = False  # x sees prefix, a, x
    mask[0, 2, big_l + 1] = False  # b sees prefix, a, b (not x)
    positions = torch.tensor([[big_l, big_l + 1, big_l + 1]])
    tree = blocks.forward([a, x, b], cache, big_l, positions=positions, mask=mask)[0]
    assert close(tree[[0, 1]], blocks.logits_from_scratch([*prefix, a, x])[big_l:])
    assert close(tree[2], blocks.logits_from_scratch([*prefix, a, b])[-1])

    cache.commit([big_l, big_l + 2], big_l)  # accept a, b
    assert cache.length == big_l + 2
    c = tokens(1, 10)
    got = blocks.forward(c, cache, big_l + 2)[0, -1]
    assert close(got, blocks.logits_from_scratch([*prefix, a, b, *c])[-1])


def test_commit_of_a_later_slot_only(blocks):
    """Keep only the second of two siblings: its KV moves one slot left."""
    prefix = tokens(6, 11)
    y, z = tokens(2, 12)
    cache = blocks.new_cache(10)
    blocks.forward(prefix, cache, 0)
    mask = torch.ones(1, 2, 8, dtype=torch.bool)
    mask[0, 0, 7] = False
    mask[0, 1, 6] = False  # y and z are alternatives for position 6
    blocks.forward([y, z], cache, 6, positions=[6, 6], mask=mask)
    cache.commit([7], 6)
    assert cache.length == 7
    c = tokens(2, 13)
    got = blocks.forward(c, cache, 7)[0]
    assert close(got, blocks.logits_from_scratch([*prefix, z, *c])[7:])


def test_commit_rejects_bad_slots(blocks):
    cache = blocks.new_cache(16)
    blocks.forward(tokens(8, 14), cache, 0)
    for kept, dest in [([6, 5], 4), ([3, 6], 4), ([5, 8], 4)]:  # not ascending, below dest, not cached
        with pytest.raises(KVCacheError):
            cache.commit(kept, dest)
    assert cache.length == 8


# --- fork ---------------------------------------------------------------------------------------------


def test_fork_rows_share_the_prefix(blocks):
    prefix = tokens(11, 15)
    parent = blocks.new_cache(11)
    blocks.forward(prefix, parent, 0)
    child = parent.fork(11, rows=3, capacity=11 + 6)
    assert child.length == 11 and child.rows == 3
    assert child.nbytes == parent.nbytes * 3 * 6 // 11  # the prefix is not copied
    conts = [tokens(4, 16 + i) for i in range(3)]
    got = blocks.forward(torch.tensor(conts), child, 11)  # [3, 4, V]
    for row, cont in enumerate(conts):
        assert close(got[row], blocks.logits_from_scratch(prefix + cont)[11:])
    # one more token per row, one step
    last = tokens(3, 20)
    step = blocks.forward(torch.tensor(last).unsqueeze(1), child, 15)  # [3, 1, V]
    for row, cont in enumerate(conts):
        assert close(step[row, 0], blocks.logits_from_scratch([*prefix, *cont, last[row]])[-1])
    # the parent is untouched: it still continues its own sequence
    tail = tokens(1, 21)
    more = blocks.new_cache(12)
    blocks.forward(prefix, more, 0)
    parent2 = parent.fork(11, rows=1, capacity=12)
    assert close(blocks.forward(tail, parent2, 11)[0], blocks.forward(tail, more, 11)[0])


def test_fork_of_a_shorter_prefix_and_of_a_fork(blocks):
    seq = tokens(14, 22)
    parent = blocks.new_cache(14)
    blocks.forward(seq, parent, 0)
    child = parent.fork(8, rows=2, capacity=12)  # shares only the first 8 slots
    conts = [tokens(3, 23), tokens(3, 24)]
    got = blocks.forward(torch.tensor(conts), child, 8)
    for row, cont in enumerate(conts):
        assert close(got[row], blocks.logits_from_scratch(seq[:8] + cont)[8:])
    grandchild = child.fork(10, rows=2, capacity=12)  # row 0 of the child: seq[:8] + conts[0][:2]
    tail = tokens(2, 25)
    got = blocks.forward(torch.tensor([tail, tail]), grandchild, 10)
    want = blocks.logits_from_scratch(seq[:8] + conts[0][:2] + tail)[10:]
    assert close(got[0], want) and close(got[1], want)


def test_fork_bounds(blocks):
    parent = blocks.new_cache(8)
    blocks.forward(tokens(5, 26), parent, 0)
    with pytest.raises(KVCacheError):
        parent.fork(6, rows=2, capacity=10)  # longer than the parent holds
    with pytest.raises(KVCacheError):
        parent.fork(5, rows=2, capacity=4)  # capacity below the shared prefix
    child = parent.fork(5, rows=2, capacity=8)
    with pytest.raises(KVCacheError):
        child.truncate(4)  # into the shared prefix
    with pytest.raises(KVCacheError):
        blocks.forward(torch.zeros(2, 1, dtype=torch.long), child, 4)  # a write into the shared prefix
    blocks.forward(torch.zeros(2, 2, dtype=torch.long), child, 5)
    with pytest.raises(KVCacheError):
        child.commit([6], 4)  # into the shared prefix


# --- capacity errors ------------------------------------------------------------------------------------


def test_write_past_capacity(blocks):
    cache = blocks.new_cache(8)
    with pytest.raises(KVCacheError, match=r"9 slots needed.*holds 8"):
        blocks.forward(tokens(9, 27), cache, 0)
    assert cache.length == 0
    blocks.forward(tokens(6, 28), cache, 0)
    with pytest.raises(KVCacheError):
        blocks.forward(tokens(3, 29), cache, 6)
    blocks.forward(tokens(2, 30), cache, 6)  # exactly full
    with pytest.raises(KVCacheError):
        blocks.forward(tokens(1, 31), cache, 8)
    assert cache.length == 8


def test_write_with_a_gap(blocks):
    cache = blocks.new_cache(16)
    blocks.forward(tokens(4, 32), cache, 0)
    with pytest.raises(KVCacheError, match="no gaps"):
        blocks.forward(tokens(2, 33), cache, 5)
    assert cache.length == 4
    blocks.forward(tokens(2, 33), cache, 2)  # overwriting cached slots is allowed
    assert cache.length == 4


def test_write_with_wrong_rows(blocks):
    cache = blocks.new_cache(8, rows=2)
    with pytest.raises(KVCacheError, match="1 rows"):
        blocks.forward(tokens(3, 34), cache, 0)
    with pytest.raises(KVCacheError, match="3 rows"):
        blocks.forward(torch.zeros(3, 2, dtype=torch.long), cache, 0)
    assert cache.length == 0


def test_failed_write_leaves_the_cache_unchanged(blocks):
    seq = tokens(6, 35)
    cache = blocks.new_cache(8)
    blocks.forward(seq, cache, 0)
    before = (torch.stack(cache.k), torch.stack(cache.v))
    with pytest.raises(KVCacheError):
        blocks.forward(tokens(4, 36), cache, 6)
    assert torch.equal(torch.stack(cache.k), before[0]) and torch.equal(torch.stack(cache.v), before[1])


def test_cache_layout_and_bytes():
    cache = KVCache(n_layers=3, n_kv=2, head_dim=16, capacity=10, dtype=torch.float32, rows=2)
    assert len(cache.k) == len(cache.v) == 3
    assert all(t.shape == (2, 2, 10, 16) for t in cache.k + cache.v)
    assert cache.nbytes == 2 * 3 * 2 * 2 * 10 * 16 * 4
    assert cache.length == 0


def test_cache_grows_on_demand_and_keeps_its_contents(blocks):
    seq = tokens(20, 38)
    grown = blocks.new_cache(64, initial=4)
    assert grown.allocated == 4
    assert grown.growth_bytes(6) == (8 - 4) * blocks.cfg.kv_bytes_per_token(dtype=torch.float32)  # doubles
    logits_grown = torch.cat([blocks.forward(seq[:3], grown, 0), blocks.forward(seq[3:7], grown, 3),
                              blocks.forward(seq[7:], grown, 7)], dim=1)
    assert grown.allocated == 20  # grew past the doubling when one write needed more
    full = blocks.new_cache(64)
    logits_full = blocks.forward(seq, full, 0)
    assert torch.allclose(logits_grown, logits_full, atol=1e-5)
    assert blocks.new_cache(64, initial=4).growth_bytes(4) == 0
    with pytest.raises(KVCacheError, match="64"):
        blocks.forward(tokens(50, 39), grown, 20)  # still bounded by the capacity


# --- LocalStage memory bound ----------------------------------------------------------------------------


def test_local_stage_budget(blocks, monkeypatch):
    cfg = blocks.cfg
    per_token = cfg.kv_bytes_per_token(cfg.n_layers, torch.float32)
    assert per_token == 2 * 3 * 2 * 16 * 4
    monkeypatch.setattr(LocalStage, "INITIAL_SLOTS", 16)
    stage = LocalStage(blocks.stack, kv_budget_bytes=90 * per_token)
    stage.open("a", 200)  # a large capacity costs only the initial slots
    assert stage.kv_bytes() == 16 * per_token

    def run(session, n, start=0, seed=40):
        hidden = blocks.ends.embed_tokens(torch.tensor([tokens(n, seed)]))
        return stage.forward(session, hidden, torch.arange(start, start + n).unsqueeze(0), start)

    run("a", 60)  # grows to what it holds
    assert stage.kv_bytes() == 60 * per_token
    stage.open("b", 200)
    run("b", 10)
    with pytest.raises(CapacityError) as info:
        run("b", 30, start=10)  # b would grow from 16 to 40 slots: 60 + 40 > 90
    msg = str(info.value)
    mib = per_token / 2**20
    assert f"needs {24 * mib:.1f} MiB more" in msg and f"of {90 * mib:.1f} MiB" in msg, msg
    assert stage.caches["b"].length == 10 and stage.kv_bytes() == 76 * per_token  # b intact
    with pytest.raises(CapacityError):
        stage.open("c", 200)  # its initial slots no longer fit either
    assert "c" not in stage.caches
    stage.release("b")
    # a fork pays only for its own slots
    stage.fork("a", "f", prefix_len=60, capacity=60 + 10)
    assert stage.kv_bytes() == (60 + 10) * per_token
    for s in ("a", "f", "never-opened"):  # unknown sessions are ignored
        stage.release(s)
    assert stage.kv_bytes() == 0
    stage.open("c", 200)  # fits once the others are gone


def test_a_write_ends_the_cache_so_a_rejected_draft_needs_no_truncate(blocks):
    """The runner truncates without calling a stage (ModelRunner.truncate): a forward written over a rejected
    draft's slots, and the steps after it, give the bits of a cache that never held the draft."""
    stage = LocalStage(blocks.stack, kv_budget_bytes=2**30)
    ids = tokens(14, 5)

    def run(session, part, start):
        hidden = blocks.ends.embed_tokens(torch.tensor([part]))
        return stage.forward(session, hidden, torch.arange(start, start + len(part)).unsqueeze(0), start)

    for s in ("drafted", "clean"):
        stage.open(s, 32)
        run(s, ids[:10], 0)
    run("drafted", tokens(4, 9), 10)  # a draft of 4, all rejected: slots 10..13 hold it
    assert stage.caches["drafted"].length == 14
    assert torch.equal(run("drafted", ids[10:12], 10), run("clean", ids[10:12], 10))  # over the draft's slots
    assert stage.caches["drafted"].length == 12  # the write ended the cache
    assert torch.equal(run("drafted", ids[12:14], 12), run("clean", ids[12:14], 12))


def test_local_stage_sessions(blocks):
    stage = LocalStage(blocks.stack, kv_budget_bytes=2**20)
    stage.open("s", 8)
    with pytest.raises(KVCacheError):
        stage.open("s", 8)  # already open
    with pytest.raises(SessionError, match="unknown session 'nope'"):
        stage.commit("nope", [0], 0)
    pipe = Pipeline([stage])
    pipe.open("t", 4)
    assert set(stage.caches) == {"s", "t"}
    pipe.release("t")
    assert set(stage.caches) == {"s"}


