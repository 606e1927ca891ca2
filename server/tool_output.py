"""Generated text back into thinking, content and tool calls, as it streams (../shared/notes/tools.md, §3.5-3.6).

Calls are emitted whole, once their close tag (or, for bare JSON calls, their object's last brace) arrives: a
streaming client gets one delta per complete call, as Ollama sends them, and a generation cut inside a call
leaves no partial call behind.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from edgespec.decoding.text import partial_suffix
from edgespec.server.chat_input import ChatDelta, ToolCall
from edgespec.server.json_schema import compact
from edgespec.server.reasoning import ThinkSplitter
from edgespec.server.tool_prompt import PYTHON_TAG, CallSyntax, JsonCalls, Syntax

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style call id: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def content_or_none(text: str) -> str | None:
    """A non-streamed message's content: None when there is nothing but whitespace."""
    return None if text.strip() == "" else text


def finish_reason(cut: bool, made_call: bool, legacy: bool, reason: str) -> str:
    """An answer's finish reason: "length" for a call cut off, the call's reason after a call, else `reason`."""
    if cut:
        return "length"
    if made_call:
        return "function_call" if legacy else "tool_calls"
    return reason


class CallExtractor:
    """Splits one generation's text into content and calls.

    Text that could still become the open tag is held back, as with stop strings; text inside a call is never
    shown. Trailing whitespace is held until more content follows, so the newlines around and between calls
    never reach the client when a call is made. With `enabled` False (no calls allowed) every piece of
    text is content at once.
    """

    def __init__(self, syntax: CallSyntax, enabled: bool, legacy: bool = False):
        self.syntax = syntax
        self.enabled = enabled
        self.legacy = legacy
        self.made_call = False
        self._pending = ""  # outside a call: text that may be the start of the open tag
        self._blank = ""  # trailing whitespace of the content, not shown yet
        self._call: str | None = None  # inside a call: its text so far

    def push(self, text: str) -> ChatDelta:
        """The content that may be shown after `text`, and the calls it completed."""
        if not self.enabled:
            return ChatDelta(content=text)
        content: list[str] = []
        calls: list[ToolCall] = []
        rest = self._pending + text
        self._pending = ""
        while rest:
            if self._call is None:
                at = rest.find(self.syntax.open)
                if at < 0:
                    keep = partial_suffix(rest, self.syntax.open)
                    content.append(self._visible(rest[:len(rest) - keep]))
                    self._pending = rest[len(rest) - keep:]
                    break
                content.append(self._visible(rest[:at]))
                self._call, rest = "", rest[at + len(self.syntax.open):]
            else:
                block = self._call + rest
                end = block.find(self.syntax.close)
                if end < 0:
                    self._call = block
                    break
                self._call, rest = None, block[end + len(self.syntax.close):]
                parsed = self._parse(block[:end])
                if parsed is None:  # not a call after all (only possible without a grammar): show it as it was
                    content.append(self._visible(self.syntax.open + block[:end] + self.syntax.close))
                else:
                    calls.extend(parsed)
        if calls:
            self.made_call = True
        return ChatDelta(content="".join(content), calls=calls)

    def finish(self, reason: str) -> ChatDelta:
        """The content still held and the finish reason: "tool_calls" ("function_call" when asked through the
        legacy functions fields) if any call was made; "length" if the generation ended inside a call, or
        inside its open tag, whose partial text is dropped; else `reason`."""
        if not self.enabled:
            return ChatDelta(finish_reason=reason)
        cut = self._call is not None
        # Text held as a possible start of the open tag: cut there by max_tokens, it was a call on its way
        # (a forced call's first tokens are the tag), not content; at a stop it was text after all.
        tail = self._blank + (self._pending if reason != "length" else "")
        self._call, self._pending, self._blank = None, "", ""
        # The held trailing whitespace ends the text when no call was made; next to a call it is dropped.
        content = tail if not (self.made_call or cut) else tail.rstrip()
        return ChatDelta(content=content, finish_reason=finish_reason(cut, self.made_call, self.legacy, reason))

    def _visible(self, text: str) -> str:
        """`text` as content to show now: its trailing whitespace waits for what follows it, so that none is
        shown right before a call, whichever way the text was split into pushes."""
        held = self._blank + text
        shown = held.rstrip()
        self._blank = held[len(shown):]
        return shown

    def _parse(self, block: str) -> list[ToolCall] | None:
        """The calls in the text between two tags; None when it is not calls in this syntax. An empty array is
        the model saying that no function applies: no call."""
        try:
            value = json.loads(block)
        except ValueError:
            return None
        items = value if self.syntax.array else [value]
        if not isinstance(items, list) or not all(_is_call(item) for item in items):
            return None
        return [ToolCall(new_call_id(), item["name"], _arguments(item.get("arguments", {}))) for item in items]


# How a bare JSON call opens, whitespace removed: llama.cpp's pattern for Llama 3.x (`{"name": "`, with the OpenAI
# wrapper's "type" first if the model writes it), after the <|python_tag|> that Llama 3.2 may write as text.
_JSON_HEADS = tuple(tag + head for tag in ("", PYTHON_TAG)
                    for head in ('{"name":"', '{"type":"function","name":"'))
_CALL_SEPARATORS = " \t\r\n;"


class JsonCallExtractor:
    """Splits one generation's text into content and calls written as bare JSON objects (JsonCalls).

    An answer that opens as a call does (after whitespace) is calls: each is emitted once its object closes,
    and the separators between them (";" and whitespace) are dropped; `parameters` and `arguments` are both
    read. Any other answer is content, shown as it comes; so is an object that turns out not to be a call
    (possible only without a grammar). While the opening is undecided, the text is held.
    """

    def __init__(self, enabled: bool, legacy: bool = False):
        self.enabled = enabled
        self.legacy = legacy
        self.made_call = False
        self._state = "start"  # start: undecided; call: inside an object; content: the rest is text
        self._held = ""

    def push(self, text: str) -> ChatDelta:
        """The content that may be shown after `text`, and the calls it completed."""
        if not self.enabled or self._state == "content":
            return ChatDelta(content=text)
        self._held += text
        calls: list[ToolCall] = []
        while self._state != "content":
            if self._state == "start":
                if self.made_call:  # between calls
                    self._held = self._held.lstrip(_CALL_SEPARATORS)
                opening = _json_opening(self._held)
                if opening is None:
                    break
                self._state = "call" if opening else "content"
                if opening:
                    self._held = self._held[self._held.index("{"):]
                continue
            try:
                value, end = json.JSONDecoder().raw_decode(self._held)
            except ValueError:  # not closed yet
                break
            call = _json_call(value)
            if call is None:
                self._state = "content"
                continue
            calls.append(call)
            self._held, self._state, self.made_call = self._held[end:], "start", True
        content = ""
        if self._state == "content":
            content, self._held = self._held, ""
        return ChatDelta(content=content, calls=calls)

    def finish(self, reason: str) -> ChatDelta:
        """The text still held and the finish reason, by CallExtractor's rules: text held as a possible call's
        opening is dropped when max_tokens cut it (a forced call's first tokens), shown at a stop; a call the
        generation ended inside of is dropped, with "length"."""
        if not self.enabled:
            return ChatDelta(finish_reason=reason)
        held, state = self._held, self._state
        self._held, self._state = "", "content"
        cut = state == "call"
        content = held if state == "start" and reason != "length" and not self.made_call else ""
        return ChatDelta(content="" if not content.strip() else content,
                         finish_reason=finish_reason(cut, self.made_call, self.legacy, reason))


def _json_opening(text: str) -> bool | None:
    """Whether `text` opens as a bare JSON call does; None while it may still."""
    compact = "".join(text.split())
    if any(compact.startswith(head) for head in _JSON_HEADS):
        return True
    return None if any(head.startswith(compact) for head in _JSON_HEADS) else False


def _json_call(value: Any) -> ToolCall | None:
    """A bare JSON call as a ToolCall; None when `value` is not one."""
    if not _is_call(value) or set(value) - {"type", "name", "parameters", "arguments"}:
        return None
    args = value.get("parameters", value.get("arguments"))
    if not isinstance(args, dict | str) or value.get("type", "function") != "function":
        return None
    return ToolCall(new_call_id(), value["name"], _arguments(args))


def call_extractor(syntax: Syntax, enabled: bool, legacy: bool = False) -> CallExtractor | JsonCallExtractor:
    """The extractor of calls written in `syntax`."""
    if isinstance(syntax, JsonCalls):
        return JsonCallExtractor(enabled, legacy)
    return CallExtractor(syntax, enabled, legacy)


def _is_call(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"] != ""


def _arguments(value: Any) -> str:
    """Arguments as a compact JSON string; a model that wrote them as a string of JSON already is taken as is."""
    return value if isinstance(value, str) else compact(value)


class AnswerReader:
    """An answer's text as ChatDeltas: its thinking as `reasoning` (when the model thinks), the rest as content
    and calls (CallExtractor)."""

    def __init__(self, calls: CallExtractor | JsonCallExtractor, thinking: ThinkSplitter | None = None):
        self.calls, self.thinking = calls, thinking

    def push(self, text: str, finish_reason: str | None = None) -> ChatDelta:
        """The delta of one step's text; with the generation's finish reason, the held text too and the answer's
        own finish reason (CallExtractor's rules)."""
        reasoning, text = self.thinking.push(text) if self.thinking is not None else ("", text)
        if finish_reason is not None and self.thinking is not None:
            held_reasoning, held_text = self.thinking.finish()
            reasoning, text = reasoning + held_reasoning, text + held_text
        delta = self.calls.push(text)
        if finish_reason is not None:
            end = self.calls.finish(finish_reason)
            delta = ChatDelta(delta.content + end.content, delta.calls + end.calls, end.finish_reason)
        delta.reasoning = reasoning
        return delta
