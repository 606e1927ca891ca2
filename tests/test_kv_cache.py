"""KV cache operations on the tiny model in float32: every cached result equals a recompute from scratch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from model_fixtures import load_blocks, make_tiny_model

from edgespec.model.kv_cache import KVCache, KVCacheError
from edgespec.model.kv_format import FLOAT32
from edgespec.model.kv_pool import BLOCK_SLOTS, CapacityError, KVPool
from edgespec.model.stage import LocalStage, Pipeline, SessionError

TOL = 1e-5
B = BLOCK_SLOTS  # the tests count in the pool's blocks


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


def stage_run(blocks, stage, session, part, start):
    hidden = blocks.ends.embed_tokens(torch.tensor([part]))
    return blocks.ends.logits(stage.forward(session, hidden, torch.arange(start, start + len(part))[None], start))


def test_forks_share_the_prefix_blocks(blocks):
    """Three forks of a prompt read its blocks in place: only their own slots take blocks, the one block the
    prompt fills part of is copied on each fork's first write, and the parent is left intact."""
    stage = LocalStage(blocks.stack, kv_budget_bytes=2**24)
    pool, n = stage.pool, B + 5  # the prompt: one full block and 5 slots of a second
    prefix = tokens(n, 15)
    stage.open("p", n + 8)
    stage_run(blocks, stage, "p", prefix, 0)
    assert pool.used == 2
    conts = [tokens(4, 16 + i) for i in range(3)]
    for i, cont in enumerate(conts):
        stage.fork("p", f"c{i}", n, n + 6)
        assert pool.used == 2 + i  # the fork holds the parent's blocks; the previous one copied the partial one
        got = stage_run(blocks, stage, f"c{i}", cont, n)[0]
        assert close(got, blocks.logits_from_scratch(prefix + cont)[n:])
        assert pool.refs[stage.caches[f"c{i}"].table[0]] == 2 + i  # the full block is shared, never copied
    assert pool.used == 2 + 3
    tail = tokens(2, 20)  # the parent continues its own sequence over its own partial block
    assert close(stage_run(blocks, stage, "p", tail, n)[0], blocks.logits_from_scratch(prefix + tail)[n:])
    stage.release("p")  # the parent may go first: the forks keep the blocks they share
    last = tokens(1, 21)
    got = stage_run(blocks, stage, "c0", last, n + 4)[0, -1]
    assert close(got, blocks.logits_from_scratch(prefix + conts[0] + last)[-1])
    for i in range(3):
        stage.release(f"c{i}")
    assert pool.used == 0 and pool.reserved == 0 and pool.available == pool.n_blocks


def test_fork_of_a_shorter_prefix_and_of_a_fork(blocks):
    seq = tokens(14, 22)
    parent = KVCache(blocks.stack.new_pool(2**22), 14)
    blocks.forward(seq, parent, 0)
    child = parent.fork(8, capacity=12)  # shares only the first 8 slots
    cont = tokens(3, 23)
    assert close(blocks.forward(cont, child, 8)[0], blocks.logits_from_scratch(seq[:8] + cont)[8:])
    grandchild = child.fork(10, capacity=12)  # seq[:8] + cont[:2]
    tail = tokens(2, 25)
    want = blocks.logits_from_scratch(seq[:8] + cont[:2] + tail)[10:]
    assert close(blocks.forward(tail, grandchild, 10)[0], want)
    assert close(blocks.forward(seq[8:], parent, 8)[0], blocks.logits_from_scratch(seq)[8:])  # parent intact


def test_fork_bounds(blocks):
    parent = KVCache(blocks.stack.new_pool(2**22), 8)
    blocks.forward(tokens(5, 26), parent, 0)
    with pytest.raises(KVCacheError):
        parent.fork(6, capacity=10)  # longer than the parent holds
    with pytest.raises(KVCacheError):
        parent.fork(5, capacity=4)  # capacity below the shared prefix


def test_interleaved_blocks_give_the_bits_of_a_cache_alone(blocks):
    """Two sessions decoding in turn take alternate blocks of the pool: each one's logits are bitwise those of
    its sequence in a cache of its own (a wrong slot-to-block mapping would read the other's entries)."""
    stage = LocalStage(blocks.stack, kv_budget_bytes=2**24)
    n, step = 2 * B + 8, 8  # three blocks each, fed 8 tokens a turn
    seqs = {s: tokens(n, 50 + i) for i, s in enumerate("ab")}
    for s in seqs:
        stage.open(s, n)
    got = {s: [] for s in seqs}
    for i in range(0, n, step):
        for s, seq in seqs.items():
            got[s].append(stage_run(blocks, stage, s, seq[i:i + step], i)[0])
    a, b = stage.caches["a"].table, stage.caches["b"].table
    assert not set(a) & set(b) and sorted(a + b) == list(range(6)) and a != [0, 1, 2]  # interleaved
    for s, seq in seqs.items():
        alone = blocks.new_cache(n)
        want = torch.cat([blocks.forward(seq[i:i + step], alone, i)[0] for i in range(0, n, step)])
        assert torch.equal(torch.cat(got[s]), want)


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


def test_a_cache_holds_one_sequence(blocks):
    cache = blocks.new_cache(8)
    with pytest.raises(ValueError, match="one sequence"):
        blocks.forward(torch.zeros(3, 2, dtype=torch.long), cache, 0)
    assert cache.length == 0


def test_failed_write_leaves_the_cache_unchanged(blocks):
    seq = tokens(6, 35)
    cache = blocks.new_cache(8)
    blocks.forward(seq, cache, 0)
    before = [cache.read(layer, 6) for layer in range(blocks.cfg.n_layers)]
    with pytest.raises(KVCacheError):
        blocks.forward(tokens(4, 36), cache, 6)
    assert all(torch.equal(k, k0) and torch.equal(v, v0)
               for (k, v), (k0, v0) in zip((cache.read(la, 6) for la in range(blocks.cfg.n_layers)), before,
                                           strict=True))


def test_pool_layout_reservations_and_references():
    pool = KVPool(n_layers=3, n_kv=2, head_dim=16, fmt=FLOAT32, n_blocks=5, block=4)
    assert len(pool.k) == len(pool.v) == 3 and all(t.shape == (5, 2, 4, 16) for t in pool.k + pool.v)
    assert pool.block_bytes == 2 * 3 * 2 * 4 * 16 * 4 and pool.nbytes == 5 * pool.block_bytes
    cache = KVCache(pool, capacity=10)  # 3 blocks promised, none taken
    assert (pool.used, pool.reserved, pool.available) == (0, 3, 2)
    cache.ensure(0, 6)
    assert cache.table == [0, 1] and (pool.used, pool.reserved, pool.available) == (2, 1, 2)
    cache.length = 6
    child = cache.fork(6, capacity=8)  # shares blocks 0 and 1; may copy block 1 (its partial one)
    assert child.table == [0, 1] and pool.refs[:2] == [2, 2] and pool.reserved == 2
    with pytest.raises(CapacityError, match=r"needs 3 blocks .* only 1 of 5"):
        KVCache(pool, capacity=9)  # 3 blocks: only 1 is neither used nor reserved
    child.ensure(6, 8)  # its write into the shared partial block copies it
    assert child.table == [0, 2] and pool.refs[:3] == [2, 1, 1]
    cache.free()
    assert pool.refs[:3] == [1, 0, 1] and pool.used == 2 and pool.reserved == 0
    child.free()
    assert pool.used == 0 and pool.available == 5


RESIDENT = """
from edgespec.model.kv_format import FLOAT32
from edgespec.model.kv_pool import KVPool
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
before = rss()
pool = KVPool(n_layers=2, n_kv=4, head_dim=64, fmt=FLOAT32, n_blocks=16, block=1024, prefault={})
print((rss() - before) / pool.nbytes)
"""


@pytest.mark.parametrize("prefault", [False, True])
def test_a_prefaulted_pool_is_resident_from_the_start(prefault):
    # 2 layers x 2 (k, v) x 16 blocks x 1 MiB: 64 MiB; lazily, no page is committed until a block is written. In
    # a process of its own: in this one, the allocator may hand out pages that earlier tests left resident.
    out = subprocess.run([sys.executable, "-c", RESIDENT.format(prefault)], capture_output=True, text=True, check=True)
    share = float(out.stdout)
    assert share > 0.9 if prefault else share < 0.1


# --- LocalStage memory bound ----------------------------------------------------------------------------


def test_local_stage_budget_is_its_pool(blocks):
    """A session reserves its capacity's blocks at its open: what does not fit is refused then, naming the
    numbers, and a session that opened never fails a write for room."""
    cfg = blocks.cfg
    per_block = B * cfg.kv_bytes_per_token(cfg.n_layers, FLOAT32)
    stage = LocalStage(blocks.stack, kv_budget_bytes=6 * per_block + 100)  # 6 blocks
    assert stage.pool.n_blocks == 6
    stage.open("a", 3 * B - 8)  # 3 blocks promised
    assert stage.kv_bytes() == 0 and stage.pool_blocks() == (0, 3)
    stage_run(blocks, stage, "a", tokens(B + 5, 40), 0)
    assert stage.kv_bytes() == 2 * per_block and stage.pool_blocks() == (2, 3)  # what it holds
    with pytest.raises(CapacityError) as info:
        stage.open("b", 4 * B)
    msg, mib = str(info.value), per_block / 2**20
    assert f"needs 4 blocks ({4 * mib:.1f} MiB) more but only 3 of 6 ({3 * mib:.1f} of {6 * mib:.1f} MiB)" in msg
    assert "b" not in stage.caches
    stage_run(blocks, stage, "a", tokens(2 * B - 13, 41), B + 5)  # a runs to its whole capacity within its promise
    stage.fork("a", "f", prefix_len=3 * B - 8, capacity=3 * B + 8)  # 2 full blocks shared: 2 more promised
    assert stage.pool_blocks() == (3, 1)
    for s in ("a", "f", "never-opened"):  # unknown sessions are ignored
        stage.release(s)
    assert stage.pool_blocks() == (0, 6)
    stage.open("b", 4 * B)  # fits once the others are gone


def test_a_write_ends_the_cache_so_a_rejected_draft_needs_no_truncate(blocks):
    """The executor truncates without calling a stage (Executor.truncate): a forward written over a rejected
    draft's slots, and the steps after it, give the bits of a cache that never held the draft."""
    stage = LocalStage(blocks.stack, kv_budget_bytes=2**24)
    ids = tokens(14, 5)

    def run(session, part, start):
        return stage_run(blocks, stage, session, part, start)

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


