"""Llama 3.x's native tool calls: bare JSON objects (`{"name": ..., "parameters": {...}}`) as Meta's own chat
templates write them (tests/data/llama3.1_chat_template.jinja and llama3.2_chat_template.jinja: the
Llama-3.1-8B-Instruct and Llama-3.2-3B-Instruct templates as llama.cpp keeps them, models/templates/, fetched
from the models' tokenizer_config.json). The prompt against the template's own rendering (transformers'
apply_chat_template), the grammar against the template's own rendering of a call, the streamed parse at every
cut, and the HTTP API (chat completions and the Responses API, through the official `openai` client) on a tiny
random Llama whose tokenizer has Llama 3's special tokens; a template without tools (Phi-3.5-mini's) still gets
the polyfill."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx2
import jsonschema
import llguidance
import llguidance.hf
import openai
import pytest
from inprocess import LoopClient, controller_app
from model_fixtures import make_tiny_model, smollm2_folder

from edgespec.server.chat_input import ChatInput, Message, ResponseFormat, ToolChoiceNamed, ToolSpec
from edgespec.server.protocol import ChatCompletionRequest
from edgespec.server.structured import plan
from edgespec.server.tool_output import JsonCallExtractor
from edgespec.server.tool_prompt import SMOLLM2, ChatTemplate, JsonCalls

DATA = Path(__file__).parent / "data"
TEMPLATES = {v: (DATA / f"llama{v}_chat_template.jinja").read_text() for v in ("3.1", "3.2")}
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"]

TURN_ON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
TOOLS = [{"type": "function", "function": {"name": "HassTurnOn", "description": "Turns on a device",
                                           "parameters": TURN_ON}},
         {"type": "function", "function": {"name": "GetLiveContext", "description": "Current states of devices",
                                           "parameters": {"type": "object", "properties": {}}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASKED = [{"role": "system", "content": "You are a voice assistant for Home Assistant."},
         {"role": "user", "content": "turn on the kitchen light"}]


def call(id_: str, name: str, arguments: dict) -> dict:
    """A past call as OpenAI's messages carry it (arguments a JSON string)."""
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


ROUND_TRIP = [*ASKED, {"role": "assistant", "content": None,
                       "tool_calls": [call("call_1", "HassTurnOn", {"name": "kitchen"})]},
              {"role": "tool", "tool_call_id": "call_1", "content": '{"success": true}'},
              {"role": "user", "content": "thanks"}]


def llama3_tokenizer(template: str):
    """SmolLM2's tokenizer with Llama 3's special tokens, BOS and EOS, and `template`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_folder())
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL})
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tok.chat_template = template
    return tok


def reference(tok, messages: list[dict], tools: list[dict] | None = TOOLS, **kwargs) -> str:
    """The template's own rendering, the messages' call arguments as objects (Hugging Face's convention)."""
    hf = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    return tok.apply_chat_template(hf, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)


def chat_input(messages: list[dict], **body) -> ChatInput:
    return ChatCompletionRequest(model="m", messages=messages, **body).chat_input()


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def tok(request):
    return llama3_tokenizer(TEMPLATES[request.param])


# -- the prompt ----------------------------------------------------------------------------------------------------


def test_the_template_is_read_as_json_calls(tok):
    template = ChatTemplate(tok)
    assert template.native and not template.thinks
    assert template.syntax == JsonCalls("parameters", tok.convert_tokens_to_ids("<|python_tag|>"))
    phi = copy.copy(tok)
    phi.chat_template = (DATA / "phi3.5_chat_template.jinja").read_text()  # no tools in it: the polyfill
    assert not ChatTemplate(phi).native and ChatTemplate(phi).syntax == SMOLLM2


@pytest.mark.parametrize("kwargs", [{}, {"tools_in_user_message": False}])
def test_the_prompt_is_the_templates_own(tok, kwargs):
    template = ChatTemplate(tok)
    for messages in (ASKED, ROUND_TRIP):
        ours = template.render(chat_input(messages, tools=TOOLS, chat_template_kwargs=kwargs or None))
        assert ours == reference(tok, messages, **kwargs)
        assert '"name": "HassTurnOn"' in ours  # the tools, as the template lists them
    # the result in an ipython turn; the template's `is iterable` holds for a string, so it is written as JSON
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"success\\": true}"' in ours
    none = template.render(chat_input(ROUND_TRIP, tools=TOOLS, tool_choice="none"))
    assert none == reference(tok, ROUND_TRIP, tools=None) and "Environment: ipython" not in none


def test_several_past_calls_become_turns_of_one_call(tok):
    """The template holds one call a turn and raises on more; consecutive turns are what it can show."""
    calls = [call("c1", "HassTurnOn", {"name": "lamp"}), call("c2", "GetLiveContext", {})]
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls]
    messages = [*ASKED, {"role": "assistant", "content": "", "tool_calls": calls}, *results]
    with pytest.raises(Exception, match="single tool-calls"):
        reference(tok, messages)
    split = [*ASKED, *({"role": "assistant", "content": "", "tool_calls": [c]} for c in calls), *results]
    assert ChatTemplate(tok).render(chat_input(messages, tools=TOOLS)) == reference(tok, split)


# -- the grammar ---------------------------------------------------------------------------------------------------


def test_the_grammar_writes_a_call_as_the_template_does(tok):
    lt = llguidance.hf.from_tokenizer(tok)

    def drive(grammar: str, ids: list[int]) -> bool:
        """Whether `ids` are allowed one by one and leave the grammar complete."""
        matcher = llguidance.LLMatcher(lt, grammar)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    syntax = ChatTemplate(tok).syntax
    specs = tuple(ToolSpec(t["function"]["name"], "", t["function"]["parameters"]) for t in TOOLS)
    rendered = reference(tok, ROUND_TRIP)  # the call as the template wrote it in the assistant turn
    written = rendered.split("assistant<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    assert written == '{"name": "HassTurnOn", "parameters": {"name": "kitchen"}}'
    ids = tok.encode(written, add_special_tokens=False)
    tag = tok.convert_tokens_to_ids("<|python_tag|>")
    forced = plan(ChatInput((Message("user", "x"),), specs, "required"), syntax)
    assert forced.trigger is None and len(forced.routes) == 2
    assert drive(forced.grammar, ids) and drive(forced.grammar, [tag, *ids])
    assert drive(forced.routes[0][1], ids) and not drive(forced.routes[1][1], ids)
    two = tok.encode(written + '; {"name": "GetLiveContext", "parameters": {}}', add_special_tokens=False)
    assert drive(forced.grammar, two)
    one = plan(ChatInput((Message("user", "x"),), specs, "required", parallel_tool_calls=False), syntax)
    assert not drive(one.grammar, two)
    for wrong in ('{"name":"HassTurnOn","parameters":{"name":"kitchen"}}',  # not the template's separators
                  '{"name": "HassTurnOn", "parameters": {}}', '{"name": "HassTurnOff", "parameters": {}}'):
        assert not drive(forced.grammar, tok.encode(wrong, add_special_tokens=False)), wrong
    auto = plan(ChatInput((Message("user", "x"),), specs), syntax)
    assert auto.trigger == '{"name": "' and auto.forced == forced.grammar
    for text, ok in [("Sure, it is on.", True), ("{ not a call }", True), (written, True),
                     (' {"name": "HassTurnOn"', False)]:  # the text cannot open as a call does
        assert drive(auto.grammar, tok.encode(text, add_special_tokens=False)) == ok, text
    named = plan(ChatInput((Message("user", "x"),), specs, ToolChoiceNamed("GetLiveContext")), syntax)
    assert not drive(named.grammar, ids)
    either = plan(ChatInput((Message("user", "x"),), specs, response_format=ResponseFormat("json_object")), syntax)
    for text, ok in [(written, True), ('{"answer":42}', True), ('{"name":"Bob"}', True),  # a call, or an object
                     ('{"parameters": {"name": "kitchen"}, "name": "HassTurnOn"}', False)]:
        assert drive(either.grammar, tok.encode(text, add_special_tokens=False)) == ok, text


# -- the parse -----------------------------------------------------------------------------------------------------


def parse(pieces: list[str], reason: str = "stop", legacy: bool = False):
    ex = JsonCallExtractor(True, legacy)
    deltas = [ex.push(p) for p in pieces] + [ex.finish(reason)]
    return ("".join(d.content for d in deltas), [(c.name, c.arguments) for d in deltas for c in d.calls],
            deltas[-1].finish_reason)


def every_cut(text: str) -> list[list[str]]:
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


@pytest.mark.parametrize(("text", "want"), [
    ('{"name": "HassTurnOn", "parameters": {"name": "lamp"}}', ("", [("HassTurnOn", '{"name":"lamp"}')])),
    ('<|python_tag|>{"name": "f", "arguments": {"a": [1, 2]}}', ("", [("f", '{"a":[1,2]}')])),
    ('\n{ "type": "function", "name": "f", "parameters": {} }', ("", [("f", "{}")])),
    ('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": "x; y"}}\n',
     ("", [("f", "{}"), ("g", '{"b":"x; y"}')])),
    ('{"name": "f", "parameters": "{\\"a\\": 1}"}', ("", [("f", '{"a": 1}')])),  # a string of JSON, as written
    ("Hello! {\"name\": \"f\"} is it.", ("Hello! {\"name\": \"f\"} is it.", [])),  # a call only opens an answer
    ('{"name": "Bob", "age": 3}', ('{"name": "Bob", "age": 3}', [])),  # an object, not a call
    ("{ not json", ("{ not json", [])),
])
def test_calls_are_parsed_at_every_cut(text, want):
    for pieces in every_cut(text):
        content, calls, finish = parse(pieces)
        assert (content, calls) == want, pieces
        assert finish == ("tool_calls" if want[1] else "stop")


def test_a_cut_call_is_dropped_with_length():
    assert parse(['{"name": "f", "param'], "length") == ("", [], "length")
    assert parse(['{"name": "f", "param'], "stop") == ("", [], "length")  # left open: the answer was cut
    assert parse(['{"na'], "length") == ("", [], "length")  # a forced call's first tokens
    assert parse(['{"name": "f", "parameters": {}}; {"na'], "length") == ("", [("f", "{}")], "tool_calls")
    assert parse(['{"name": "f", "parameters": {}}'], legacy=True)[2] == "function_call"
    ex = JsonCallExtractor(False)
    assert ex.push('{"name": "f", "parameters": {}}').content == '{"name": "f", "parameters": {}}'


# -- the HTTP API on a tiny Llama ----------------------------------------------------------------------------------


def serve(folder: Path, template: str):
    tok = llama3_tokenizer(template)
    make_tiny_model(folder, vocab_size=len(tok), max_position_embeddings=2048,
                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    tok.save_pretrained(folder)
    for stale in folder.glob("chat_template.json"):  # one template: the tokenizer's
        stale.unlink()
    app, service = controller_app(str(folder), served_model_name="llama")
    loop = LoopClient(app)

    def handle(request: httpx2.Request) -> httpx2.Response:
        r = loop.request(request.method, request.url.path, content=request.content,
                         headers={"content-type": "application/json"})
        return httpx2.Response(r.status_code, content=r.content, headers={"content-type": r.headers["content-type"]})

    sdk = openai.OpenAI(base_url="http://edgespec.test/v1", api_key="k", max_retries=0,
                        http_client=httpx2.Client(transport=httpx2.MockTransport(handle)))
    return sdk, loop, service, tok


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(openai client, tokenizer, service) of a tiny random Llama with Llama 3.2's template."""
    sdk, loop, service, tok = serve(tmp_path_factory.mktemp("llama32"), TEMPLATES["3.2"])
    yield sdk, tok, service
    loop.close()
    service.engine.close()


def create(sdk, messages=ASKED, **body):
    body = {"model": "llama", "messages": messages, "temperature": 0, "max_tokens": 160, "tools": TOOLS} | body
    r = sdk.chat.completions.create(**body)
    return [c.model_dump() for c in r] if body.get("stream") else r.model_dump()


def checked(tool_calls: list[dict]) -> list[tuple[str, dict]]:
    """(name, arguments) of each call: a listed tool, arguments that validate against its parameters."""
    out = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]
    for c, (name, args) in zip(tool_calls, out, strict=True):
        assert c["type"] == "function" and c["id"].startswith("call_") and name in PARAMS
        jsonschema.validate(args, PARAMS[name])
    return out


def joined(chunks: list[dict]) -> tuple[str, list[dict], str]:
    """A stream's content, calls (by OpenAI's accumulation rule) and finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for part in delta.get("tool_calls") or []:
            fn = part["function"]
            calls.setdefault(part["index"], {"id": part["id"], "type": "function",
                                             "function": {"name": fn["name"], "arguments": ""}})
            calls[part["index"]]["function"]["arguments"] += fn.get("arguments") or ""
        finish = chunk["choices"][0]["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_required_calls_whole_and_streamed(llama):
    sdk, _, _ = llama
    whole = create(sdk, tool_choice="required")
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = checked(choice["message"]["tool_calls"])
    assert calls and whole["decoding"]["tool_choice"]["route"]["chose"] == calls[0][0]
    content, streamed, finish = joined(create(sdk, tool_choice="required", stream=True))
    assert (content, finish) == ("", "tool_calls") and checked(streamed) == calls
    one = create(sdk, tool_choice="required", parallel_tool_calls=False)["choices"][0]["message"]["tool_calls"]
    assert len(one) == 1 and checked(one)[0] == calls[0]


def test_named_auto_and_none(llama):
    sdk, _, _ = llama
    named = create(sdk, tool_choice={"type": "function", "function": {"name": "GetLiveContext"}})
    assert checked(named["choices"][0]["message"]["tool_calls"])[0][0] == "GetLiveContext"
    auto = create(sdk, max_tokens=24)  # a random model: a call or text, either well formed
    choice, decided = auto["choices"][0], auto["decoding"]["tool_choice"]
    assert decided["call"] == (decided["trigger_logprob"] >= decided["threshold"])
    if choice["message"]["tool_calls"]:
        assert choice["finish_reason"] == "tool_calls" and checked(choice["message"]["tool_calls"])
    else:
        assert choice["finish_reason"] in ("stop", "length") and not choice["message"]["content"].lstrip().startswith(
            '{"name": "')
    none = create(sdk, tool_choice="none", max_tokens=8)["choices"][0]
    assert none["message"]["tool_calls"] is None and none["finish_reason"] in ("stop", "length")


def test_the_python_tag_before_a_call(llama):
    sdk, tok, _ = llama
    tag = tok.convert_tokens_to_ids("<|python_tag|>")
    r = create(sdk, tool_choice="required", parallel_tool_calls=False, logit_bias={str(tag): 100}, logprobs=True)
    choice = r["choices"][0]
    assert choice["logprobs"]["content"][0]["token"] == "<|python_tag|>"  # written first, then the call
    assert choice["finish_reason"] == "tool_calls" and len(checked(choice["message"]["tool_calls"])) == 1


def test_a_round_trip_with_the_tools_result(llama):
    sdk, tok, service = llama
    first = create(sdk, tool_choice="required", parallel_tool_calls=False)["choices"][0]["message"]
    made = first["tool_calls"][0]
    messages = [*ASKED, {"role": "assistant", "content": first["content"], "tool_calls": [made]},
                {"role": "tool", "tool_call_id": made["id"], "content": '{"success": true}'}]
    r = create(sdk, messages, max_tokens=8)
    assert r["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    prompt, _ = service.chat_prompt(chat_input(messages, tools=TOOLS))
    want = reference(tok, messages)
    assert prompt == tok.encode(want, add_special_tokens=False) and r["usage"]["prompt_tokens"] == len(prompt)
    # the call in the prompt is the answer's text: the grammar wrote it as the template does
    name, args = made["function"]["name"], json.loads(made["function"]["arguments"])
    assert f'<|end_header_id|>\n\n{{"name": "{name}", "parameters": {json.dumps(args)}}}<|eot_id|>' in want


def test_responses_function_call_items(llama):
    sdk, _, _ = llama
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"], "strict": False} for t in TOOLS]
    body = {"model": "llama", "input": ASKED[1]["content"], "instructions": ASKED[0]["content"], "tools": tools,
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 96}
    whole = sdk.responses.create(**body)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in PARAMS and whole.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), PARAMS[calls[0].name])
    with sdk.responses.stream(**body) as s:
        final = s.get_final_response()
    assert [(c.name, c.arguments) for c in final.output] == [(calls[0].name, calls[0].arguments)]
    follow = sdk.responses.create(**{**body, "tool_choice": "auto", "max_output_tokens": 8, "input": [
        {"role": "user", "content": ASKED[1]["content"]}, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"success": true}'}]})
    assert follow.status in ("completed", "incomplete")


def test_a_template_without_tools_gets_the_polyfill(tmp_path):
    sdk, loop, service, _ = serve(tmp_path, (DATA / "phi3.5_chat_template.jinja").read_text())
    try:
        assert not service.template.native and service.template.syntax == SMOLLM2
        r = create(sdk, tool_choice="required", parallel_tool_calls=False)
        assert r["choices"][0]["finish_reason"] == "tool_calls"
        assert len(checked(r["choices"][0]["message"]["tool_calls"])) == 1
        prompt, _ = service.chat_prompt(chat_input(ASKED, tools=TOOLS))
        assert "<tool_call>[" in service.tokenizer.decode(prompt)  # SmolLM2's trained block, in the system turn
    finally:
        loop.close()
        service.engine.close()

