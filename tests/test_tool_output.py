"""CallExtractor: streamed text back into content and whole calls."""

from __future__ import annotations

import json
import re

from edgespec.server.chat_input import ChatDelta
from edgespec.server.tool_output import CallExtractor, content_or_none, new_call_id
from edgespec.server.tool_prompt import HERMES, SMOLLM2

CALL = '<tool_call>[{"name":"HassTurnOn","arguments":{"name":"kitchen light","domain":["light"]}}]</tool_call>'


def _stream(extractor: CallExtractor, pieces, reason: str = "stop") -> tuple[list[ChatDelta], ChatDelta]:
    return [extractor.push(p) for p in pieces], extractor.finish(reason)


def _content(deltas, last) -> str:
    return "".join(d.content for d in deltas) + last.content


def _calls(deltas, last) -> list:
    return [c for d in deltas for c in d.calls] + last.calls


def test_disabled_passes_everything_through():
    ex = CallExtractor(SMOLLM2, enabled=False)
    assert ex.push("see <tool_").content == "see <tool_"
    assert ex.push("call>[]</tool_call>").content == "call>[]</tool_call>"
    assert ex.finish("stop") == ChatDelta(finish_reason="stop")


def test_plain_text_is_shown_as_it_comes():
    deltas, last = _stream(CallExtractor(SMOLLM2, enabled=True), ["Hello", " there", "! 1 < 2", "\n"])
    assert [d.content for d in deltas] == ["Hello", " there", "! 1 < 2", ""]
    assert last.finish_reason == "stop" and last.content == "\n" and last.calls == []


def test_content_then_call_char_by_char():
    """The tag is held back while it could still be one; nothing of the call is ever content."""
    text = "Sure, turning it on. " + CALL
    ex = CallExtractor(SMOLLM2, enabled=True)
    deltas = [ex.push(ch) for ch in text]
    shown = "".join(d.content for d in deltas)
    assert shown == "Sure, turning it on."  # the space before the call is not content either
    # '<' is held as soon as it arrives, not shown and then taken back
    assert "".join(d.content for d in deltas[:len("Sure, turning it on. ") + 1]) == "Sure, turning it on."
    made = [d for d in deltas if d.calls]
    assert len(made) == 1 and made[0] is deltas[-1]  # the call arrives whole, with its close tag
    call = made[0].calls[0]
    assert call.name == "HassTurnOn"
    assert json.loads(call.arguments) == {"name": "kitchen light", "domain": ["light"]}
    assert call.arguments == '{"name":"kitchen light","domain":["light"]}'
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
    last = ex.finish("stop")
    assert last.finish_reason == "tool_calls" and last.content == ""


def test_held_prefix_that_is_not_a_tag_is_released():
    deltas, last = _stream(CallExtractor(SMOLLM2, enabled=True), ["a <tool", "box> b <to"])
    assert [d.content for d in deltas] == ["a", " <toolbox> b"]
    assert last.content == " <to" and last.finish_reason == "stop"


def test_a_cut_inside_the_open_tag_shows_none_of_it():
    # max_tokens ended a forced call after "<tool": those tokens were the call's, not text
    for pieces in (["<", "tool"], ["Sure. <tool_"]):
        deltas, last = _stream(CallExtractor(SMOLLM2, enabled=True), pieces, reason="length")
        assert "<" not in _content(deltas, last) and last.finish_reason == "length" and not _calls(deltas, last)


def test_call_split_across_many_pushes():
    pieces = [CALL[i:i + 3] for i in range(0, len(CALL), 3)]
    deltas, last = _stream(CallExtractor(SMOLLM2, enabled=True), pieces)
    assert _content(deltas, last) == ""
    assert [c.name for c in _calls(deltas, last)] == ["HassTurnOn"]
    assert last.finish_reason == "tool_calls"


def test_two_calls_in_one_array_get_distinct_ids():
    text = ('<tool_call>[{"name":"HassTurnOn","arguments":{"area":"kitchen"}},'
            '{"name":"GetLiveContext","arguments":{}}]</tool_call>')
    deltas, last = _stream(CallExtractor(SMOLLM2, enabled=True), [text])
    calls = _calls(deltas, last)
    assert [(c.name, c.arguments) for c in calls] == [("HassTurnOn", '{"area":"kitchen"}'), ("GetLiveContext", "{}")]
    assert calls[0].id != calls[1].id


def test_the_models_trained_layout_parses_too():
    """Without a grammar SmolLM2 writes its prompt's layout: newlines and spaces inside the tag."""
    text = '\n<tool_call>[\n{"name": "HassTurnOff", "arguments": {"name": "fan"}}\n]</tool_call>\n'
    deltas, last = _stream(CallExtractor(SMOLLM2, enabled=True), [text])
    assert _content(deltas, last) == ""  # the newlines around the call are not content
    assert [(c.name, c.arguments) for c in _calls(deltas, last)] == [("HassTurnOff", '{"name":"fan"}')]


def test_empty_list_means_no_call():
    deltas, last = _stream(CallExtractor(SMOLLM2, enabled=True), ["<tool_call>[]</tool_call>"])
    assert _calls(deltas, last) == [] and _content(deltas, last) == ""
    assert last.finish_reason == "stop"


def test_length_cut_inside_a_call_drops_it():
    deltas, last = _stream(CallExtractor(SMOLLM2, enabled=True), ["Ok. ", CALL[:40]], reason="length")
    assert _content(deltas, last) == "Ok."
    assert _calls(deltas, last) == []
    assert last.finish_reason == "length"
    # even when the generation says it stopped, a call left open means the answer was cut
    _, last = _stream(CallExtractor(SMOLLM2, enabled=True), [CALL[:40]], reason="stop")
    assert last.finish_reason == "length"


def test_unparsable_block_is_content():
    text = "<tool_call>not json</tool_call>"
    deltas, last = _stream(CallExtractor(SMOLLM2, enabled=True), [text])
    assert _content(deltas, last) == text and _calls(deltas, last) == []
    assert last.finish_reason == "stop"


def test_legacy_functions_finish_with_function_call():
    _, last = _stream(CallExtractor(SMOLLM2, enabled=True, legacy=True), [CALL])
    assert last.finish_reason == "function_call"


def test_hermes_one_tag_per_call():
    text = ('<tool_call>\n{"name": "HassTurnOn", "arguments": {"name": "lamp"}}\n</tool_call>\n'
            '<tool_call>{"name":"HassLightSet","arguments":{"brightness":40}}</tool_call>')
    ex = CallExtractor(HERMES, enabled=True)
    deltas = [ex.push(text[i:i + 5]) for i in range(0, len(text), 5)]
    last = ex.finish("stop")
    assert _content(deltas, last) == ""  # not even the newline between the tags
    assert [(c.name, c.arguments) for c in _calls(deltas, last)] == [
        ("HassTurnOn", '{"name":"lamp"}'), ("HassLightSet", '{"brightness":40}')]
    assert last.finish_reason == "tool_calls"


def test_hermes_array_is_not_a_call():
    text = '<tool_call>[{"name":"HassTurnOn","arguments":{}}]</tool_call>'
    deltas, last = _stream(CallExtractor(HERMES, enabled=True), [text])
    assert _calls(deltas, last) == [] and _content(deltas, last) == text


def test_whitespace_alone_is_still_an_answer_without_calls():
    deltas, last = _stream(CallExtractor(SMOLLM2, enabled=True), ["\n", " "])
    assert _content(deltas, last) == "\n "
    deltas, last = _stream(CallExtractor(SMOLLM2, enabled=True), ["\n", "Hi"])
    assert [d.content for d in deltas] == ["", "\nHi"]


def test_content_or_none():
    assert content_or_none("") is None
    assert content_or_none(" \n") is None
    assert content_or_none(" hi ") == " hi "


def test_call_ids_are_random():
    assert len({new_call_id() for _ in range(50)}) == 50
