"""Rendering details that the server tests cannot easily provoke."""

from __future__ import annotations

from model_fixtures import smollm2_folder
from transformers import AutoTokenizer

from edgespec.decoding.types import TokenEvent, TokenLogprob
from edgespec.server.render import Renderer


def test_logprob_bytes_of_a_token_that_ends_inside_a_character():
    tok = AutoTokenizer.from_pretrained(smollm2_folder())
    ids = tok.encode(" 😀")  # byte-level BPE splits the emoji's four bytes over two tokens
    assert len(ids) == 2
    renderer = Renderer("chat", "m", tok, prompt_tokens=1, top_logprobs=0)
    events = [TokenEvent([i], "", None, [TokenLogprob(i, -0.5)]) for i in ids]
    events[-1].finish_reason = "stop"
    content = renderer.response(events)["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(entry["bytes"]) for entry in content)
    assert joined == " 😀".encode()
    assert bytes(content[0]["bytes"]) == b" \xf0\x9f\x98"  # the partial character's own bytes
