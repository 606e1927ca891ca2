"""Ollama API request bodies (pydantic), as ollama/ollama's api/types.go and docs/api.md define them, and their
translation into what the OpenAI routes hand the service: a ChatInput (server/chat_input.py) and SamplingFields.

Unknown fields and unknown `options` are accepted and ignored, as Ollama's own server ignores them (it only logs an
unknown option); a field this server cannot honour (images, a Go `template`, `suffix`, `typical_p`) is refused by
name with a 400, so that a client learns at once rather than getting an answer that ignored part of its request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from edgespec.server.chat_input import ChatInput, Message, ResponseFormat, ToolCall
from edgespec.server.json_schema import compact
from edgespec.server.protocol import (
    INT64,
    MAX_EMBEDDING_INPUTS,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_TOOLS,
    APIModel,
    CheckedBody,
    DecodingOption,
    FunctionSpec,
    SamplingFields,
    invalid,
)
from edgespec.server.service import MIN_TOP_P

THINK_LEVELS = ("low", "medium", "high", "max")  # Ollama's `think` strings; this server cannot set a level
MAX_STOPS = 4  # as the OpenAI routes (server/protocol.py): a stop check per token each
# Ollama's sampling defaults (api.DefaultOptions) for what `options` leaves unset; a client of the Ollama API gets
# the answers it would get from Ollama's settings, not the OpenAI routes' (temperature 1, no top_k, top_p 1)
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9
UNSEEDED = -1  # Ollama's seed for "random"

Think = bool | Literal["low", "medium", "high", "max"]
Format = Literal["", "json"] | dict[str, Any]
KeepAlive = float | str  # "5m", "300s", -1 (forever) or a number of seconds: accepted, the model stays loaded


class OllamaOptions(APIModel):
    """`options`: the runtime ones this server applies. Load-time options (num_gpu, num_thread, num_batch, use_mmap,
    ...) and others Ollama itself no longer reads (mirostat, tfs_z, penalize_newline, ...) are extras, ignored;
    repeat_last_n is ignored too (the penalty covers everything generated)."""

    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)  # 0 keeps the likeliest token (llama.cpp's min_keep)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    num_predict: int | None = Field(None, description="tokens to generate at most; -1 or any value <= 0: up to the "
                                    "context window")
    stop: list[str] | None = Field(None, max_length=MAX_STOPS)
    repeat_penalty: float | None = Field(None, gt=0.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    num_ctx: int | None = Field(None, ge=1, description="the context window: prompt and answer together, at most "
                                "the model's context length")
    typical_p: float | None = Field(None, description="not supported: only 1.0 (off)")

    @field_validator("stop")
    @classmethod
    def _short_stops(cls, v):
        if any(len(s) > MAX_STOP_CHARS for s in v or ()):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _supported(self) -> OllamaOptions:
        if self.typical_p not in (None, 1.0):
            raise invalid("options.typical_p", "options.typical_p is not supported by this server (only 1.0, off)",
                          "unsupported_parameter")
        return self

    def max_tokens(self) -> int | None:
        """num_predict as a token budget; None: up to the context window (Ollama's -1 and -2)."""
        return self.num_predict if self.num_predict is not None and self.num_predict > 0 else None

    def window(self, context: int) -> int:
        """The tokens prompt and answer may take together: num_ctx, at most the model's context."""
        return min(self.num_ctx, context) if self.num_ctx is not None else context


def sampling_fields(model: str, stream: bool, options: OllamaOptions,
                    decoding: str | DecodingOption | None) -> SamplingFields:
    """The request in the OpenAI routes' terms, with Ollama's defaults for what `options` leaves unset."""
    o = options
    return SamplingFields.model_validate({
        "model": model, "stream": stream, "decoding": decoding,
        "temperature": DEFAULT_TEMPERATURE if o.temperature is None else o.temperature,
        "top_p": DEFAULT_TOP_P if o.top_p is None else max(o.top_p, MIN_TOP_P),
        "top_k": DEFAULT_TOP_K if o.top_k is None else o.top_k,
        "min_p": o.min_p or 0.0, "seed": None if o.seed in (None, UNSEEDED) else o.seed,
        "presence_penalty": o.presence_penalty or 0.0, "frequency_penalty": o.frequency_penalty or 0.0,
        "repetition_penalty": o.repeat_penalty or 1.0, "stop": o.stop})


class FunctionIn(APIModel):
    """A call in an earlier assistant turn: arguments as a JSON object, as Ollama returns them."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCallIn(APIModel):
    id: str | None = None  # Ollama 0.12's call ids; older clients send none
    function: FunctionIn


class OllamaMessage(APIModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[Any] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None  # a tool result: the tool that produced it
    tool_call_id: str | None = None
    thinking: str | None = None  # an earlier answer's thinking: not shown to the model again (Ollama drops it too)

    @field_validator("role", mode="before")
    @classmethod
    def _lower_role(cls, v):
        return v.lower() if isinstance(v, str) else v  # Ollama lowercases roles

    def message(self, index: int) -> Message:
        calls = tuple(ToolCall(c.id or f"call_{index}_{i}", c.function.name, compact(c.function.arguments))
                      for i, c in enumerate(self.tool_calls or ()))
        if self.role == "tool":
            return Message("tool", self.content or "", (), self.tool_call_id, self.tool_name)
        return Message(self.role, self.content or "", calls)


class OllamaTool(APIModel):
    type: Literal["function"] = "function"
    function: FunctionSpec


def _no_images(images: list[Any] | None, param: str) -> None:
    if images:
        raise invalid(param, f"{param}: this server's model reads text only; it cannot take images",
                      "unsupported_parameter")


def response_format(fmt: Format | None) -> ResponseFormat | None:
    """`format`: "json" (any JSON object) or a JSON schema, through the same grammar as response_format."""
    if not fmt:
        return None
    if fmt == "json":
        return ResponseFormat("json_object")
    assert isinstance(fmt, dict)
    return ResponseFormat("json_schema", fmt, "format")


class InferenceFields(CheckedBody):
    """What chat and generate share. `stream` defaults to true, as in Ollama."""

    model: str = ""
    stream: bool = True
    format: Format | None = None
    options: OllamaOptions = Field(default_factory=lambda: OllamaOptions.model_validate({}))
    think: Think | None = None
    keep_alive: KeepAlive | None = None
    truncate: bool = True  # Ollama 0.12: false refuses a prompt over the window rather than dropping old messages
    decoding: str | DecodingOption | None = None  # this server's extension, as in the OpenAI routes
    logprobs: bool = Field(False, description="not supported on the Ollama routes (the OpenAI routes return them)")
    top_logprobs: int = Field(0, description="not supported on the Ollama routes")

    @field_validator("options", mode="before")
    @classmethod
    def _null_options(cls, v):
        return {} if v is None else v

    @model_validator(mode="after")
    def _no_logprobs(self) -> InferenceFields:
        for name in ("logprobs", "top_logprobs"):
            if getattr(self, name):
                raise invalid(name, f"{name} is not supported on the Ollama routes: ask /v1/chat/completions",
                              "unsupported_parameter")
        return self

    def sampling(self) -> SamplingFields:
        return sampling_fields(self.model, self.stream, self.options, self.decoding)


class OllamaChatRequest(InferenceFields):
    """POST /api/chat."""

    messages: list[OllamaMessage] | None = Field(None, max_length=MAX_MESSAGES)
    tools: list[OllamaTool] | None = Field(None, max_length=MAX_TOOLS)

    @model_validator(mode="after")
    def _text_only(self) -> OllamaChatRequest:
        for i, m in enumerate(self.messages or ()):
            _no_images(m.images, f"messages.{i}.images")
        return self

    def chat_input(self, template_kwargs: dict[str, Any]) -> ChatInput:
        """The messages, tools and format as the tools layer takes them; tool_choice is Ollama's only one, auto."""
        specs = [t.function.spec() for t in self.tools or ()]
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise invalid("tools", "tool names must be unique")
        messages = tuple(m.message(i) for i, m in enumerate(self.messages or ()))
        return ChatInput(messages, tuple(specs), "auto", True, response_format(self.format), False, template_kwargs)


class OllamaGenerateRequest(InferenceFields):
    """POST /api/generate: a prompt, in the model's chat template (as a user turn after `system`) unless raw."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[int] | None = Field(None, description="an earlier answer's `context`: its text goes before the "
                                      "prompt")
    images: list[Any] | None = None
    suffix: str | None = Field(None, description="not supported: the served model does not insert")
    template: str | None = Field(None, description="not supported: prompts are rendered by the model's own chat "
                                 "template (send raw: true with a prompt you formatted)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _null_prompt(cls, v):
        return "" if v is None else v

    @model_validator(mode="after")
    def _supported(self) -> OllamaGenerateRequest:
        _no_images(self.images, "images")
        if self.suffix:
            raise invalid("suffix", "suffix is not supported: the served model does not insert text (no "
                          "fill-in-the-middle)", "unsupported_parameter")
        if self.template:
            raise invalid("template", "template is not supported: prompts are rendered by the model's own chat "
                          "template; send raw: true with a prompt you formatted", "unsupported_parameter")
        if self.raw and (self.system or self.context):
            raise invalid("raw", "raw mode does not support template, system, or context")  # Ollama's words
        return self

    def chat_input(self, template_kwargs: dict[str, Any]) -> ChatInput:
        """The prompt as Ollama's generate renders it: `system`, then the prompt as the user's turn."""
        messages = ((Message("system", self.system),) if self.system else ()) + (Message("user", self.prompt),)
        return ChatInput(messages, (), "auto", True, response_format(self.format), False, template_kwargs)


class OllamaEmbedRequest(CheckedBody):
    """POST /api/embed."""

    model: str = ""
    input: str | list[str] | None = None
    truncate: bool = True  # an input over the window is cut to it; false: refused
    dimensions: int | None = Field(None, ge=0, description="keep the first N dimensions (renormalized); 0: all")
    options: OllamaOptions = Field(default_factory=lambda: OllamaOptions.model_validate({}))
    keep_alive: KeepAlive | None = None

    @field_validator("input")
    @classmethod
    def _few_inputs(cls, v):
        if isinstance(v, list) and len(v) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        return v

    @field_validator("options", mode="before")
    @classmethod
    def _null_options(cls, v):
        return {} if v is None else v

    def inputs(self) -> list[str]:
        """The texts to embed; "" alone is no input (Ollama answers it with no embeddings)."""
        if isinstance(self.input, str):
            return [self.input] if self.input else []
        return list(self.input or ())


class OllamaEmbeddingsRequest(CheckedBody):
    """POST /api/embeddings, the older route: one prompt, one vector."""

    model: str = ""
    prompt: str = ""
    options: OllamaOptions = Field(default_factory=lambda: OllamaOptions.model_validate({}))
    keep_alive: KeepAlive | None = None

    @field_validator("options", "prompt", mode="before")
    @classmethod
    def _null_is_unset(cls, v, info):
        if v is None:
            return {} if info.field_name == "options" else ""
        return v


class ModelRequest(CheckedBody):
    """POST /api/show, /api/pull, /api/push, DELETE /api/delete: a model by `model` (or the older `name`)."""

    model: str = ""
    name: str = ""
    stream: bool = True
    verbose: bool = False
    insecure: bool = False

    @property
    def named(self) -> str:
        return self.model or self.name
