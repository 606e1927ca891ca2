"""A reasoning model's thinking kept apart from its answer (server/reasoning.py): the split of streamed text at
every cut, the calls after a thinking block, the chat renderer's `reasoning_content`, and the HTTP API on a tiny
random Qwen3 with Qwen3's own chat template (tests/data/qwen3_chat_template.jinja, from Qwen3's
tokenizer_config.json) and its `<think>` tokens: `chat_template_kwargs`, thinking that the template opens, and a
grammar (JSON, calls) that holds after the block."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from inprocess import LoopClient, controller_app
from model_fixtures import make_tiny_model, smollm2_folder

from edgespec.server.chat_input import ChatDelta
from edgespec.server.reasoning import ThinkBlock, ThinkSplitter, think_block
from edgespec.server.render import Renderer
from edgespec.server.tool_output import AnswerReader, CallExtractor
from edgespec.server.tool_prompt import HERMES

TEMPLATE = Path(__file__).parent / "data" / "qwen3_chat_template.jinja"
# a test-only switch that opens the block in the prompt, as the templates of thinking-only models do
OPENING = ("{%- if add_generation_prompt and open_thinking is defined and open_thinking %}"
           "{{- '<think>\\n' }}{%- endif %}")


def split(pieces: list[str], inside: bool = False) -> tuple[str, str]:
    s = ThinkSplitter(inside)
    out = [s.push(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in out), "".join(a for _, a in out)


def every_cut(text: str) -> list[list[str]]:
    """The text whole, a character at a time, and cut in two at every place."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


@pytest.mark.parametrize(("text", "inside", "want"), [
    ("<think>\nGreet them.\nBriefly?\n</think>\n\nHello there.", False, ("Greet them.\nBriefly?", "Hello there.")),
    ("  \n<think>a < b</think>b", False, ("a < b", "b")),
    ("Hello <think>not thinking</think>", False, ("", "Hello <think>not thinking</think>")),
    ("I think so.\n</think>\n\nYes.", True, ("I think so.", "Yes.")),
    ("<think>\nhalf a thou", False, ("half a thou", "")),
    ("cut inside </th", True, ("cut inside </th", "")),
    ("<thi", False, ("", "<thi")),
    ("\n\n", False, ("", "")),
    ("<think></think>", False, ("", "")),
])
def test_the_thinking_block_is_split_off_at_every_cut(text, inside, want):
    for pieces in every_cut(text):
        assert split(pieces, inside) == want, pieces


def test_the_prompt_says_whether_the_template_opened_the_block():
    class Tags:
        convert_tokens_to_ids = staticmethod({"<think>": 7, "</think>": 8}.get)

    assert think_block(Tags, "<|im_start|>assistant\n<think>\n") == ThinkBlock(7, 8, True)
    assert not think_block(Tags, "<|im_start|>assistant\n<think>\n\n</think>\n\n").opened
    assert not think_block(Tags, "<|im_start|>assistant\n").opened


def test_calls_after_a_thinking_block():
    text = ('<think>\nThe light.\n</think>\n\n'
            '<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "x"}}\n</tool_call>')
    for pieces in every_cut(text)[:2]:
        reader = AnswerReader(CallExtractor(HERMES, True), ThinkSplitter(False))
        deltas = [reader.push(p) for p in pieces[:-1]] + [reader.push(pieces[-1], "stop")]
        assert "".join(d.reasoning for d in deltas) == "The light."
        assert "".join(d.content for d in deltas) == ""
        assert [(c.name, c.arguments) for d in deltas for c in d.calls] == [("HassTurnOn", '{"name":"x"}')]
        assert deltas[-1].finish_reason == "tool_calls"


def test_the_chat_renderer_shows_reasoning_content_apart():
    deltas = [ChatDelta(reasoning="Greet", tokens=1), ChatDelta("Hi", reasoning=" them.", tokens=2),
              ChatDelta(" there", tokens=1, finish_reason="stop")]
    message = Renderer("chat", "m", None, 3).response(deltas)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Greet them.", "Hi there")
    renderer = Renderer("chat", "m", None, 3)
    chunks = [c for d in deltas for c in renderer.chunks(d, False)]
    streamed = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in streamed) == "Greet them."
    assert "".join(d.get("content", "") for d in streamed) == "Hi there"
    plain = Renderer("chat", "m", None, 3).response([ChatDelta("Hi", tokens=1, finish_reason="stop")])
    assert "reasoning_content" not in plain["choices"][0]["message"]  # models that do not think: as before


# -- the HTTP API on a tiny Qwen3 with Qwen3's template -------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(client, tokenizer) of a tiny random Qwen3 whose tokenizer has Qwen3's <think> tokens and chat template."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("qwen3-thinking")
    tok = AutoTokenizer.from_pretrained(smollm2_folder())
    tok.add_tokens(["<think>", "</think>"])  # as in Qwen3's tokenizer: added, not special
    tok.chat_template = TEMPLATE.read_text() + OPENING
    make_tiny_model(folder, arch="qwen3", vocab_size=len(tok), max_position_embeddings=512, bos_token_id=1,
                    eos_token_id=2)
    tok.save_pretrained(folder)
    for stale in folder.glob("chat_template.json"):  # one template: the tokenizer's
        shutil.rmtree(stale, ignore_errors=True)
    app, service = controller_app(str(folder), served_model_name="qwen3")
    client = LoopClient(app)
    yield client, tok, service
    client.close()
    service.engine.close()


def chat(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"model": "qwen3", "temperature": 0,
                                                  "messages": [{"role": "user", "content": "Hello"}], **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_template_thinks_and_enable_thinking_false_closes_the_block(qwen3):
    _, tok, service = qwen3
    from edgespec.server.protocol import ChatCompletionRequest

    def prompt(**kwargs):
        req = ChatCompletionRequest(model="qwen3", messages=[{"role": "user", "content": "Hi"}], **kwargs)
        return service.chat_prompt(req.chat_input())

    assert service.template.thinks and service.template.native
    ids, thinking = prompt()
    assert not thinking.opened and tok.decode(ids).endswith("<|im_start|>assistant\n")
    ids, thinking = prompt(chat_template_kwargs={"enable_thinking": False})
    assert not thinking.opened and tok.decode(ids).endswith("<think>\n\n</think>\n\n")
    assert prompt(chat_template_kwargs={"open_thinking": True})[1].opened


def test_thinking_the_template_opened_goes_to_reasoning_content(qwen3):
    client, _, _ = qwen3
    body = chat(client, max_tokens=6, chat_template_kwargs={"open_thinking": True})
    message, choice = body["choices"][0]["message"], body["choices"][0]
    # a random model does not close the block in 6 tokens: all of them are thinking
    assert choice["finish_reason"] == "length" and message["content"] == "" and message["reasoning_content"]
    assert "</think>" not in message["reasoning_content"]
    streamed = client.post("/v1/chat/completions", json={
        "model": "qwen3", "temperature": 0, "max_tokens": 6, "stream": True,
        "messages": [{"role": "user", "content": "Hello"}], "chat_template_kwargs": {"open_thinking": True}})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert not "".join(d.get("content", "") for d in deltas)


def test_a_closed_block_leaves_the_answer_to_content_and_a_grammar_holds_after_it(qwen3):
    client, tok, _ = qwen3
    close = str(tok.convert_tokens_to_ids("</think>"))
    body = chat(client, max_tokens=24, logit_bias={close: 100}, chat_template_kwargs={"open_thinking": True},
                response_format={"type": "json_object"})
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message  # the block closed at once: nothing thought
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(message["content"]), dict)
    else:  # cut by max_tokens inside the object: still JSON's beginning, never the tags
        assert message["content"].startswith("{")


def test_a_call_after_the_block(qwen3):
    client, tok, _ = qwen3
    close = str(tok.convert_tokens_to_ids("</think>"))
    tool = {"type": "function", "function": {"name": "HassTurnOn", "parameters": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}}}
    body = chat(client, max_tokens=48, logit_bias={close: 100}, tools=[tool], tool_choice="required",
                chat_template_kwargs={"open_thinking": True})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "HassTurnOn" and set(json.loads(call["arguments"])) == {"name"}


def test_chat_template_kwargs_cannot_set_the_servers_own_arguments(qwen3):
    client, _, _ = qwen3
    r = client.post("/v1/chat/completions", json={"model": "qwen3", "messages": [{"role": "user", "content": "x"}],
                                                  "chat_template_kwargs": {"tools": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
