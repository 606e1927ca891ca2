"""A chat request as the routes hand it to the tools layer, whichever API it came through (chat completions, the
legacy functions fields, or the Responses API), and what comes back out of a generation.

Plain data, no I/O: server/tool_prompt.py renders a ChatInput as the prompt, server/structured.py builds the
grammar its tools and response format need, and server/tool_output.py turns the generated text back into
content and ToolCalls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: its name, description and JSON schema of the arguments (an object)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True)
class ToolCall:
    """A call the model made (or made in an earlier turn): arguments as a compact JSON string."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    """One turn. role: system (developer is mapped to it), user, assistant or tool; content already joined
    from its parts ("" for none); an assistant turn may carry calls; a tool turn answers call tool_call_id
    (name: the function's name, when the client gave it)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ToolChoiceNamed:
    """tool_choice naming the one tool to call."""

    name: str


@dataclass(frozen=True)
class ResponseFormat:
    """`response_format` / Responses `text.format`: json_object (any JSON object) or json_schema (schema)."""

    type: Literal["json_object", "json_schema"]
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = False


@dataclass(frozen=True)
class ChatInput:
    """Everything that decides the prompt and the grammar of one chat request."""

    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceNamed = "auto"
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    legacy_functions: bool = False  # asked through `functions`: answered as message.function_call
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs: enable_thinking, ...

    @property
    def calls_allowed(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass
class ChatDelta:
    """What one step of a generation adds to the answer: visible content, calls completed in it, thinking
    (`reasoning`, a reasoning model's; server/reasoning.py), and (on the last delta) the finish reason: stop,
    length, or tool_calls / function_call when a call was made."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    tokens: int = 0  # tokens generated in the step
    logprobs: list = field(default_factory=list)  # decoding.types.TokenLogprob of those tokens, when asked
    stats: dict | None = None  # the generation's `decoding` statistics, on the last delta
    reasoning: str = ""
