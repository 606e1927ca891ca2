"""Batched expansion on the tiny model (float32): rows with suffixes of different lengths after one shared
prefix give each row exactly the greedy tokens it gets alone, finished rows retire, and so it stays when each
pass also verifies candidates (Medusa trees, n-gram chains) for the rows."""

from __future__ import annotations

import asyncio

import pytest
import torch
from model_fixtures import make_medusa_heads

from edgespec.decoding.medusa_heads import MedusaModel
from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.outline_batch import expand
from edgespec.decoding.outline_verify import MedusaRows, NgramRows
from edgespec.decoding.sampling import Sampler
from edgespec.decoding.stats import StepStats
from edgespec.decoding.types import GenerationRequest, SamplingParams

PREFIX = [(i % 11) + 200 for i in range(40)]
SUFFIXES = [[300, 301, 302], [310, 311, 312, 313, 314, 315, 316], [320], [330, 331, 332, 333, 334]]
BUDGETS = [10, 4, 12, 7]
WIDE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def alone(loaded, prompt: list[int], n: int) -> list[int]:
    request = GenerationRequest(prompt, n, SamplingParams(temperature=0.0))

    async def run():
        return [t async for e in NaivePolicy().generate(request, loaded.runner, loaded.tokenizer) for t in e.token_ids]

    return asyncio.run(run())


class Recording(Sampler):
    """Greedy, keeping the logits every choice saw (to compare with the row computed alone)."""

    def __init__(self, vocab: int):
        super().__init__(SamplingParams(temperature=0.0), vocab)
        self.seen: list[torch.Tensor] = []

    def choose(self, logits):
        self.seen.append(logits.clone())
        return super().choose(logits)


def plain_logits(runner, seq: list[int]) -> torch.Tensor:
    """[len(seq), V] logits of seq computed in one plain pass."""
    async def run():
        session = await runner.open(len(seq))
        try:
            return (await runner.forward(session, torch.tensor([seq])))[0]
        finally:
            await runner.release(session)

    return asyncio.run(run())


def batched(loaded, suffixes, budgets, stop=frozenset(), proposer=None, stats=None, samplers=None):
    samplers = samplers or [Sampler(SamplingParams(temperature=0.0), loaded.cfg.vocab_size) for _ in suffixes]
    steps = []

    async def run():
        async for step in expand(loaded.runner, PREFIX, suffixes, budgets, samplers, stop, proposer, stats):
            steps.append(step)

    asyncio.run(run())
    return steps, {row: [t for step in steps for r, ts, _ in step if r == row for t in ts]
                   for row in range(len(suffixes))}


def test_batched_rows_equal_each_row_alone_and_retire(tiny_loaded):
    samplers = [Recording(tiny_loaded.cfg.vocab_size) for _ in SUFFIXES]
    steps, got = batched(tiny_loaded, SUFFIXES, BUDGETS, samplers=samplers)
    for row, (suffix, budget) in enumerate(zip(SUFFIXES, BUDGETS, strict=True)):
        assert got[row] == alone(tiny_loaded, PREFIX + suffix, budget), row
        # the logits too (greedy tokens of a tiny random model barely depend on positions)
        want = plain_logits(tiny_loaded.runner, PREFIX + suffix + got[row][:-1])[-budget:]
        torch.testing.assert_close(torch.stack(samplers[row].seen), want, atol=1e-4, rtol=1e-4)
    assert [len(s) for s in steps] == [4] * 4 + [3] * 3 + [2] * 3 + [1] * 2  # rows leave as they finish
    assert all(len(ts) == 1 for step in steps for _, ts, _ in step)


def test_a_stop_token_retires_its_row(tiny_loaded):
    first = alone(tiny_loaded, PREFIX + SUFFIXES[0], 3)
    steps, got = batched(tiny_loaded, SUFFIXES[:2], [8, 8], frozenset({first[1]}))
    assert got[0] == first[:2] or first[0] == first[1]  # ends at the stop token (inclusive)
    assert torch.tensor([len(s) for s in steps]).le(2).all()


@pytest.fixture(scope="module")
def heads(tiny, tiny_loaded, tmp_path_factory):
    # a vocabulary of the tokens the rows emit plus as many others: the random heads then hit now and then
    made = {t for s, b in zip(SUFFIXES, BUDGETS, strict=True) for t in alone(tiny_loaded, PREFIX + s, b + 8)}
    vocab = sorted(made | set(range(1000, 1000 + len(made))))
    path = make_medusa_heads(tiny, tmp_path_factory.mktemp("medusa") / "heads.safetensors", vocab, WIDE)
    return tiny_loaded.runner.thread.run_sync(MedusaModel.load, path, tiny_loaded.runner.ends)


@pytest.mark.parametrize("kind, pass_tokens", [("medusa", 8), ("medusa", 64), ("ngram", 8), ("ngram", 64)])
def test_verified_rows_equal_each_row_alone(tiny_loaded, heads, kind, pass_tokens):
    budgets = [b + 8 for b in BUDGETS]
    proposer = (MedusaRows(heads, heads.tree, pass_tokens) if kind == "medusa"
                else NgramRows(len(SUFFIXES), 4, pass_tokens))
    stats = StepStats("test")
    samplers = [Recording(tiny_loaded.cfg.vocab_size) for _ in SUFFIXES]
    steps, got = batched(tiny_loaded, SUFFIXES, budgets, proposer=proposer, stats=stats, samplers=samplers)
    for row, (suffix, budget) in enumerate(zip(SUFFIXES, budgets, strict=True)):
        assert got[row] == alone(tiny_loaded, PREFIX + suffix, budget), row
        # every token was drawn from the logits of its own sequence: rejected nodes stay hidden from the row
        want = plain_logits(tiny_loaded.runner, PREFIX + suffix + got[row][:-1])[-budget:]
        torch.testing.assert_close(torch.stack(samplers[row].seen[:budget]), want, atol=1e-4, rtol=1e-4)
    assert stats.proposed > 0 and stats.accepted > 0  # candidates were kept, so the masks were exercised
    assert any(len(ts) > 1 for step in steps for _, ts, _ in step)


@pytest.mark.slow
def test_verified_rows_sample_each_rows_own_distribution(tiny, tiny_loaded, tmp_path):
    # temperature 0.8, top_k 3: every row's 3-token continuations follow the target's exactly enumerated
    # distribution for that row, though tree nodes supply many of the tokens (a rule that took a candidate
    # without drawing would skew them)
    from model_fixtures import chi_square_pvalue, continuation_table

    params = {"temperature": 0.8, "top_k": 3}
    runner, suffixes = tiny_loaded.runner, SUFFIXES[:2]
    tables = [continuation_table(runner, PREFIX + s, params, 3) for s in suffixes]
    vocab = sorted({t for table in tables for key in table for t in key})
    wide = [[r] for r in range(12)] + [[0, 0], [1, 0], [2, 0]]  # most of the support at depth 1
    path = make_medusa_heads(tiny, tmp_path / "support.safetensors", vocab, wide, seed=3)
    heads = runner.thread.run_sync(MedusaModel.load, path, runner.ends)
    counts = [dict.fromkeys(table, 0) for table in tables]
    stats = StepStats("test")
    for seed in range(600):
        samplers = [Sampler(SamplingParams(**params, seed=2 * seed + row), tiny_loaded.cfg.vocab_size)
                    for row in range(len(suffixes))]
        _, got = batched(tiny_loaded, suffixes, [3, 3], proposer=MedusaRows(heads, heads.tree, 64), stats=stats,
                         samplers=samplers)
        for row, count in enumerate(counts):
            count[tuple(got[row])] += 1  # a continuation outside the support is a KeyError
    assert stats.accepted > 600 / 4  # tree nodes did produce tokens
    for count, table in zip(counts, tables, strict=True):
        assert chi_square_pvalue(count, table) > 1e-3
