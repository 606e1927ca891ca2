"""A reasoning model's thinking, kept apart from its answer.

Qwen3 (and the other models whose chat template writes `<think>` blocks) answer with a thinking block first:
`<think>\\n...\\n</think>\\n\\n` and then the answer. The thinking goes to `reasoning_content` (llama.cpp's and
vLLM's field: `message.reasoning_content`, streamed as `delta.reasoning_content`) and to the Responses API's
reasoning items, never into the content; what follows the block is read for content and calls as any answer is.
A template may open the block itself (the prompt then ends inside it) or close an empty one when thinking is
switched off (`chat_template_kwargs: {"enable_thinking": false}`); both are read from the rendered prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgespec.decoding.text import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkBlock:
    """How one answer may think: the tags' token ids, and whether the prompt opened the block (the answer then
    starts inside it; else a block is optional)."""

    open_id: int
    close_id: int
    opened: bool

    def grammar(self, start: str, rules: str) -> str:
        """A lark grammar (server/structured.py) whose `start: {start}` follows the thinking block. The tags are
        also taken as their tokens: llguidance reads every added token as a special one, which no text matches.
        The thought cannot hold the close tag, so the answer's grammar holds from the close on."""
        think = "think_rest" if self.opened else "think?"
        return "\n".join([
            f"start: {think} ({start})",
            f'think: ("{OPEN}" | <[{self.open_id}]>) think_rest',
            f'think_rest: THOUGHT ("{CLOSE}" | <[{self.close_id}]>) THINK_SPACE',
            "THINK_SPACE: /[ \\t\\n]{0,2}/",  # Qwen3 writes "\\n\\n"; more would let the answer never begin
            f'THOUGHT: /(?s:.*)/ & ~(/(?s:.*)/ "{CLOSE}" /(?s:.*)/)',
            rules,
        ])


def template_thinks(tokenizer) -> bool:
    """Whether the model writes thinking blocks: both tags are tokens of its vocabulary and its chat template
    writes them (SmolLM2 has neither)."""
    vocab = tokenizer.get_vocab()
    return OPEN in vocab and CLOSE in vocab and OPEN in (getattr(tokenizer, "chat_template", None) or "")


def think_block(tokenizer, prompt: str) -> ThinkBlock:
    """The thinking block of an answer to `prompt` (rendered by a template that thinks): opened when the prompt
    ends inside one."""
    return ThinkBlock(tokenizer.convert_tokens_to_ids(OPEN), tokenizer.convert_tokens_to_ids(CLOSE),
                      prompt.rfind(OPEN) > prompt.rfind(CLOSE))


class ThinkSplitter:
    """Splits an answer's text, as it streams, into its leading thinking block and the rest.

    Only a block at the very start of the answer (after whitespace) is thinking; `inside`: the prompt opened it.
    The whitespace just inside the tags and after the close tag is not shown; text that may be the start of a
    tag is held until it is known not to be one.
    """

    def __init__(self, inside: bool):
        # start -> thinking -> closed (whitespace after the close tag dropped) -> answer, or start -> answer
        self._state = "thinking" if inside else "start"
        self._held = ""
        self._fresh = True  # nothing of the block shown yet: its leading whitespace is dropped
        self._blank = ""  # the thinking's trailing whitespace, shown only if more thinking follows

    def push(self, text: str) -> tuple[str, str]:
        """(thinking, answer) text that may be shown after `text`."""
        rest, self._held = self._held + text, ""
        thinking = ""
        if self._state == "start":
            stripped = rest.lstrip()
            if OPEN.startswith(stripped):  # whitespace, or the open tag's beginning: not known yet
                self._held = rest
                return "", ""
            if stripped.startswith(OPEN):
                self._state, rest = "thinking", stripped[len(OPEN):]
            else:
                self._state = "answer"
        if self._state == "thinking":
            at = rest.find(CLOSE)
            if at < 0:
                keep = partial_suffix(rest, CLOSE)
                self._held = rest[len(rest) - keep:]
                return self._thinking(rest[:len(rest) - keep]), ""
            thinking, rest = self._thinking(rest[:at]), rest[at + len(CLOSE):]
            self._state = "closed"
        if self._state == "closed":
            rest = rest.lstrip()
            if not rest:
                return thinking, ""
            self._state = "answer"
        return thinking, rest

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the answer: a lone partial tag was text after all."""
        held, self._held = self._held, ""
        if self._state == "thinking":
            return (self._blank + held if held else ""), ""
        if self._state == "start" and not held.strip():  # an answer of whitespace alone
            held = ""
        return "", held

    def _thinking(self, text: str) -> str:
        if self._fresh:
            text = text.lstrip()
            self._fresh = not text
        held = self._blank + text
        shown = held.rstrip()
        self._blank = held[len(shown):]
        return shown
