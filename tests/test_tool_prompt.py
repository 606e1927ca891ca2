"""ChatTemplate: SmolLM2's template gets the polyfill; a Hermes-style template that shows tools and calls is
used natively."""

from __future__ import annotations

import copy
import json

import pytest
from model_fixtures import smollm2_folder
from transformers import AutoTokenizer

from edgespec.server.chat_input import ChatInput, Message, ToolCall, ToolSpec
from edgespec.server.tool_prompt import HERMES, SMOLLM2, SMOLLM2_TOOL_PROMPT, ChatTemplate, tool_block

HASS_TURN_ON = ToolSpec("HassTurnOn", "Turns on/opens a device or entity", {
    "type": "object", "strict": True,
    "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                   "domain": {"type": "array", "items": {"type": "string", "enum": ["light", "switch"]}}},
    "required": [],
})
GET_LIVE_CONTEXT = ToolSpec("GetLiveContext", "Current states of devices")
TOOLS = (HASS_TURN_ON, GET_LIVE_CONTEXT)

TURN = (
    Message("system", "You are a voice assistant for Home Assistant."),
    Message("user", "turn on the kitchen light"),
    Message("assistant", "", (ToolCall("call_1", "HassTurnOn", '{"name":"kitchen light"}'),
                              ToolCall("call_2", "GetLiveContext", "{}"))),
    Message("tool", '{"success":true}', tool_call_id="call_1", name="HassTurnOn"),
    Message("tool", "kitchen light: on", tool_call_id="call_2"),
    Message("user", "thanks"),
)

# A small Qwen/Hermes-style template: tools in the system turn, calls as <tool_call> objects, results as
# <tool_response> in a user turn; it refuses two user turns in a row.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Return each call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if loop.index0 > 0 and message.role == 'user' and messages[loop.index0 - 1].role == 'user' %}
{{- raise_exception('Conversation roles must alternate user/assistant') }}
{%- endif %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(smollm2_folder())


@pytest.fixture(scope="module")
def smol(tok):
    return ChatTemplate(tok)


@pytest.fixture(scope="module")
def hermes(tok):
    other = copy.copy(tok)  # a shallow copy: its own chat_template, the same vocabulary
    other.chat_template = HERMES_TEMPLATE
    return ChatTemplate(other)


def test_smollm2_template_is_not_native(smol):
    assert not smol.native and smol.syntax == SMOLLM2


def test_polyfill_puts_tools_and_the_clients_system_text_in_one_system_turn(smol):
    prompt = smol.render(ChatInput(TURN, TOOLS))
    assert prompt.count("<|im_start|>system") == 1
    system = prompt.split("<|im_end|>")[0]
    expected_tools = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in TOOLS]
    assert json.dumps(expected_tools, separators=(",", ":")) in system  # the client's schemas, "strict" and all
    # the client's text first: in this order the call's score separates commands from chit-chat
    assert system == "<|im_start|>system\nYou are a voice assistant for Home Assistant.\n\n" + tool_block(TOOLS)
    assert "You are a helpful AI assistant named SmolLM" not in prompt
    assert prompt.endswith("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")


def test_the_trained_prompt_word_for_word():
    """As SmolLM2's model card has it, trailing spaces on the first three lines included."""
    card = (
        "You are an expert in composing functions. You are given a question and a set of possible functions. \n"
        "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \n"
        "If none of the functions can be used, point it out and refuse to answer. \n"
        "If the given question lacks the parameters required by the function, also point it out.\n\n"
        "You have access to the following tools:\n<tools>TOOLS</tools>\n\n"
        "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
        "The example format is as follows. Please make sure the parameter type is correct. If no function call "
        "is needed, please make the tool calls an empty list '[]'.\n"
        '<tool_call>[\n{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
        "... (more tool calls as required)\n]</tool_call>"
    )
    assert SMOLLM2_TOOL_PROMPT.format(tools="TOOLS") == card


CALLS = ('<tool_call>[{"name":"HassTurnOn","arguments":{"name":"kitchen light"}},'
         '{"name":"GetLiveContext","arguments":{}}]</tool_call>')
RESULTS = '<tool_response>\n{"success":true}\n</tool_response>\n<tool_response>\nkitchen light: on\n</tool_response>'


def test_polyfill_past_calls_and_their_results_are_the_assistants_turn(smol):
    prompt = smol.render(ChatInput(TURN, TOOLS))
    assert f"<|im_start|>assistant\n{CALLS}\n{RESULTS}<|im_end|>\n<|im_start|>user\nthanks<|im_end|>" in prompt
    assert "<|im_start|>tool" not in prompt


def test_after_the_results_the_answer_goes_on_in_the_turn_of_the_calls(smol):
    """The prompt ends inside the assistant's turn, after its results, with no generation prompt of a new turn;
    what it said after them, later in the history, is part of that turn."""
    prompt = smol.render(ChatInput(TURN[:-1], TOOLS))
    assert prompt.endswith(f"<|im_start|>assistant\n{CALLS}\n{RESULTS}\n")
    answered = smol.render(ChatInput((*TURN[:-1], Message("assistant", "The light is on."), TURN[-1]), TOOLS))
    assert f"{CALLS}\n{RESULTS}\nThe light is on.<|im_end|>\n<|im_start|>user\nthanks" in answered


def test_a_result_with_no_call_before_it_is_a_turn_of_its_own(smol):
    prompt = smol.render(ChatInput((Message("tool", "on", tool_call_id="x"), Message("user", "and?")), TOOLS))
    assert "<|im_start|>user\n<tool_response>\non\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_an_answer_ends_where_the_model_writes_a_result_of_its_own(smol, hermes):
    assert smol.answer_stops(ChatInput(TURN, TOOLS)) == ("<tool_response>",)
    assert smol.answer_stops(ChatInput(TURN, TOOLS, tool_choice="none")) == ("<tool_response>",)  # results shown
    assert smol.answer_stops(ChatInput((Message("user", "hi"),))) == ()
    assert hermes.answer_stops(ChatInput(TURN, TOOLS)) == ()  # a native template's own format is its own


def test_polyfill_content_before_a_call_and_arguments_that_are_not_json(smol):
    said = Message("assistant", "On it.", (ToolCall("c", "HassTurnOn", "name=lamp"),))
    prompt = smol.render(ChatInput((Message("user", "lamp on"), said), TOOLS))
    assert 'On it.\n<tool_call>[{"name":"HassTurnOn","arguments":"name=lamp"}]</tool_call>' in prompt


def test_tool_choice_none_omits_the_tools(smol):
    prompt = smol.render(ChatInput(TURN, TOOLS, tool_choice="none"))
    assert "<tools>" not in prompt
    assert prompt.startswith("<|im_start|>system\nYou are a voice assistant for Home Assistant.<|im_end|>")
    assert "<tool_response>" in prompt  # the history is still shown in the polyfill's format


def test_without_a_system_message_the_tool_block_stands_alone(smol):
    prompt = smol.render(ChatInput((Message("user", "hi"),), TOOLS))
    assert prompt.startswith("<|im_start|>system\n" + tool_block(TOOLS) + "<|im_end|>")


def test_a_system_message_later_on_stays_where_it_is(smol):
    messages = (Message("user", "hi"), Message("assistant", "hello"), Message("system", "Be brief."),
                Message("user", "lights?"))
    prompt = smol.render(ChatInput(messages, TOOLS))
    assert prompt.count("<|im_start|>system") == 2
    assert "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>system\nBe brief.<|im_end|>" in prompt


def test_hermes_template_is_native(hermes):
    assert hermes.native and hermes.syntax == HERMES


def test_native_render_passes_tools_and_calls_through(hermes):
    prompt = hermes.render(ChatInput(TURN, TOOLS))
    assert '"name": "HassTurnOn"' in prompt and "# Tools" in prompt
    assert prompt.startswith("<|im_start|>system\nYou are a voice assistant for Home Assistant.\n\n# Tools")
    assert '<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "kitchen light"}}\n</tool_call>' in prompt
    assert "<tool_response>\nkitchen light: on\n</tool_response>" in prompt
    assert SMOLLM2_TOOL_PROMPT[:40] not in prompt
    assert "# Tools" not in hermes.render(ChatInput(TURN, TOOLS, tool_choice="none"))


def test_template_errors_are_value_errors(hermes):
    with pytest.raises(ValueError, match="roles must alternate"):
        hermes.render(ChatInput((Message("user", "a"), Message("user", "b")), TOOLS))


def test_a_template_that_cannot_render_the_probe_is_not_native(tok):
    broken = copy.copy(tok)
    broken.chat_template = "{{ raise_exception('no') }}"
    template = ChatTemplate(broken)
    assert not template.native and template.syntax == SMOLLM2
