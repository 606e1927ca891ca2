"""The prompt of a chat request with tools: the model's own chat template where it can show tools and calls
(Qwen's and Hermes' `<tool_call>` tags, Llama 3.x's bare JSON calls), else a polyfill in SmolLM2's trained
function-calling format (../shared/notes/tools.md, §3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from edgespec.server.chat_input import ChatInput, Message, ToolCall, ToolSpec
from edgespec.server.json_schema import compact
from edgespec.server.reasoning import template_thinks


@dataclass(frozen=True)
class CallSyntax:
    """How calls appear in the model's text: between `open` and `close`, either one tag holding a JSON array of
    `{"name", "arguments"}` objects (array=True) or one tag per call holding one such object."""

    open: str
    close: str
    array: bool


SMOLLM2 = CallSyntax("<tool_call>", "</tool_call>", True)
HERMES = CallSyntax("<tool_call>", "</tool_call>", False)  # Qwen / Hermes templates; several calls: several tags

# How the polyfill shows a tool's result to the model (as Ollama's smollm2 template does); never an answer's text
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"

PYTHON_TAG = "<|python_tag|>"  # Llama 3.x's token before a call (3.1's built-in tools; 3.2 writes it before JSON too)


@dataclass(frozen=True)
class JsonCalls:
    """Calls written as bare JSON objects that are the whole answer, as Llama 3.1/3.2/3.3's templates write a
    past call: `{"name": "f", "parameters": {"a": 1}}` (`args_key`; "arguments" is read too), in the separators
    of the templates' `tojson`. The templates hold one call per assistant turn; several in one answer are
    separated by "; " (vLLM's llama3_json parser reads them so). `prefix_id`: the `<|python_tag|>` token, which
    the model may write before its calls (None: not in the vocabulary)."""

    args_key: str = "parameters"
    prefix_id: int | None = None
    separator: str = "; "
    head: str = '{"name": "'  # how every call opens: the trigger scored for tool_choice auto


Syntax = CallSyntax | JsonCalls

# SmolLM2's function-calling system prompt, word for word from its model card (the trailing spaces included):
# the 135M model was trained on it, and emits no call at all under a prompt of our own.
SMOLLM2_TOOL_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. \n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \n"
    "If none of the functions can be used, point it out and refuse to answer. \n"
    "If the given question lacks the parameters required by the function, also point it out.\n"
    "\n"
    "You have access to the following tools:\n"
    "<tools>{tools}</tools>\n"
    "\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct. If no function call is "
    "needed, please make the tool calls an empty list '[]'.\n"
    "<tool_call>[\n"
    '{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "... (more tool calls as required)\n"
    "]</tool_call>"
)

# Unusual names, so that finding them in a render means the template printed what it was given.
_PROBE_TOOL = "edgespec_probe_tool_q7x"
_PROBE_CALL = "edgespec_probe_call_k3z"
_CHANNEL_MARK = "edgespec_request_m8v"  # where the request goes in a route's context
# Llama 3.x's templates print today's date unless given one: the probe's renders must agree at midnight too
_PROBE_DATE = {"date_string": "26 Jul 2024"}


class ChatTemplate:
    """Renders a ChatInput with a tokenizer's chat template.

    The template is probed once, at construction: `native` when it shows both the tools it is given and a
    past call, in the `<tool_call>` format (its `syntax` is then HERMES) or as a bare JSON object that is the
    whole assistant turn (JsonCalls, Llama 3.x); otherwise the tools, calls and tool results are written into
    the messages in SmolLM2's format (syntax SMOLLM2). `thinks`: the model writes thinking blocks
    (server/reasoning.py).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.thinks = template_thinks(tokenizer)
        self.native = False
        self.syntax: Syntax = SMOLLM2
        probe_call = {"type": "function", "id": "call_probe", "function": {"name": _PROBE_CALL, "arguments": {}}}
        conversation = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [probe_call]},
            {"role": "tool", "tool_call_id": "call_probe", "name": _PROBE_CALL, "content": "ok"},
        ]
        try:
            shown_tools = self._apply(conversation[:1], True, tools=[_hf_tool(ToolSpec(_PROBE_TOOL, "probe"))],
                                      **_PROBE_DATE)
            shown_call = self._apply(conversation, False, **_PROBE_DATE)
            asked = self._apply(conversation[:1], True, **_PROBE_DATE)  # the user's turn and the generation prompt
        except Exception:  # a template that cannot render the probe cannot be trusted with tools
            return
        # A template that cannot show its own call format is not trusted either: the grammar and the parser
        # need to know it, so anything but these two formats falls back to the polyfill.
        if _PROBE_TOOL not in shown_tools or _PROBE_CALL not in shown_call:
            return
        if HERMES.open in shown_call:
            self.native, self.syntax = True, HERMES
        elif shown_call.startswith(asked) and (key := _json_call_key(shown_call[len(asked):])) is not None:
            vocab = tokenizer.get_vocab()
            self.native, self.syntax = True, JsonCalls(key, vocab.get(PYTHON_TAG))

    def render(self, chat: ChatInput) -> str:
        """The prompt text of `chat`, ending with the generation prompt. ValueError: the template rejected the
        conversation (an order of roles it does not allow, say), with its message."""
        if self.native:
            tools = [_hf_tool(t) for t in chat.tools] if chat.calls_allowed else None
            messages = [_hf_message(m) for m in chat.messages]
            if isinstance(self.syntax, JsonCalls):
                messages = _one_call_a_turn(messages)
        else:
            tools = None
            messages, going_on = _polyfill_messages(chat)
            if going_on:  # the answer after the results goes on in the turn that made the calls
                return self._continue(messages, **chat.template_kwargs)
        try:
            return self._apply(messages, True, tools=tools, **chat.template_kwargs)
        except Exception as exc:  # the template is the model's code; any failure is the request's
            raise ValueError(f"the chat template rejected the conversation: {exc}") from exc

    def channel_contexts(self, tools: tuple[ToolSpec, ...], notes: tuple[str, ...]) -> list[str]:
        """For each tool, the text before a user turn whose system message names the tool, its description and
        its note (what else the prompt says of it): the context under which the request's likelihood says how
        well the tool explains it (decoding/decide.py, the route)."""
        out = []
        for tool, note in zip(tools, notes, strict=True):
            described = f"{tool.name}: {tool.description}" if tool.description else tool.name
            out.append(self._channel(f"The user asks for this function: {' '.join(filter(None, [described, note]))}"))
        return out

    def channel_baseline(self) -> str:
        """The channel's context naming no function: what the request's tokens weigh without a tool, against
        which each tool's evidence is measured."""
        return self._channel("The user asks for a function.")

    def _channel(self, system: str) -> str:
        text = self._apply([{"role": "system", "content": system}, {"role": "user", "content": _CHANNEL_MARK}], False)
        return text[:text.index(_CHANNEL_MARK)]

    def answer_stops(self, chat: ChatInput) -> tuple[str, ...]:
        """Where an answer ends besides the client's stop sequences: with the polyfill, where the model starts a
        tool's result of its own (only the client writes results; after Home Assistant's GetLiveContext the
        135M model wrote one, a made-up state inside the polyfill's markup, as its reply)."""
        shown = chat.calls_allowed or any(m.role == "tool" for m in chat.messages)
        return (RESULT_OPEN,) if shown and not self.native else ()

    def _continue(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> str:
        """The prompt of `messages` ending inside the last (assistant) message, for the answer to go on there."""
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True,
                                                      **template_kwargs)
        except Exception as exc:  # the template is the model's code; any failure is the request's
            raise ValueError(f"the chat template rejected the conversation: {exc}") from exc

    def _apply(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **kwargs, **template_kwargs)


def _json_call_key(turn: str) -> str | None:
    """The arguments' key when `turn` (what the template wrote after the generation prompt) opens with the
    probe's call as a bare JSON object: `{"name": probe, KEY: {}}`; None otherwise."""
    try:
        value, _ = json.JSONDecoder().raw_decode(turn)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") != _PROBE_CALL or len(value) != 2:
        return None
    key = next(k for k in value if k != "name")
    return key if key in ("parameters", "arguments") and value[key] == {} else None


def _one_call_a_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant turn with several calls as consecutive turns of one call each: Llama 3.x's templates write
    one call a turn and raise on more ("This model only supports single tool-calls at once!")."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        out += [{**m, "tool_calls": [c]} for c in calls] if len(calls) > 1 else [m]
    return out


def tool_block(tools: tuple[ToolSpec, ...]) -> str:
    """SmolLM2's function-calling system prompt listing `tools` (the client's parameter schemas as given)."""
    listed = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools]
    return SMOLLM2_TOOL_PROMPT.format(tools=compact(listed))


def _polyfill_messages(chat: ChatInput) -> tuple[list[dict[str, Any]], bool]:
    """The messages of `chat` in SmolLM2's function-calling format, and whether the prompt goes on in the last
    one (an assistant turn whose calls' results end the conversation) rather than in a new turn."""
    messages = list(chat.messages)
    out: list[dict[str, Any]] = []
    if chat.calls_allowed:
        # One system message at the start: the client's own leading system text, then the tool block. In this
        # order log P("<tool_call>[") separated Home Assistant's device commands (-4.7..-6.1) from chit-chat
        # (-7.7..-17.2); with the tool block first a command scored -10.4 and a chit-chat prompt -10.8.
        leading = 0
        while leading < len(messages) and messages[leading].role == "system":
            leading += 1
        parts = [m.content for m in messages[:leading] if m.content] + [tool_block(chat.tools)]
        out.append({"role": "system", "content": "\n\n".join(parts)})
        messages = messages[leading:]
    # A call, its results and what the assistant says after them are one assistant turn: the template has no
    # role for results. Measured on Home Assistant's requests (greedy, five results of its tools): with each
    # result in a user turn of its own, the 135M model answered as that user did, copying the result block,
    # markup and all, as the reply HA spoke (5 of 5); inside its own turn it wrote a sentence after both action
    # results, a new call after the error, and a result block of its own after GetLiveContext's two (text after
    # results now opens with words: structured.py, _SPOKEN).
    in_turn = False  # the last turn in `out` is an assistant's call turn that results and its answer extend
    for m in messages:
        if m.role == "tool" and in_turn:
            out[-1]["content"] += f"\n{RESULT_OPEN}\n{m.content}\n{RESULT_CLOSE}"
        elif m.role == "tool":  # a result of no call shown (a history that starts with one): a turn of its own
            out.append({"role": "user", "content": f"{RESULT_OPEN}\n{m.content}\n{RESULT_CLOSE}"})
        elif m.role == "assistant" and in_turn:
            out[-1]["content"] += "\n" + _assistant_text(m)
        else:
            out.append({"role": m.role, "content": _assistant_text(m) if m.role == "assistant" else m.content})
        in_turn = (m.role == "assistant" and bool(m.tool_calls)) or (m.role == "tool" and in_turn)
    going_on = bool(messages) and messages[-1].role == "tool" and in_turn
    if going_on:
        out[-1]["content"] += "\n"  # the answer goes on in the turn, on a line of its own
    return out, going_on


def _assistant_text(m: Message) -> str:
    """An assistant message's text and its calls, in SmolLM2's tag."""
    if not m.tool_calls:
        return m.content
    calls = compact([{"name": c.name, "arguments": _arguments(c)} for c in m.tool_calls])
    tag = f"{SMOLLM2.open}{calls}{SMOLLM2.close}"
    return f"{m.content}\n{tag}" if m.content else tag


def _arguments(call: ToolCall) -> Any:
    """A past call's arguments as JSON, or the raw string when the client sent something that is not JSON."""
    try:
        return json.loads(call.arguments)
    except ValueError:
        return call.arguments


def _hf_tool(tool: ToolSpec) -> dict[str, Any]:
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}}


def _hf_message(m: Message) -> dict[str, Any]:
    """`m` in the shape Hugging Face chat templates expect (content never None: some templates concatenate it)."""
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [{"type": "function", "id": c.id, "function": {"name": c.name, "arguments": _arguments(c)}}
                           for c in m.tool_calls]
    if m.role == "tool":
        d["tool_call_id"] = m.tool_call_id or ""
        if m.name:
            d["name"] = m.name
    return d
