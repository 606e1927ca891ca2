"""Grammar-constrained decoding (decoding/grammar.py) with every policy, on the tiny model with SmolLM2's
tokenizer (float32): the output matches the grammar; speculative and Medusa, whose drafts the grammar may
forbid, emit naive's tokens under the same grammar; sampling under a grammar samples the masked target
(verify's rule against the exact masked distribution); a tool trigger is scored and decided before decoding
without changing a bit of what follows."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import jsonschema
import pytest
import torch
from model_fixtures import chi_square_pvalue, make_medusa_heads

from edgespec.decoding.decide import Trigger
from edgespec.decoding.grammar import GrammarError, Grammars
from edgespec.decoding.medusa import MedusaPolicy
from edgespec.decoding.medusa_heads import MedusaModel
from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.sampling import Sampler
from edgespec.decoding.speculative import SpeculativePolicy
from edgespec.decoding.types import GenerationRequest, SamplingParams
from edgespec.decoding.verify import verify
from edgespec.engine.engine import Engine

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["on", "room", "level"],
          "properties": {"on": {"type": "boolean"}, "room": {"enum": ["kitchen", "hall", "living room"]},
                         "level": {"type": "integer", "minimum": 0, "maximum": 99}},
          "x-guidance": {"whitespace_flexible": False}}
LARK = "start: %json" + json.dumps(SCHEMA)
PROMPT = [(i % 7) + 100 for i in range(30)]
WIDE = [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0]]


@pytest.fixture(scope="module")
def grammars(tiny_loaded):
    return Grammars(tiny_loaded.tokenizer, tiny_loaded.cfg.vocab_size)


def generate(policy, loaded, prompt, max_tokens=60, options=None, grammar=None, trigger=None, **sampling):
    eos = frozenset({loaded.tokenizer.eos_token_id})
    request = GenerationRequest(prompt, max_tokens, SamplingParams(**{"temperature": 0.0, **sampling}), (), eos,
                                policy.name, options or {}, grammar, trigger)

    async def collect():
        return [e async for e in policy.generate(request, Engine(loaded.executor), loaded.tokenizer)]

    events = asyncio.run(collect())
    return [t for e in events for t in e.token_ids], "".join(e.text for e in events), events[-1]


@pytest.fixture(scope="module")
def naive_json(tiny_loaded, grammars):
    return generate(NaivePolicy(), tiny_loaded, PROMPT, grammar=grammars.compile(LARK))


@pytest.fixture(scope="module")
def heads(tiny, tiny_loaded, naive_json, tmp_path_factory):
    # heads over the tokens naive emits and as many others: they propose allowed and forbidden tokens alike
    vocab = sorted(set(naive_json[0]) | set(range(1000, 1000 + len(set(naive_json[0])))))
    path = make_medusa_heads(tiny, tmp_path_factory.mktemp("medusa") / "heads.safetensors", vocab, WIDE)
    return tiny_loaded.executor.thread.run_sync(MedusaModel.load, path, tiny_loaded.executor.ends)


def test_a_random_model_under_a_grammar_writes_valid_json(naive_json):
    _, text, last = naive_json
    assert last.finish_reason == "stop"  # the grammar ended, and then only the end of sequence was allowed
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == json.dumps(json.loads(text), separators=(",", ":"))  # no free whitespace


def test_the_tiny_model_alone_writes_no_json(tiny_loaded):
    _, text, _ = generate(NaivePolicy(), tiny_loaded, PROMPT, max_tokens=20)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_under_a_grammar_emits_naives_tokens(tiny_loaded, grammars, naive_json, k):
    # n-gram drafts from a repetitive prompt are mostly forbidden by the grammar: the rule rejects them
    got = generate(SpeculativePolicy(), tiny_loaded, PROMPT, options={"k": k, "drafter": "ngram"},
                   grammar=grammars.compile(LARK))
    assert got[0] == naive_json[0] and got[1] == naive_json[1]


def test_medusa_under_a_grammar_emits_naives_tokens(tiny_loaded, grammars, naive_json, heads):
    for acceptance in ("exact", "typical"):  # typical falls back to the exact descent under a grammar
        got = generate(MedusaPolicy(heads), tiny_loaded, PROMPT, options={"acceptance": acceptance},
                       grammar=grammars.compile(LARK))
        assert got[0] == naive_json[0] and got[1] == naive_json[1]
        assert got[2].stats["exact"] is True


def test_a_grammar_that_does_not_compile_says_why(grammars):
    with pytest.raises(GrammarError, match="wat"):
        grammars.compile('start: %json{"type": "wat"}')
    constraint = grammars.compile(LARK).constraint()
    with pytest.raises(GrammarError):
        constraint.consume(grammars._hf.encode("hello", add_special_tokens=False)[0])


def masked_probs(sampler: Sampler, logits: torch.Tensor) -> torch.Tensor:
    return sampler.probs(logits).double()


@pytest.fixture
def one_thread():
    """This thread's torch ops on one OpenMP thread: the loop below is 1500 rounds of small ops on 49152-token
    vectors, which a second thread does not speed up on free cores and slows about tenfold when other processes
    hold them (each op waits for a descheduled thread: 115 s against 7 s measured on two loaded cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_verify_under_a_grammar_samples_the_masked_target(tiny_loaded, grammars, one_thread):
    # One draft from a drafter's distribution q that puts most of its mass on tokens the grammar forbids; the
    # emitted first token must follow the target masked by the grammar (a rule that read the unmasked p, or
    # kept a forbidden draft, fails: the forbidden tokens have 0 expected count).
    grammar = grammars.compile('start: "yes" | "no" | "maybe" | "never"')
    vocab = tiny_loaded.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, vocab, generator=gen) * 2  # [K + 1, V]
    params = SamplingParams(temperature=1.0)
    p = masked_probs(Sampler(params, vocab, grammar), logits[0])
    support = torch.nonzero(p).flatten().tolist()
    assert 3 <= len(support) < 40
    forbidden = torch.topk(logits[0], 5).indices.tolist()
    q = torch.zeros(1, vocab)
    q[0, forbidden] = 0.6 / len(forbidden)
    q[0, support] += 0.4 / len(support)
    counts = Counter()
    for seed in range(1500):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), vocab, grammar)
        draft = int(torch.multinomial(q[0], 1, generator=sampler.generator))
        counts[verify(sampler, logits, [draft], q).tokens[0]] += 1
    assert set(counts) <= set(support)
    table = {(t,): float(p[t]) for t in support}
    assert chi_square_pvalue({(t,): counts[t] for t in support}, table) > 1e-3


def test_a_trigger_is_scored_and_changes_nothing_else(tiny_loaded, grammars):
    # +inf threshold: never forced; the scoring pass and its rollback leave naive's tokens bit for bit
    trigger_ids = tuple(grammars._hf.encode("<tool_call>[", add_special_tokens=False))
    forced = grammars.compile(LARK)
    plain = generate(NaivePolicy(), tiny_loaded, PROMPT, max_tokens=24)
    never = Trigger(trigger_ids, float("inf"), forced)
    for policy in (NaivePolicy(), SpeculativePolicy()):
        got = generate(policy, tiny_loaded, PROMPT, max_tokens=24, trigger=never)
        assert got[0] == plain[0]
        scored = got[2].stats["tool_choice"]
        assert scored["call"] is False and scored["trigger_logprob"] < 0
    # -inf: always forced, and the output is the forced grammar's
    always = generate(NaivePolicy(), tiny_loaded, PROMPT, trigger=Trigger(trigger_ids, float("-inf"), forced))
    jsonschema.validate(json.loads(always[1]), SCHEMA)
    assert always[2].stats["tool_choice"]["call"] is True
