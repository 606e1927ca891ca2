"""Rendering details that the server tests cannot easily provoke: a token's bytes inside a character, and
how calls are streamed and returned (chat completions and the legacy function_call)."""

from __future__ import annotations

from model_fixtures import smollm2_folder
from transformers import AutoTokenizer

from edgespec.decoding.types import TokenLogprob
from edgespec.server.chat_input import ChatDelta, ToolCall
from edgespec.server.render import Renderer


def test_logprob_bytes_of_a_token_that_ends_inside_a_character():
    tok = AutoTokenizer.from_pretrained(smollm2_folder())
    ids = tok.encode(" 😀")  # byte-level BPE splits the emoji's four bytes over two tokens
    assert len(ids) == 2
    renderer = Renderer("chat", "m", tok, prompt_tokens=1, top_logprobs=0)
    deltas = [ChatDelta("", tokens=1, logprobs=[TokenLogprob(i, -0.5)]) for i in ids]
    deltas[-1].finish_reason = "stop"
    content = renderer.response(deltas)["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(entry["bytes"]) for entry in content)
    assert joined == " 😀".encode()
    assert bytes(content[0]["bytes"]) == b" \xf0\x9f\x98"  # the partial character's own bytes


CALLS = [ToolCall("call_a", "HassTurnOn", '{"name":"Kitchen Light"}'), ToolCall("call_b", "GetLiveContext", "{}")]


def test_streamed_calls_join_into_the_whole_answers_calls():
    # OpenAI's accumulation rule: a call's first delta has index, id, type and name; later ones add arguments
    renderer = Renderer("chat", "m", None, prompt_tokens=1)
    deltas = [ChatDelta("Sure.", tokens=2), ChatDelta("", CALLS, "tool_calls", tokens=20)]
    chunks = [c for d in deltas for c in renderer.chunks(d, include_usage=False)]
    joined: dict[int, dict] = {}
    for chunk in chunks:
        for part in chunk["choices"][0]["delta"].get("tool_calls", []):
            call = joined.setdefault(part["index"], {"arguments": ""})
            call.update({k: v for k, v in part.items() if k in ("id", "type")})
            call["name"] = part["function"].get("name", call.get("name"))
            call["arguments"] += part["function"]["arguments"]
    assert [(c["id"], c["name"], c["arguments"]) for c in joined.values()] == [
        (c.id, c.name, c.arguments) for c in CALLS]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
    whole = Renderer("chat", "m", None, prompt_tokens=1).response(deltas)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Sure."
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["HassTurnOn", "GetLiveContext"]


def test_a_legacy_call_is_a_function_call():
    deltas = [ChatDelta("", CALLS[:1], "function_call", tokens=9)]
    whole = Renderer("chat", "m", None, prompt_tokens=1, legacy=True).response(deltas)["choices"][0]
    assert whole["message"] == {"role": "assistant", "content": None,
                                "function_call": {"name": "HassTurnOn", "arguments": '{"name":"Kitchen Light"}'}}
    chunks = Renderer("chat", "m", None, prompt_tokens=1, legacy=True).chunks(deltas[0], include_usage=False)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"function_call": {"name": "HassTurnOn", "arguments": ""}},
        {"function_call": {"arguments": '{"name":"Kitchen Light"}'}}]
