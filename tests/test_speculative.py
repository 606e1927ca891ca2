"""The speculative policy against naive on the tiny model (float32): greedy output identical token for token,
with stops and max_tokens falling inside accepted runs; sampled output seeded alike is a valid sample (its
distribution is tested in test_verify.py); bad options are 400s."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgespec.decoding.draft_cost import PROBE_EVERY, DraftCosts, DraftLength, PassCosts
from edgespec.decoding.drafters import NgramDrafter
from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.speculative import SpeculativePolicy
from edgespec.decoding.stats import StepStats
from edgespec.decoding.types import GenerationRequest, SamplingParams
from edgespec.engine.engine import Engine

# Repetitive prompts: the n-gram drafter finds matches, so runs of accepted drafts happen.
PROMPTS = [[(i % 7) + 100 for i in range(40)], [5, 6, 7, 8] * 6 + [9, 10], list(range(300, 340))]


def run(policy, tiny_loaded, prompt, max_tokens=40, stop=(), options=None, **sampling):
    request = GenerationRequest(prompt, max_tokens, SamplingParams(**{"temperature": 0.0, **sampling}), tuple(stop),
                                frozenset(), policy.name, options or {})

    async def collect():
        return [e async for e in policy.generate(request, Engine(tiny_loaded.executor), tiny_loaded.tokenizer)]

    events = asyncio.run(collect())
    return [t for e in events for t in e.token_ids], "".join(e.text for e in events), events[-1]


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_greedy_equals_naive(tiny_loaded, prompt, k):
    want = run(NaivePolicy(), tiny_loaded, PROMPTS[prompt])
    got = run(SpeculativePolicy(), tiny_loaded, PROMPTS[prompt], options={"k": k})
    assert got[0] == want[0] and got[1] == want[1]
    assert got[2].finish_reason == want[2].finish_reason


def test_drafts_are_accepted_in_runs(tiny_loaded):
    ids, _, last = run(SpeculativePolicy(), tiny_loaded, PROMPTS[1], max_tokens=60, options={"k": 4})
    stats = last.stats
    assert stats["policy"] == "speculative" and stats["drafter"] == "ngram" and stats["drafter_ms"] >= 0
    assert stats["acceptance_rate"] is not None and stats["tokens_per_step"] >= 1.0
    assert stats["steps"] < len(ids)  # some steps emitted more than one token


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13])
def test_max_tokens_inside_an_accepted_run(tiny_loaded, max_tokens):
    want = run(NaivePolicy(), tiny_loaded, PROMPTS[1], max_tokens=max_tokens)
    got = run(SpeculativePolicy(), tiny_loaded, PROMPTS[1], max_tokens=max_tokens, options={"k": 8})
    assert got[0] == want[0] and len(got[0]) == max_tokens and got[2].finish_reason == "length"


def test_stop_string_inside_an_accepted_run(tiny_loaded):
    full = run(NaivePolicy(), tiny_loaded, PROMPTS[1], max_tokens=40)[1]
    stop = full[len(full) // 2:len(full) // 2 + 3]  # some text from the middle of the answer
    want = run(NaivePolicy(), tiny_loaded, PROMPTS[1], stop=[stop])
    got = run(SpeculativePolicy(), tiny_loaded, PROMPTS[1], stop=[stop], options={"k": 8})
    assert got[1] == want[1] and got[2].finish_reason == want[2].finish_reason == "stop"
    assert stop not in got[1]


def test_sampling_runs_and_respects_the_budget(tiny_loaded):
    ids, _, last = run(SpeculativePolicy(), tiny_loaded, PROMPTS[0], max_tokens=30, temperature=0.8, top_k=20, seed=3)
    assert len(ids) <= 30 and last.finish_reason in ("length", "stop")


def test_bad_options_are_refused():
    policy = SpeculativePolicy()
    for options in ({"drafter": "nope"}, {"k": 0}, {"k": "4"}, {"k": 99}):
        with pytest.raises(ValueError):
            policy.check(options)
    policy.check({"drafter": "ngram", "k": 4})


def test_ngram_drafter_proposes_the_latest_continuation():
    # one drafter per sequence (it indexes the sequence as it grows)
    assert NgramDrafter().propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == ([7, 1], None)  # latest [1, 2, 3]
    assert NgramDrafter().propose([4, 5, 6], 3) == ([], None)  # nothing repeats
    assert NgramDrafter().propose([8, 1, 8], 4) == ([1, 8], None)  # falls back to a 1-gram


def scan(tokens: list[int], k: int, max_n: int = 3) -> list[int]:
    """The definition, by brute force: the latest earlier occurrence of the longest matching tail."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), 0, -1):
        for i in range(end - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[end - n:]:
                return tokens[i + n:i + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 6))
def test_ngram_index_equals_a_scan_as_the_sequence_grows(seq, k):
    drafter = NgramDrafter()
    for end in range(1, len(seq) + 1):  # one drafter over a growing sequence, as in a generation
        assert drafter.propose(seq[:end], k)[0] == scan(seq[:end], k)


def test_greedy_equals_naive_with_the_draft_length_chosen_by_cost(tiny_loaded):
    policy = SpeculativePolicy()  # one policy: its measured pass costs carry from request to request
    for prompt in PROMPTS * 2:
        assert run(policy, tiny_loaded, prompt)[0] == run(NaivePolicy(), tiny_loaded, prompt)[0]
    assert policy.passes.measured(1)  # plain steps were timed, the baseline every K is weighed against


def test_pass_costs_are_timed_on_steps_whose_rows_all_have_logits(tiny_loaded):
    """A prompt's chunk beside decoding rows costs less a row than they do (no head rows, a short prefix to attend
    over): the draft-length rule's table of pass costs takes only the steps whose every row had its logits."""
    engine = Engine(tiny_loaded.executor)  # not closed: it would close the shared model's executor
    policy = SpeculativePolicy()
    steps: dict[int, tuple[int, int]] = {}  # pass number -> (rows, rows with logits)
    advance, observe, observed = engine._advance, policy.passes.observe, []

    def seen(seq, out):
        if out is not None:  # None: a program's first call
            steps[out.number] = (out.rows, out.head_rows)
        advance(seq, out)

    def timed(rows, seconds, number=None):
        observed.append(number)
        observe(rows, seconds, number)

    engine._advance, policy.passes.observe = seen, timed

    def request(prompt, policy_name):
        return GenerationRequest(prompt, 40, SamplingParams(temperature=0.0), (), frozenset(), policy_name, {})

    async def both():
        decoding = policy.generate(request(PROMPTS[1], "speculative"), engine, tiny_loaded.tokenizer)
        first = [await anext(decoding)]  # decoding: the long prompt goes in beside it, a chunk a step
        beside = asyncio.create_task(collect(NaivePolicy().generate(request(list(range(200, 400)), "naive"), engine,
                                                                    tiny_loaded.tokenizer)))
        return first + [e async for e in decoding], await beside

    mine, _ = asyncio.run(both())
    assert [t for e in mine for t in e.token_ids] == run(NaivePolicy(), tiny_loaded, PROMPTS[1])[0]
    assert any(head < rows for rows, head in steps.values())  # steps that carried a prompt's chunk
    assert observed and all(steps[n][0] == steps[n][1] for n in observed)


async def collect(events):
    return [e async for e in events]


def cost_model(seconds: dict[int, float], draft_s: float = 0.0):
    passes, drafts = PassCosts(), DraftCosts()
    for t, s in seconds.items():
        passes.observe(t, s)
    drafts.observe("d", 1, draft_s)
    return DraftLength(passes, drafts, k_start=4, k_min=0, k_max=8)


def test_no_draft_where_a_longer_pass_costs_more_than_the_drafts_bring():
    steep = {1: 1.0, 2: 1.9, 5: 3.0}  # a CPU whose cost grows with the rows of a pass
    length = cost_model(steep)
    for _ in range(5):  # a drafter whose first draft is kept 1 time in 4
        for accepted in (1, 0, 0, 0):
            length.update("d", 4, accepted)
    assert length.best("d", 8) == 0
    assert length.choose("d", 8) == 0
    for _ in range(PROBE_EVERY):  # steps that drafted nothing
        length.update("d", 0, 0)
    assert length.choose("d", 8) == 1  # then one probe re-measures the acceptance


def test_long_drafts_where_passes_are_flat_and_drafts_are_kept():
    length = cost_model({1: 1.0, 9: 1.1})
    for _ in range(20):
        length.update("d", 8, 8)
    assert length.choose("d", 8) == 8 and length.choose("d", 3) == 3  # bounded by the budget
    assert cost_model({1: 1.0, 9: 1.1}, draft_s=10.0).best("d", 8) == 0  # unless drafting itself is dear


def test_beside_other_sequences_the_step_tokens_are_weighed():
    # 7 other sequences in the step: a draft kept half the time pays for this request (1.5 tokens for 2.2 s
    # against 1 for 2.0) but costs the step (8.5 tokens for 2.2 s against 8 for 2.0)
    half = cost_model({1: 1.0, 8: 2.0, 9: 2.2, 16: 3.0})
    for _ in range(20):
        half.update("d", 1, 0)
        half.update("d", 1, 1)
    assert half.best("d", 8) > 0  # alone: 1.5 / pass(2) = 1.5 / 1.14 beats 1 / 1.0
    assert half.best("d", 8, besides=7) > 0  # the request's own rate alone would still draft
    assert half.best("d", 8, besides=7, others=7) == 0
    # drafts kept nearly always still pay beside them: (8 + 7.6) / 3.0 against 8 / 2.0
    runs = cost_model({1: 1.0, 8: 2.0, 16: 3.0})
    for _ in range(40):
        runs.update("d", 8, 8)
    assert runs.best("d", 8, besides=7, others=7) == 8


def test_a_drift_of_the_machine_speed_moves_every_size():
    passes = PassCosts()
    for _ in range(5):
        passes.observe(16, 1.0)
    passes.observe(17, 1.3)  # a draft's step, timed a step after a plain one
    passes.observe(16, 1.0)
    for _ in range(30):  # then a slow minute of plain steps
        passes.observe(16, 2.0)
    assert passes.get(16) == pytest.approx(2.0, rel=0.01)
    assert passes.get(17) == pytest.approx(2.6, rel=0.01)  # not 1.3: 17 rows would look cheaper than 16
    passes.observe(17, 2.34)  # a draft's step at 0.9x what was expected: its own cost follows
    assert passes.get(17) / passes.get(16) < 1.3


def test_a_pass_observed_by_each_of_its_sequences_counts_once():
    passes = PassCosts()
    passes.observe(16, 1.0, number=1)
    for _ in range(16):  # 16 sequences' programs observe pass 2
        passes.observe(16, 2.0, number=2)
    assert passes.get(16) == pytest.approx(2.0 ** 0.2)  # the speed moved once, by its weight
    passes.observe(16, 2.0, number=3)
    assert passes.get(16) == pytest.approx(2.0 ** 0.36)


class CountingLength(DraftLength):
    """A DraftLength that records the drafters it chose a K for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[str] = []

    def choose(self, name, budget, besides=0, others=0):
        self.asked.append(name)
        return super().choose(name, budget, besides, others)


def test_a_lookup_is_asked_first_and_its_drafts_cut_to_k():
    policy, step = SpeculativePolicy(), StepStats("speculative")
    length = CountingLength(PassCosts(), DraftCosts(), 4, 0, 16, fixed=2)
    chain = [NgramDrafter()]
    seq = [1, 2, 3, 9, 8, 7, 1, 2, 3]
    drafter, drafts, q = policy._draft(chain, length, seq, 10, step)
    assert drafter is chain[0] and drafts == [9, 8] == scan(seq, 2) and q is None and length.asked == ["ngram"]
    drafter, drafts, _ = policy._draft([NgramDrafter()], length, [4, 5, 6], 10, step)
    assert drafter is None and drafts == [] and length.asked == ["ngram"]  # no match: no K chosen


def test_no_probe_where_not_even_a_kept_draft_pays():
    # 15 other streams at a tile's edge: a 17th row costs more than a kept draft brings to the step
    edge = cost_model({1: 1.0, 2: 1.1, 16: 3.0, 17: 4.0})
    for _ in range(10):
        edge.update("d", 1, 0)
    for _ in range(PROBE_EVERY):
        edge.update("d", 0, 0)
    assert edge.choose("d", 8, besides=15, others=15) == 0
    assert edge.choose("d", 8) == 1  # alone, the probe


def test_the_draft_length_follows_the_acceptance_at_each_depth():
    # n-gram lookup's drafts come in runs: 3 verifications in 4 reject the first draft, 1 in 4 keeps all 16. One
    # rate over all depths (16 / 19 = 0.84 per draft) would stop at about 8; by depth, every draft after the
    # first is kept once the first is, so the longest draft pays
    runs = cost_model({1: 1.0, 17: 2.0})
    for _ in range(10):
        for accepted in (16, 0, 0, 0):
            runs.update("d", 16, accepted)
    assert runs.acceptance_at("d", 1) < 0.3 < 0.9 < runs.acceptance_at("d", 2) == runs.acceptance_at("d", 16)
    assert runs.best("d", 16) == 16
    # a drafter right at the first depth and wrong after it: one draft
    first_only = cost_model({1: 1.0, 17: 2.0})
    for _ in range(20):
        first_only.update("d", 4, 1)
    assert first_only.acceptance_at("d", 1) > 0.9 and first_only.acceptance_at("d", 2) < 0.1
    assert first_only.best("d", 16) == 1
    # a depth never judged takes the rate over all depths
    assert first_only.acceptance_at("d", 9) == first_only.acceptance("d")


def test_a_request_k_is_used_as_given_and_the_first_steps_measure():
    passes, drafts = PassCosts(), DraftCosts()
    assert DraftLength(passes, drafts, 4, 0, 8, fixed=2).choose("d", 8) == 2
    fresh = DraftLength(passes, drafts, 4, 0, 8)
    assert fresh.choose("d", 8) == 4  # nothing timed yet
    passes.observe(5, 2.0)
    assert fresh.choose("d", 8) == 0  # then a plain step, timed as the baseline
    passes.observe(1, 1.0)
    assert passes.get(3) == 1.5 and passes.get(7) == 2.0 + 2 * 0.25  # interpolated, then along 1 -> 5
    alone = PassCosts()
    alone.observe(1, 1.0)
    assert alone.get(3) == 1.0 + 2 * 0.3  # one size measured: the prior slope

