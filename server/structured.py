"""The grammar a chat request's output must follow: its tool calls and its response format, as llguidance
lark grammars (../shared/notes/tools.md, §3.4).

JSON is compact (`{"a":1}`): no whitespace is allowed anywhere in it, so no tokens go to spaces; bare JSON calls
(Llama 3.x) alone are written in their template's separators (`{"a": 1, "b": 2}`), as it shows them back. Every
grammar ends where the output is complete; the matcher then allows only EOS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

from edgespec.server.chat_input import ChatInput, ResponseFormat, ToolChoiceNamed, ToolSpec
from edgespec.server.json_schema import close_schema, compact
from edgespec.server.reasoning import ThinkBlock
from edgespec.server.tool_prompt import CallSyntax, JsonCalls, Syntax

PARALLEL_CALLS = 4  # most calls in one answer when parallel_tool_calls is on
TOOL_MAX_ITEMS = 3  # caps inside call arguments: with them 6/8 HA commands finished, without 3/8 (the notes, §2)
TOOL_MAX_LENGTH = 48
# Response formats: arrays capped (the model loops in them), and strings where the client set no maxLength: the
# 135M model's answers ran on until max_tokens cut the JSON (6 of 8 structured prompts at 128 tokens, "1. 1. 1."
# in one), and a cut document does not parse. A client that wants longer strings says so in its schema.
RESPONSE_MAX_ITEMS = 8
RESPONSE_MAX_LENGTH = 256

# tool_choice auto: free text that does not contain the open tag, or such text, the tag and the calls. TEXT_OPEN
# can only end at the first tag, so after it the calls are enforced: a malformed call cannot pass as text.
_TEXT_OR_CALLS = "\n".join([
    "start: TEXT | TEXT_OPEN calls",
    "TEXT: ANY & ~(ANY OPEN ANY)",
    "TEXT_OPEN: TEXT OPEN",
    "ANY: /(?s:.*)/",
])
# Text after tool results were shown in tags: words that open with a character of their own (not "<", not
# nothing). Measured on Home Assistant's results (greedy, the 135M model): after a result the model opened its
# text by copying the result block, markup and all, or writing one of its own (6 of 6 with the result in a user
# turn; 2 of 4 text answers with it in the assistant's turn, tool_prompt.py); its next likeliest openings were
# words ("Yes, it did."). An empty answer is no way out: Home Assistant's OpenAI integration (2025.4.4) asks
# again, ten times, then fails the turn. A call after results is the trigger's alone: a text branch that still
# offered the tag turned the refused "<" into a call (after GetLiveContext's result, GetLiveContext again).
_SPOKEN = "\n".join([
    "start: TEXT",
    "TEXT: /[ \\t\\n]*[^< \\t\\n](?s:.*)/ & ~(ANY OPEN ANY)",
    "ANY: /(?s:.*)/",
])
# tool_choice auto with bare JSON calls (JsonCalls): free text that does not open as a call does, or the calls.
# The calls are the whole answer (llama.cpp reads a Llama 3.x call only at the start, too), so a text that
# starts like one is refused and a malformed call cannot pass as text.
_JSON_TEXT = 'TEXT: /(?s:.*)/ & ~(/[ \\t\\n]*/ {head} /(?s:.*)/)'
# Keywords that give an object schema a shape; a tool's parameters with none of them take no arguments.
_SHAPE_KEYWORDS = ("properties", "additionalProperties", "patternProperties", "anyOf", "oneOf", "allOf", "$ref",
                   "required", "minProperties")


@dataclass(frozen=True)
class GrammarPlan:
    """How to constrain one generation. `grammar`: the lark grammar the whole output must match. With
    tool_choice auto, the service scores the log-probability of `trigger` right after the prompt and, above
    its threshold, generates under `forced` (the calls only) instead: a 135M model rarely opens a call by
    itself (log P("<tool_call>[") was -4.6..-6.5 for device commands, -8.2..-16.4 for chit-chat)."""

    grammar: str
    forced: str | None = None
    trigger: str | None = None
    routes: tuple[tuple[str, str], ...] = ()  # several tools: (name, the calls grammar whose first is that tool)


class GrammarError(ValueError):
    """The request's tools, tool_choice or response_format cannot be turned into a grammar; `param` names the
    request parameter at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def plan(chat: ChatInput, syntax: Syntax, thinking: ThinkBlock | None = None) -> GrammarPlan | None:
    """The grammars for `chat` with calls written in `syntax`, after the thinking block of a model that thinks;
    None when its output is free text. GrammarError: a named tool that is not listed, required/named with no tools, or
    a schema llguidance cannot compile.

    A thinking model decides after its thinking whether and which tool to call, so its plan is the one grammar:
    no trigger scored and no route chosen right after the prompt, before it has thought."""
    planned = _plan(chat, syntax)
    if planned is None or thinking is None:
        return planned
    head, _, rules = planned.grammar.partition("\n")
    return GrammarPlan(thinking.grammar(head.removeprefix("start: "), rules))


def _plan(chat: ChatInput, syntax: Syntax) -> GrammarPlan | None:
    forcing = chat.tool_choice == "required" or isinstance(chat.tool_choice, ToolChoiceNamed)
    if forcing and not chat.tools:
        raise GrammarError("tool_choice asks for a tool call, but the request lists no tools", "tool_choice")
    fmt = chat.response_format
    json_rules = _response_rules(fmt) if fmt is not None else None
    # after results shown in a call tag's format, text opens with words (_SPOKEN), unless it is a response format
    spoken = isinstance(syntax, CallSyntax) and json_rules is None and any(m.role == "tool" for m in chat.messages)
    if not chat.calls_allowed:
        if spoken:
            return GrammarPlan(f'{_SPOKEN}\nOPEN: {json.dumps(syntax.open)}')
        return None if json_rules is None else GrammarPlan(f"start: json\n{json_rules}")
    max_calls = PARALLEL_CALLS if chat.parallel_tool_calls and not chat.legacy_functions else 1
    tools = _chosen_tools(chat)
    if isinstance(syntax, JsonCalls):
        return _json_calls_plan(tools, syntax, max_calls, forcing, json_rules)
    call_rules = _call_rules(tools, syntax, max_calls)
    forced = f"start: OPEN calls\n{call_rules}"
    routes = _routes(tools, "start: OPEN calls", lambda first: _call_rules(tools, syntax, max_calls, first))
    if forcing:
        return GrammarPlan(forced, routes=routes)
    trigger = syntax.open + ("[" if syntax.array else "")
    if json_rules is not None:
        return GrammarPlan(f"start: json | OPEN calls\n{json_rules}\n{call_rules}", forced, trigger, routes)
    if spoken:
        return GrammarPlan(f"{_SPOKEN}\n{call_rules}", forced, trigger, routes)
    return GrammarPlan(f"{_TEXT_OR_CALLS}\n{call_rules}", forced, trigger, routes)


def _json_calls_plan(tools: tuple[ToolSpec, ...], syntax: JsonCalls, max_calls: int, forcing: bool,
                     json_rules: str | None) -> GrammarPlan:
    """_plan for bare JSON calls, which are the whole answer: its free text is text that does not open as one."""
    call_rules = _json_call_rules(tools, syntax, max_calls)
    forced = f"start: calls\n{call_rules}"
    routes = _routes(tools, "start: calls", lambda first: _json_call_rules(tools, syntax, max_calls, first))
    if forcing:
        return GrammarPlan(forced, routes=routes)
    if json_rules is not None:
        objects = _json_call_rules(tools, syntax, max_calls, objects=True)
        return GrammarPlan(f"start: json | calls\n{json_rules}\n{objects}", forced, syntax.head, routes)
    text = _JSON_TEXT.format(head=json.dumps(syntax.head))
    return GrammarPlan(f"start: TEXT | calls\n{text}\n{call_rules}", forced, syntax.head, routes)


def _routes(tools: tuple[ToolSpec, ...], start: str, rules: Callable[[int], str]) -> tuple[tuple[str, str], ...]:
    """With several tools, a grammar of calls per tool the first call must be (`start` then rules(i)): which
    tool a call opens with is decided before decoding (decoding/decide.py)."""
    return tuple((t.name, f"{start}\n{rules(i)}") for i, t in enumerate(tools)) if len(tools) > 1 else ()


def _chosen_tools(chat: ChatInput) -> tuple[ToolSpec, ...]:
    choice = chat.tool_choice
    if not isinstance(choice, ToolChoiceNamed):
        return chat.tools
    named = tuple(t for t in chat.tools if t.name == choice.name)
    if not named:
        listed = ", ".join(t.name for t in chat.tools)
        raise GrammarError(f"tool_choice names the function {choice.name!r}, which is not among the tools "
                           f"({listed})", "tool_choice")
    return named[:1]


def _response_rules(fmt: ResponseFormat) -> str:
    """The rule `json` for a response format, checked."""
    if fmt.type == "json_schema" and fmt.schema is not None:
        schema = close_schema(fmt.schema, max_items=RESPONSE_MAX_ITEMS, max_length=RESPONSE_MAX_LENGTH)
    else:
        schema = {"type": "object"}
    rules = f"json: %json{compact(_compact_json(schema))}"
    error = llguidance.LLMatcher.validate_grammar(f"start: json\n{rules}")
    if error:
        raise GrammarError(f"response_format: the schema cannot be used for generation: {_message(error)}",
                           "response_format")
    return rules


def _call_rules(tools: tuple[ToolSpec, ...], syntax: CallSyntax, max_calls: int, first: int | None = None) -> str:
    """Rules `OPEN` (the open tag) and `calls` (what follows it up to and including the last close tag) for at
    most `max_calls` calls of `tools`, checked; first: the index of the tool the first call must be (unchecked:
    its schema is one the plain rules checked)."""
    objects = [_call_object(t, i) for i, t in enumerate(tools)]
    close = json.dumps(syntax.close)
    rules = [f"OPEN: {json.dumps(syntax.open)}"]
    if syntax.array:
        array = {"type": "array", "minItems": 1, "maxItems": max_calls, "items": _any_of(objects)}
        if first is not None:
            array["prefixItems"] = [objects[first]]
        rules.append(f"calls: list {close}")
        rules.append(f"list: %json{compact(_compact_json(array))}")
    else:
        # One object per tag; a template in this style shows it on lines of its own, which the grammar allows.
        one = f'"\\n"? call "\\n"? {close}'
        more = f' ("\\n" OPEN {one}){{0,{max_calls - 1}}}' if max_calls > 1 else ""
        head = one if first is None else f'"\\n"? first_call "\\n"? {close}'
        rules.append(f"calls: {head}{more}")
        rules.append(f"call: %json{compact(_compact_json(_any_of(objects)))}")
        if first is not None:
            rules.append(f"first_call: %json{compact(_compact_json(objects[first]))}")
    text = "\n".join(rules)
    if first is None and llguidance.LLMatcher.validate_grammar(f"start: OPEN calls\n{text}"):
        raise _tool_error(tools, objects)
    return text


def _json_call_rules(tools: tuple[ToolSpec, ...], syntax: JsonCalls, max_calls: int, first: int | None = None,
                     objects: bool = False) -> str:
    """Rule `calls` for at most `max_calls` bare JSON calls of `tools` (JsonCalls), checked; first: as for
    _call_rules. Each call is written as the template writes a past one, `{"name": "f", "parameters": ARGS}`
    in its `tojson`'s separators (", " and ": "), so that an answer and its rendering in the next turn's prompt
    are the same text.

    The opening up to ARGS is one literal, so that free text (a lexeme that refuses that opening) and a call
    can start alike until the opening is whole; beside a response format's %json, which would take the `{`
    as its own, each call is a %json object instead (`objects`), whose keys keep their order."""
    head = "" if syntax.prefix_id is None else f"<[{syntax.prefix_id}]>? "  # <|python_tag|>, as the model likes
    one = "call" if first is None else f"call_{first}"
    more = f" ({json.dumps(syntax.separator)} call){{0,{max_calls - 1}}}" if max_calls > 1 else ""
    rules = [f"calls: {head}{one}{more}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    spaced = {"item_separator": ", ", "key_separator": ": "}
    for i, tool in enumerate(tools):
        if objects:
            rules.append(f"call_{i}: %json{compact(_json_options(_call_object(tool, i, syntax.args_key), **spaced))}")
            continue
        opening = f'{{"name": {json.dumps(tool.name, ensure_ascii=False)}, "{syntax.args_key}": '
        args = _json_options(_call_parameters(tool, i), **spaced)
        rules += [f'call_{i}: {json.dumps(opening)} args_{i} "}}"', f"args_{i}: %json{compact(args)}"]
    text = "\n".join(rules)
    if first is None and llguidance.LLMatcher.validate_grammar(f"start: calls\n{text}"):
        raise _tool_error(tools, [_call_object(t, i) for i, t in enumerate(tools)])
    return text


def _call_parameters(tool: ToolSpec, index: int) -> dict[str, Any]:
    """The schema of `tool`'s arguments, closed and capped."""
    params = tool.parameters or {}
    if not any(k in params for k in _SHAPE_KEYWORDS):
        params = {"type": "object", **params, "properties": {}}  # no parameters: the only arguments are {}
    params = close_schema(params, max_items=TOOL_MAX_ITEMS, max_length=TOOL_MAX_LENGTH)
    # Its own base URI, so that the client's local refs ("#/$defs/X") resolve inside it, not in our wrapper.
    params.setdefault("$id", f"urn:edgespec:tool:{index}")
    return params


def _call_object(tool: ToolSpec, index: int, args_key: str = "arguments") -> dict[str, Any]:
    """The schema of one call of `tool`: {"name": its name, args_key: its closed parameters}."""
    return {"type": "object", "properties": {"name": {"const": tool.name}, args_key: _call_parameters(tool, index)},
            "required": ["name", args_key], "additionalProperties": False}


def _tool_error(tools: tuple[ToolSpec, ...], objects: list[dict[str, Any]]) -> GrammarError:
    """Which tool's schema failed, found by checking each on its own."""
    for tool, obj in zip(tools, objects, strict=True):
        error = llguidance.LLMatcher.validate_grammar(f"start: %json{compact(_compact_json(obj))}")
        if error:
            return GrammarError(f"tools: the parameters of function {tool.name!r} cannot be used for generation: "
                                f"{_message(error)}", "tools")
    return GrammarError("tools: the tools' schemas cannot be combined into one grammar", "tools")


def _any_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return objects[0] if len(objects) == 1 else {"anyOf": objects}


def _compact_json(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with llguidance's option for compact JSON. It is only read at the top level of a %json block
    (a `%llguidance {...}` header does not reach it: 1.9.1 takes any key there and ignores it)."""
    return _json_options(schema)


def _json_options(schema: dict[str, Any], **separators: str) -> dict[str, Any]:
    """`schema` with llguidance's options for JSON without free whitespace: compact, or in `separators`
    (item_separator, key_separator) exactly."""
    options = schema.get("x-guidance")
    merged = {**(options if isinstance(options, dict) else {}), "whitespace_flexible": False, **separators}
    return {"x-guidance": merged, **{k: v for k, v in schema.items() if k != "x-guidance"}}


def _message(error: str) -> str:
    """llguidance's message on one line, without its position prefix, caret lines and the excerpt of our
    grammar (which would show the client a schema they did not write)."""
    lines = []
    for line in error.strip().splitlines():
        if re.match(r"\s*\d+ \| ", line):
            break
        if line.strip(" ^"):
            lines.append(line.strip())
    return re.sub(r"^at \d+\(\d+\): ", "", " ".join(lines))
