"""OpenAI request bodies (pydantic) for chat and text completions, with the `decoding` extension; a chat
request's messages, tools, legacy functions and response format become one ChatInput (server/chat_input.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from edgespec.server.chat_input import ChatInput, Message, ResponseFormat, ToolCall, ToolChoiceNamed, ToolSpec
from edgespec.server.errors import APIError

NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
# Bounds on what one request may list, beyond the body's byte limit (--max-request-bytes): each item costs work
# per request (a template turn, a grammar, a bias entry, a stop check per token, an engine sequence).
MAX_MESSAGES = 2048
MAX_TOOLS = 128  # OpenAI's own limit on tools
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit on one embeddings request
MAX_DEPTH = 64  # JSON nesting; the schema compiler and the tool prompt walk schemas recursively
INT64 = 2**63


class APIModel(BaseModel):
    # Unknown fields (user, store, metadata, ...) are accepted and ignored, as clients send many; the few that
    # would change the answer are refused by name (refuse_unsupported).
    model_config = ConfigDict(extra="allow")


def invalid(param: str, message: str, code: str = "invalid_value") -> PydanticCustomError:
    """A validation error naming `param` (a dotted path such as messages.0.content) and the error code;
    server/errors.py reports it as a 400 with that param and code."""
    return PydanticCustomError("edgespec_invalid", message, {"param": param, "code": code})


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone UTF-16 surrogate: JSON's \ud800 escapes can carry one
        return False
    return True


def check_body(data: Any) -> None:
    """Raises invalid() for a string or key anywhere in a parsed JSON body that is not Unicode text (a lone
    surrogate: tokenizers, grammars and our own JSON output cannot take it), or for nesting deeper than
    MAX_DEPTH. Iterative, so that a hostile body cannot exhaust the stack here; a path is spelled out only for
    a container or an error, and a long list of numbers or strings is checked at C speed (a 4 MiB body of token
    ids in well under a second)."""
    stack: list[tuple[Any, str | None, Any, int]] = [(data, None, None, 0)]  # value, parent's path, key, depth
    while stack:
        value, parent, key, depth = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                path = _path(parent, key)
                raise invalid(path, f"{path} is not valid Unicode text (it holds a lone UTF-16 surrogate)")
            continue
        if not isinstance(value, dict | list):
            continue
        path = _path(parent, key)
        if depth > MAX_DEPTH:
            top = path.split(".")[0]
            raise invalid(top, f"{top} is nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, list):
            kinds = set(map(type, value))
            texts = [item for item in value if type(item) is str] if str in kinds else []
            if texts and not _encodable("".join(texts)):
                i = next(i for i, item in enumerate(value) if type(item) is str and not _encodable(item))
                raise invalid(f"{path}.{i}", f"{path}.{i} is not valid Unicode text (it holds a lone UTF-16 surrogate)")
            if kinds & {dict, list}:
                stack.extend((item, path, i, depth + 1) for i, item in enumerate(value) if type(item) in (dict, list))
            continue
        for name, item in value.items():
            if not _encodable(name):  # reported at the parent: the key cannot be shown
                where = path or "body"
                raise invalid(where, f"a key in {where} is not valid Unicode text (a lone UTF-16 surrogate)")
            stack.append((item, path, name, depth + 1))


def _path(parent: str | None, key: Any) -> str:
    # "" for the body itself, then dotted: messages.0.content
    if parent is None:
        return ""
    return f"{parent}.{key}" if parent else str(key)


class CheckedBody(APIModel):
    """A request body: checked as a whole (check_body) before its fields are validated."""

    @model_validator(mode="before")
    @classmethod
    def _text_and_depth(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_body(data)
        return data


def refuse_unsupported(model: BaseModel, neutral: dict[str, Any]) -> None:
    """Raises invalid() naming the first parameter of `neutral` (name -> predicate true of the values that leave
    the answer as this server gives it) whose value asks for what this server does not implement. Declared fields
    and unknown extras alike: a client learns at once rather than getting an answer that silently ignored part of
    its request."""
    extra = model.model_extra or {}
    for name, ok in neutral.items():
        if name in type(model).model_fields:
            value = getattr(model, name)
        elif name in extra:
            value = extra[name]
        else:
            continue
        if not ok(value):
            raise invalid(name, f"{name}={_short(value)} is not supported by this server", "unsupported_parameter")


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)  # as the client wrote it: true, null
    return text if len(text) <= 80 else text[:77] + "..."


def _unset(value: Any) -> bool:
    return value is None


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


class SamplingFields(CheckedBody):
    """Fields shared by chat and text completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1)
    seed: int | None = Field(None, ge=-INT64, lt=INT64, description="a signed 64-bit integer")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # vLLM's and llama.cpp's extension (Ollama's repeat_penalty): 1 is off
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    decoding: str | DecodingOption | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in ([v] if isinstance(v, str) else v or ())):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
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


# what the server itself passes a chat template
TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation",
                                "continue_final_message", "return_dict", "chat_template"})


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    functions: list[FunctionSpec] | None = Field(None, max_length=MAX_TOOLS)  # the legacy form of tools
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    response_format: ResponseFormatIn | None = None
    # llama.cpp's and vLLM's extension: variables for the model's chat template ({"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # Refused unless unset: a text model cannot answer in audio or search the web
    audio: dict[str, Any] | None = Field(None, description="not supported: must be null")
    modalities: list[str] | None = Field(None, description="only ['text'] is supported")
    web_search_options: dict[str, Any] | None = Field(None, description="not supported: must be null")

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        refuse_unsupported(self, {"audio": _unset, "modalities": lambda v: v is None or set(v) <= {"text"},
                                  "web_search_options": _unset})
        return self

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
        kwargs = self.chat_template_kwargs or {}
        if reserved := sorted(set(kwargs) & TEMPLATE_ARGUMENTS):
            raise APIError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}: the request's own fields do",
                           "chat_template_kwargs", "invalid_value")
        return ChatInput(tuple(m.message() for m in self.messages), tuple(specs), choice or "auto", parallel, fmt,
                         legacy, kwargs)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = Field(False, description="return the prompt's text before the completion")
    suffix: str | None = Field(None, description="not supported (insertion): must be null")
    best_of: int | None = Field(None, ge=1, description="only 1 (= n) is supported")

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        refuse_unsupported(self, {"suffix": _unset, "best_of": lambda v: v is None or v == self.n})
        if self.echo and self.logprobs is not None:
            # OpenAI then returns the prompt tokens' logprobs too, which this server does not compute
            raise invalid("echo", "echo together with logprobs is not supported: send one of them",
                          "unsupported_parameter")
        return self

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return v[0]
        return v

    def prompt_given(self) -> str | list[int]:
        """The prompt as validated: its text or its token ids (_one_prompt made a list of one text the text)."""
        if isinstance(self.prompt, str):
            return self.prompt
        ids = [t for t in self.prompt if isinstance(t, int)]
        assert len(ids) == len(self.prompt), "_one_prompt leaves no list of texts"
        return ids


class JoinRequest(CheckedBody):
    """A worker announcing itself to the controller (POST /internal/cluster/join, cluster token)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=2048, description="base URL at which the controller reaches it")
    name: str = Field(min_length=1, max_length=128)


class EmbeddingRequest(CheckedBody):
    """POST /v1/embeddings: a string, a list of strings, token ids, or a list of token-id lists."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    @field_validator("input")
    @classmethod
    def _few_inputs(cls, v):
        # a list of token ids is one input; a list of strings or of id lists is one input per item
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        return v

    def inputs(self) -> list[str | list[int]]:
        """The input as a list of items, each a string or a list of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(t, int) for t in self.input):
            return [list(self.input)]
        return list(self.input)
