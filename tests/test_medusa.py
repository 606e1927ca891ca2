"""Medusa on the tiny model (float32): tree layout, mask and positions on hand-built trees; a tree pass gives
every node the logits of its own path; greedy tokens identical to naive's for several trees; sampled
continuations follow the target's exactly enumerated distribution; typical acceptance is flagged as not
exact; heads that do not fit the model are refused."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch
from model_fixtures import chi_square_pvalue, continuation_table, make_medusa_heads, make_tiny_model, smollm2_folder
from processes import REPO, tiny_chat_model

from edgespec.decoding.medusa import MedusaPolicy
from edgespec.decoding.medusa_heads import MedusaModel
from edgespec.decoding.medusa_tree import Tree
from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.target_fit import SHIPPED
from edgespec.decoding.training.train_medusa import grow_tree
from edgespec.decoding.types import GenerationRequest, SamplingParams
from edgespec.engine.engine import Engine

PROMPT = [(i % 7) + 100 for i in range(30)]
WIDE = [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]]
CHAIN = [[0], [0, 0], [0, 0, 0]]


def generate(policy, loaded, prompt, max_tokens, options=None, stop=(), **sampling):
    request = GenerationRequest(prompt, max_tokens, SamplingParams(**{"temperature": 0.0, **sampling}), tuple(stop),
                                frozenset(), policy.name, options or {})

    async def collect():
        return [e async for e in policy.generate(request, Engine(loaded.executor), loaded.tokenizer)]

    events = asyncio.run(collect())
    return [t for e in events for t in e.token_ids], events[-1]


@pytest.fixture(scope="module")
def naive_tokens(tiny_loaded):
    return generate(NaivePolicy(), tiny_loaded, PROMPT, 40)[0]


@pytest.fixture(scope="module")
def heads(tiny, tiny_loaded, naive_tokens, tmp_path_factory):
    # a vocabulary of the tokens naive emits plus as many others: the random heads then hit now and then
    vocab = sorted(set(naive_tokens) | set(range(1000, 1000 + len(set(naive_tokens)))))
    path = make_medusa_heads(tiny, tmp_path_factory.mktemp("medusa") / "heads.safetensors", vocab, WIDE)
    return tiny_loaded.executor.thread.run_sync(MedusaModel.load, path, tiny_loaded.executor.ends)


def test_tree_layout_mask_and_positions():
    tree = Tree([[1], [0, 0], [0], [0, 1], [0, 0, 0]])  # any order: nodes go by depth, then rank
    assert tree.paths == [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    assert tree.parent == [-1, 0, 0, 1, 1, 3]
    assert tree.depths == [0, 1, 1, 2, 2, 3] and tree.depth == 3 and tree.top == 2
    assert tree.children == [[1, 2], [3, 4], [], [5], [], []]
    want = torch.tensor([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0],
                         [1, 1, 0, 0, 1, 0],
                         [1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    mask = tree.mask(4)
    assert mask.shape == (1, 6, 10) and mask[0, :, :4].all() and torch.equal(mask[0, :, 4:], want)
    assert tree.positions(4).tolist() == [[4, 5, 5, 6, 6, 7]]
    candidates = torch.tensor([[10, 11], [20, 21], [30, 31]])  # [K, top]
    assert tree.tokens(7, candidates) == [7, 10, 11, 20, 21, 30]
    assert len(Tree([])) == 1 and Tree([]).top == 0  # the root alone


@pytest.mark.parametrize("paths", [[[0, 0]], [[0], [0]], [[-1]], [[0], []], "0", [[0.5]]])
def test_bad_trees_are_refused(paths):
    with pytest.raises(ValueError):
        Tree(paths)


def test_grown_tree_takes_the_likeliest_paths():
    shares = {(0,): 0.5, (1,): 0.2, (2,): 0.05, (0, 0): 0.3, (0, 1): 0.1, (1, 0): 0.1, (0, 0, 0): 0.15}
    grown = grow_tree(lambda p: shares.get(tuple(p), 0.0), 5)
    assert [p for p, _ in grown] == [[0], [0, 0], [1], [0, 0, 0], [0, 1]]


def test_a_tree_pass_gives_each_node_its_paths_logits(tiny_loaded):
    executor = tiny_loaded.executor
    tree = Tree(WIDE)
    node_tokens = [5, *range(200, 200 + len(WIDE))]

    async def passes():
        session = await executor.open_own(64)
        try:
            await executor.forward(session, torch.tensor([PROMPT]))
            start = len(PROMPT)
            got = await executor.forward(session, torch.tensor([node_tokens]), start, tree.positions(start),
                                         tree.mask(start))
            want = []
            for node in range(len(tree)):
                seq = [node_tokens[n] for n in tree.ancestors[node]]
                executor.truncate(session, start)
                want.append((await executor.forward(session, torch.tensor([seq]), start))[0, -1])
            return got[0], torch.stack(want)
        finally:
            await executor.release_own(session)

    got, want = asyncio.run(passes())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("paths", [None, WIDE, CHAIN, [[0]], [], "step_tokens"])
def test_greedy_equals_naive(tiny_loaded, heads, naive_tokens, paths):
    # step_tokens: each step's tree is a prefix of the tree, sized by the sequences in the step
    options = {} if paths is None else {"step_tokens": 3, "tree": WIDE} if paths == "step_tokens" else {"tree": paths}
    got, last = generate(MedusaPolicy(heads), tiny_loaded, PROMPT, 40, options)
    assert got == naive_tokens
    st = last.stats
    assert st["policy"] == "medusa" and st["exact"] is True
    assert sum(st["accepted_length_histogram"].values()) == st["steps"]
    if paths != []:
        assert st["tokens_per_step"] > 1  # candidates were accepted, so compaction was exercised


def test_stop_and_max_tokens_inside_an_accepted_path(tiny_loaded, heads, naive_tokens):
    for n in (1, 2, 5, 17):
        got, last = generate(MedusaPolicy(heads), tiny_loaded, PROMPT, n, {"tree": WIDE})
        assert got == naive_tokens[:n] and last.finish_reason == "length"


def test_sampled_continuations_follow_the_target_distribution(tiny, tiny_loaded, tmp_path):
    # three-token continuations at temperature 0.8, top_k 3: 27 outcomes, enumerated exactly from the target;
    # the heads propose only the ids of that support, so the third token often comes from a tree node
    params = {"temperature": 0.8, "top_k": 3}
    executor = tiny_loaded.executor
    table = continuation_table(executor, PROMPT, params, 3)
    vocab = sorted({t for key in table for t in key})
    path = make_medusa_heads(tiny, tmp_path / "support.safetensors", vocab, [[0], [1], [2], [0, 0], [1, 0]], seed=3)
    policy = MedusaPolicy(executor.thread.run_sync(MedusaModel.load, path, executor.ends))
    n = 1500
    counts = {key: 0 for key in table}
    accepted = 0
    for seed in range(n):
        ids, last = generate(policy, tiny_loaded, PROMPT, 3, seed=seed, **params)
        assert tuple(ids) in counts  # nothing outside the target's support
        counts[tuple(ids)] += 1
        accepted += sum(int(k) * v for k, v in last.stats["accepted_length_histogram"].items())
    assert accepted > n / 4  # tree nodes did produce tokens
    assert chi_square_pvalue(counts, table) > 1e-3


def test_typical_acceptance_is_flagged_and_greedy_at_temperature_zero(tiny_loaded, heads, naive_tokens):
    policy = MedusaPolicy(heads)
    got, last = generate(policy, tiny_loaded, PROMPT, 40, {"acceptance": "typical"})
    assert got == naive_tokens and last.stats["exact"] is True  # at temperature 0 it is greedy
    got, last = generate(policy, tiny_loaded, PROMPT, 40, {"acceptance": "typical", "posterior_threshold": 0.2},
                         temperature=0.7, seed=1)
    assert len(got) == 40 and last.stats["exact"] is False


def test_bad_options_and_missing_heads_are_refused(heads):
    policy = MedusaPolicy(heads)
    for options in ({"tree": [[0, 0]]}, {"tree": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]},
                    {"acceptance": "fast"}, {"posterior_alpha": 0}, {"step_tokens": 0}, {"step_tokens": True}):
        with pytest.raises(ValueError):
            policy.check(options)
    policy.check({"tree": CHAIN, "acceptance": "typical"})
    with pytest.raises(ValueError, match="--medusa"):
        MedusaPolicy(None).check({})


def test_heads_for_another_model_are_refused(tiny, tiny_loaded, tmp_path):
    other = tiny_chat_model(tmp_path / "other", smollm2_folder())
    make_tiny_model(other, seed=9, vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    path = make_medusa_heads(other, tmp_path / "other.safetensors", [1, 2, 3], [[0]])
    with pytest.raises(ValueError, match="another model"):
        MedusaModel.load(path, tiny_loaded.executor.ends)
    deep = make_medusa_heads(tiny, tmp_path / "deep.safetensors", [1, 2, 3], [[0], [0, 0], [0, 0, 0]], n_heads=2)
    with pytest.raises(ValueError, match="3 deep"):
        MedusaModel.load(deep, tiny_loaded.executor.ends)
    shipped = sorted(SHIPPED.glob("*-medusa.safetensors"))
    assert shipped, "the trained heads for SmolLM2 ship with the package"
    with pytest.raises(ValueError, match="hidden size 576"):
        MedusaModel.load(shipped[0], tiny_loaded.executor.ends)
    run = subprocess.run([sys.executable, "-m", "edgespec.server.cli", "serve", "--model", str(tiny), "--port", "0",
                          "--medusa", str(path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "trained for another model" in run.stderr
