"""OpenAI request bodies (pydantic) for chat and text completions, with the `decoding` extension; a chat
request's messages, tools, legacy functions and response format become one ChatInput (server/chat_input.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edgespec.server.chat_input import ChatInput, Message, ResponseFormat, ToolCall, ToolChoiceNamed, ToolSpec
from edgespec.server.errors import APIError

NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class APIModel(BaseModel):
    # Unknown fields (user, store, metadata, ...) are accepted and ignored, as clients send many.
    model_config = ConfigDict(extra="allow")


class StreamOptions(APIModel):
    include_usage: bool = False


class TextPart(APIModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(APIModel):
    """A call in an earlier assistant turn: arguments as the JSON string the API returned."""

    name: str
    arguments: str = "{}"


class ToolCallIn(APIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(APIModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    function_call: FunctionCallIn | None = None  # assistant, legacy
    tool_call_id: str | None = None  # tool

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def message(self) -> Message:
        """As the tools layer takes it: developer is system; a legacy function result is a tool result."""
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ())
        if self.function_call is not None:
            calls += (ToolCall(f"call_{self.function_call.name}", self.function_call.name,
                               self.function_call.arguments),)
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        call_id = self.tool_call_id or (f"call_{self.name}" if self.role == "function" else None)
        return Message(role, self.text(), calls, call_id, self.name if role == "tool" else None)


class FunctionSpec(APIModel):
    name: str = Field(pattern=NAME)
    description: str = ""
    parameters: dict[str, Any] | None = None

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description, self.parameters or {"type": "object", "properties": {}})


class ToolIn(APIModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(APIModel):
    name: str


class NamedTool(APIModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(APIModel):
    name: str = "response"
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = False
    description: str | None = None


class ResponseFormatIn(APIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormatIn:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response format needs its json_schema: {name, schema}")
        return self

    def format(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat("json_object")
        js = self.json_schema
        return ResponseFormat("json_schema", js.schema_, js.name, bool(js.strict))


class DecodingOption(APIModel):
    """The `decoding` request field in object form: {"policy": NAME, ...policy options}."""

    policy: str


class SamplingFields(APIModel):
    """Fields shared by chat and text completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1)
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    decoding: str | DecodingOption | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v):
        for key, value in (v or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def policy_choice(self) -> tuple[str | None, dict[str, Any]]:
        """(policy name or None for the server default, policy options)."""
        if self.decoding is None:
            return None, {}
        if isinstance(self.decoding, str):
            return self.decoding, {}
        options = dict(self.decoding.model_extra or {})
        return self.decoding.policy, options


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    functions: list[FunctionSpec] | None = None  # the legacy form of tools
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    response_format: ResponseFormatIn | None = None

    def chat_input(self) -> ChatInput:
        """The messages, tools and response format as the tools layer takes them (APIError for a
        contradiction between fields)."""
        legacy = self.functions is not None
        if legacy and self.tools is not None:
            raise APIError(400, "send tools or the legacy functions, not both", "functions", "invalid_value")
        if legacy:
            specs, choice, parallel = [f.spec() for f in self.functions], self.function_call, False
        else:
            specs, choice = [t.function.spec() for t in self.tools or ()], self.tool_choice
            parallel = self.parallel_tool_calls
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise APIError(400, "tool names must be unique", "functions" if legacy else "tools", "invalid_value")
        if isinstance(choice, NamedTool | NamedFunction):
            choice = ToolChoiceNamed(choice.function.name if isinstance(choice, NamedTool) else choice.name)
        fmt = self.response_format.format() if self.response_format is not None else None
        return ChatInput(tuple(m.message() for m in self.messages), tuple(specs), choice or "auto", parallel, fmt,
                         legacy)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return v[0]
        return v


class JoinRequest(BaseModel):
    """A worker announcing itself to the controller (POST /internal/cluster/join, cluster token)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=2048, description="base URL at which the controller reaches it")
    name: str = Field(min_length=1, max_length=128)


class EmbeddingRequest(APIModel):
    """POST /v1/embeddings: a string, a list of strings, token ids, or a list of token-id lists."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    def inputs(self) -> list[str | list[int]]:
        """The input as a list of items, each a string or a list of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(t, int) for t in self.input):
            return [list(self.input)]
        return list(self.input)
