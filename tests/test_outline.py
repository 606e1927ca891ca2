"""The outline policy: requests it cannot serve fall back and say why (tiny model); on SmolLM2 in the served
format the points of a real outline, each a sequence started from the blocks of the prompt they share (the
prefix cache) and decoded in the engine's shared steps, each get exactly the tokens expanding them alone
gives, and the answer streams point by point in order; the shared budget gives what one point leaves to the
others."""

from __future__ import annotations

import asyncio
import json

import pytest

from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.outline import OutlinePolicy, chat_ids, common_prefix
from edgespec.decoding.outline_points import SharedBudget
from edgespec.decoding.outline_text import cut_outline, expansion_messages, outline_messages, parse_outline
from edgespec.decoding.types import GenerationRequest, SamplingParams
from edgespec.engine.engine import Engine
from edgespec.engine.prefix import PrefixCache
from edgespec.model.load import load_local
from edgespec.model.source import resolve_model
from edgespec.model.thread import ModelThread


def run(policy, loaded, prompt, max_tokens, question=None, options=None):
    request = GenerationRequest(prompt, max_tokens, SamplingParams(temperature=0.0), (), frozenset({2}),
                                policy.name, (options or {}) | ({"question": question} if question else {}))

    async def collect():
        # as served: the points share their prompt's blocks through the prefix cache (a fresh one each run, so
        # that a run alone computes its whole prompt)
        engine = Engine(loaded.executor, PrefixCache(2**28))
        try:
            return [e async for e in policy.generate(request, engine, loaded.tokenizer)]
        finally:  # the kept blocks go back to the shared model's pool (the engine is dropped, not closed)
            while (kept := engine.prefix.pop_lru()) is not None:
                await loaded.executor.thread.run(loaded.executor.release, kept)

    return asyncio.run(collect())


def test_common_prefix():
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix([[5], [6]]) == 0


class Stream:
    """Stands for a point's TextStream: the budget sets its max_tokens and reads its tokens and tail."""

    def __init__(self):
        self.ids, self.finished, self.text, self.max_tokens = [], None, "", 0

    def tail(self) -> str:
        return self.text

    def take(self, n: int, text: str = "x", finished: str | None = None) -> list[bool]:
        out = []
        for i in range(n):
            self.ids.append(7)
            self.text, self.finished = (text, finished) if i == n - 1 else ("x", None)
            out.append(self.until(self))
        return out


def test_the_shared_budget_gives_what_a_point_leaves_to_the_others():
    streams = [Stream(), Stream(), Stream()]
    budget = SharedBudget(30, streams)
    assert [s.max_tokens for s in streams] == [10, 10, 10] and budget.fair() == 10
    assert not any(streams[0].take(4, "Done.", "stop"))  # point 0 ended on its own after 4 tokens
    assert budget.fair() == 13 and [streams[1].max_tokens, streams[2].max_tokens] == [13, 13]
    assert not any(streams[1].take(9))  # past 3/4 of its share, but mid-sentence: goes on
    assert streams[1].take(1, " a sentence.") == [True]  # ... and ends at the sentence's end
    assert budget.ended_early == 1 and budget.live == {2} and streams[2].max_tokens == 16  # all that is left
    assert not any(streams[2].take(15))
    assert streams[2].max_tokens == 16  # one more at most: 4 + 10 + 16 = 30
    streams[2].take(1, "s", "length")
    assert sum(budget.made) == 30 and not budget.live


def test_the_shared_budget_divides_the_last_tokens():
    streams = [Stream(), Stream()]
    SharedBudget(5, streams)
    assert [s.max_tokens for s in streams] == [3, 2]  # the earlier point gets the remainder
    streams[0].take(3)
    assert [s.max_tokens for s in streams] == [4, 1]  # what is left, divided again among the live points


def test_a_stream_ends_where_its_budget_says_with_its_held_text(tiny_loaded):
    from edgespec.decoding.text import TextStream

    tok = tiny_loaded.tokenizer
    ids = tok.encode("One. Two three", add_special_tokens=False)
    stream = TextStream(tok, ("Two three four",), frozenset(), 100, until=lambda s: len(s.ids) == len(ids))
    pushed = [stream.push(t) for t in ids]
    assert "".join(p.text for p in pushed) == tok.decode(ids)  # the text held for the stop string is shown
    assert pushed[-1].finish_reason == "length" and stream.finished == "length"


@pytest.mark.parametrize("question", [None, "How can I sleep better?"])
def test_requests_outline_cannot_serve_fall_back(tiny_loaded, question):
    # the tiny random model writes no numbered outline; without a chat question there is none to ask for
    prompt = chat_ids(tiny_loaded.tokenizer, [{"role": "user", "content": "How can I sleep better?"}])
    events = run(OutlinePolicy(), tiny_loaded, prompt, 12, question)
    naive = run(NaivePolicy(), tiny_loaded, prompt, 12)
    assert "".join(e.text for e in events) == "".join(e.text for e in naive)
    stats = events[-1].stats
    outline_tokens = stats["outline"]["outline_tokens"]
    assert (outline_tokens > 0) == (question is not None)
    assert sum(len(e.token_ids) for e in events) == outline_tokens + sum(len(e.token_ids) for e in naive)  # usage
    assert stats["policy"] == "outline" and stats["outline"]["fallback_policy"] == "naive"
    assert stats["outline"]["fallback"] == ("not a chat request" if question is None
                                            else "the outline could not be parsed")


@pytest.fixture(scope="module")
def smollm2():
    # the default weights and KV format, as served: the same bits as the servers below
    model = load_local(resolve_model(None), "auto", 1.0, ModelThread(2), kv="float16")
    yield model
    model.executor.close()


@pytest.fixture(scope="module")
def verifiers(smollm2):
    from edgespec.decoding.medusa import MedusaPolicy
    from edgespec.decoding.medusa_heads import MedusaModel
    from edgespec.decoding.speculative import SpeculativePolicy
    from edgespec.decoding.target_fit import SHIPPED

    path = next(SHIPPED.glob("smollm2-135m-instruct-medusa.safetensors"))
    heads = smollm2.executor.thread.run_sync(MedusaModel.load, path, smollm2.executor.ends)
    return {"medusa": MedusaPolicy(heads), "speculative": SpeculativePolicy()}


@pytest.mark.slow
@pytest.mark.parametrize("verify", ["none", "medusa", "speculative"])
def test_batched_points_equal_each_point_alone_and_stream_in_order(smollm2, verifiers, verify):
    question = "What are some tips for staying healthy while working from home?"
    tok = smollm2.tokenizer
    policy = OutlinePolicy(point_tokens=24, verifiers=verifiers)
    heads, asked = verifiers["medusa"].heads, []  # the sequences in each of the heads' calls
    batched = heads.propose_batch
    heads.propose_batch = lambda requests: (asked.append(len(requests)), batched(requests))[1]
    try:
        events = run(policy, smollm2, chat_ids(tok, [{"role": "user", "content": question}]), 120, question,
                     {"verify": verify, "pass_tokens": 64})  # room for candidates with every point live
    finally:
        del heads.propose_batch
    assert (max(asked) >= 2) if verify == "medusa" else not asked  # the points' heads ran in one call
    stats = events[-1].stats
    assert "fallback" not in stats["outline"], stats
    n, made = stats["outline"]["points"], stats["outline"]["point_tokens"]
    outline = run(NaivePolicy(), smollm2, chat_ids(tok, outline_messages(question)), 96)
    full = tok.decode([t for e in outline for t in e.token_ids], skip_special_tokens=True)
    points = parse_outline(cut_outline(full) or full)
    assert len(points) == n >= 2
    text = "".join(e.text for e in events)
    expected = []
    for i, point in enumerate(points):
        head = f"{i + 1}. {point}: "
        alone = run(NaivePolicy(), smollm2, chat_ids(tok, expansion_messages(question, points, i)), made[i])
        expected.append(head + "".join(e.text for e in alone) + "\n")
    assert text == "".join(expected)
    budget = stats["outline"]["budget"]
    assert len(made) == n and sum(made) <= budget + n and budget == min(24 * n, 120)
    # point 1 streams as it is generated: many events carry its text before it is complete
    sent = [len("".join(e.text for e in events[:i + 1])) for i in range(len(events))]
    assert sum(1 for n in sent if 0 < n < len(expected[0])) > 5
    assert sum(len(e.token_ids) for e in events) == stats["outline"]["outline_tokens"] + \
        stats["outline"]["expanded_tokens"]  # usage
    assert stats["outline"]["verify"] == verify
    if verify != "none":
        assert stats["acceptance_rate"] is not None
    print(text)


@pytest.mark.slow
def test_outline_over_two_workers_equals_in_process(smollm2, tmp_path):
    import httpx
    from processes import model_id, start_server

    question = "What are some tips for saving money on groceries?"
    events = run(OutlinePolicy(), smollm2, chat_ids(smollm2.tokenizer, [{"role": "user", "content": question}]),
                 60, question)
    want = "".join(e.text for e in events)
    assert "fallback" not in events[-1].stats["outline"]
    proc, url = start_server(tmp_path, "outline", "--local-workers", "2", "--placement", "even",
                             "--worker-threads", "1")
    try:
        body = {"model": model_id(url), "temperature": 0, "max_tokens": 60, "decoding": "outline",
                "messages": [{"role": "user", "content": question}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
        assert r["choices"][0]["message"]["content"] == want
        assert r["decoding"]["outline"]["points"] >= 2 and r["decoding"]["wire_requests_per_token"] > 0
        composed = {**body, "decoding": {"policy": "outline", "verify": "medusa", "pass_tokens": 64}}
        r = httpx.post(url + "/v1/chat/completions", json=composed, timeout=300).json()
        # the same tokens for every point; where a point ends can move with the tokens its steps give
        lines, plain = r["choices"][0]["message"]["content"].splitlines(), want.splitlines()
        assert len(lines) == len(plain) and r["decoding"]["acceptance_rate"] is not None
        assert all(a.startswith(b) or b.startswith(a) for a, b in zip(lines, plain, strict=True))
        streamed = []
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    streamed += [c["delta"].get("content") or "" for c in chunk["choices"]]
        assert "".join(streamed) == want
    finally:
        proc.stop()


@pytest.mark.parametrize("question, chose", [("Write a Python function that sorts a list.", "naive"),
                                             (None, "naive"), ("How can I sleep better?", "outline")])
def test_auto_routes_per_request(tiny_loaded, question, chose):
    from edgespec.decoding.auto import AutoPolicy

    prompt = chat_ids(tiny_loaded.tokenizer, [{"role": "user", "content": question or "hi"}])
    events = run(AutoPolicy(OutlinePolicy(), NaivePolicy()), tiny_loaded, prompt, 8, question)
    assert events[-1].stats["auto"]["chose"] == chose


def test_bad_outline_options_are_refused():
    from edgespec.decoding.medusa import MedusaPolicy
    from edgespec.decoding.speculative import SpeculativePolicy

    policy = OutlinePolicy(verifiers={"medusa": MedusaPolicy(None), "speculative": SpeculativePolicy()})
    policy.check({"verify": "speculative", "pass_tokens": 16})
    with pytest.raises(ValueError, match="--medusa"):  # no heads loaded: says how to load them
        policy.check({"verify": "medusa"})
    with pytest.raises(ValueError, match="verify must be one of medusa, none, speculative"):
        policy.check({"verify": "eagle"})
    with pytest.raises(ValueError, match="pass_tokens"):
        policy.check({"pass_tokens": 0})
