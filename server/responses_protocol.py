"""The Responses API request (POST /v1/responses) and its translation into the shared ChatInput.

Only what a text model can honour is accepted: function tools, text / JSON output, messages, function calls
and their outputs. Anything else (built-in tools, images, files, item references) is a 400 naming the
parameter, so a client learns at once rather than getting an answer that silently ignored part of its request.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from edgespec.server.chat_input import ChatInput, Message, ResponseFormat, ToolCall, ToolChoiceNamed, ToolSpec
from edgespec.server.errors import APIError
from edgespec.server.protocol import MAX_MESSAGES, MAX_TOOLS, CheckedBody, DecodingOption, refuse_unsupported

TEXT_PARTS = ("input_text", "output_text", "text")  # content parts whose `text` we read
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


# The Responses API's parameters that would change the answer in ways this server does not implement, with the
# values that leave it unchanged (refused by name otherwise)
UNSUPPORTED = {
    "background": lambda v: not v,  # answered later, by polling
    "conversation": lambda v: v is None,  # a conversation stored by OpenAI
    "prompt": lambda v: v is None,  # a prompt template stored by OpenAI
    "top_logprobs": lambda v: not v,
    "max_tool_calls": lambda v: v is None,
    "include": lambda v: not isinstance(v, list) or "message.output_text.logprobs" not in v,
}


class ResponsesRequest(CheckedBody):
    """POST /v1/responses. Unknown fields (user, metadata, reasoning, truncation, service_tier,
    prompt_cache_key, ...) are accepted and ignored; those in UNSUPPORTED are refused unless harmless. `input`
    items, `tools`, `tool_choice` and `text` are kept as sent and checked by to_chat_input, which names the
    parameter at fault."""

    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[Any] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True  # the API's default: the response may be continued with previous_response_id
    decoding: str | DecodingOption | None = None  # extension, as in chat completions

    @field_validator("tools", "tool_choice", mode="before")
    @classmethod
    def _null_is_default(cls, v, info):
        # some clients send explicit nulls for what they leave unset; the response echoes the default
        if v is None:
            return [] if info.field_name == "tools" else "auto"
        return v

    @field_validator("input")
    @classmethod
    def _few_items(cls, v):
        if isinstance(v, list) and len(v) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} input items")
        return v

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        refuse_unsupported(self, UNSUPPORTED)
        return self


def sampling_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The request in chat-completions terms (SamplingFields' names): model, temperature, top_p, max_tokens,
    stream and decoding, so that `SamplingFields(**sampling_fields(req))` validates."""
    decoding = req.decoding.model_dump() if isinstance(req.decoding, DecodingOption) else req.decoding
    return {"model": req.model, "temperature": req.temperature, "top_p": req.top_p,
            "max_tokens": req.max_output_tokens, "stream": req.stream, "decoding": decoding}


def to_chat_input(req: ResponsesRequest, history: tuple[Message, ...] = ()) -> ChatInput:
    """The request as a ChatInput: instructions as a leading system message, then `history` (the stored
    conversation of previous_response_id), then the input's messages. Raises APIError(400) naming the
    parameter for a shape this server does not accept."""
    tools = tuple(_tool(t, i) for i, t in enumerate(req.tools))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools must have distinct names", "tools", "invalid_value")
    messages = list(history) + _input_messages(req.input, history)
    if not messages:
        raise APIError(400, "input must not be empty", "input", "invalid_value")
    if req.instructions:
        messages.insert(0, Message("system", req.instructions))
    return ChatInput(messages=tuple(messages), tools=tools, tool_choice=_tool_choice(req.tool_choice, names),
                     parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text))


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param, "invalid_value")


def _tool(tool: Any, index: int) -> ToolSpec:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise _bad(f"tools[{index}] has type {kind!r}: this server supports only function tools "
                   "({\"type\": \"function\", \"name\", \"description\", \"parameters\"})", "tools")
    name, description = tool.get("name"), tool.get("description")
    if not isinstance(name, str) or not name:
        raise _bad(f"tools[{index}] needs a non-empty string `name`", "tools")
    if description is not None and not isinstance(description, str):
        raise _bad(f"tools[{index}].description must be a string", "tools")
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    elif not isinstance(parameters, dict):
        raise _bad(f"tools[{index}].parameters must be a JSON schema object", "tools")
    return ToolSpec(name=name, description=description or "", parameters=parameters)


def _tool_choice(choice: Any, names: list[str]):
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad(f"tool_choice must be 'auto', 'none', 'required' or a function, not {choice!r}",
                       "tool_choice")
        if choice == "required" and not names:
            raise _bad("tool_choice 'required' needs at least one tool in `tools`", "tool_choice")
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise _bad("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
                   "tool_choice")
    if choice["name"] not in names:
        raise _bad(f"tool_choice names the function {choice['name']!r}, which is not in `tools`", "tool_choice")
    return ToolChoiceNamed(choice["name"])


def _response_format(text: dict[str, Any] | None) -> ResponseFormat | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format must be an object such as {\"type\": \"text\"}", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise _bad(f"text.format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}", "text.format")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise _bad("text.format of type json_schema needs a `schema` object", "text.format.schema")
    name = fmt.get("name")
    return ResponseFormat("json_schema", schema=schema, name=name if isinstance(name, str) else None,
                          strict=bool(fmt.get("strict")))


def _text(content: Any, where: str, required: bool = False) -> str:
    """A message's content or a call's output (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if content is None and not required:
        return ""
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}] is a {kind!r} part: this server accepts only text parts "
                       f"({', '.join(TEXT_PARTS)}) with a string `text`", "input")
        texts.append(part["text"])
    return "".join(texts)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where} needs a string `{key}`", "input")
    return value


def _input_messages(items: str | list[Any], history: tuple[Message, ...]) -> list[Message]:
    """The input items as Messages. Consecutive function_call items, and the assistant message just before
    them, become one assistant turn (as chat templates expect calls to belong to the turn that made them)."""
    if isinstance(items, str):
        return [Message("user", items)]
    call_names = {c.id: c.name for m in history for c in m.tool_calls}
    out: list[Message] = []
    joinable = False  # the last message is an assistant turn from this input that calls may join
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object (a message, function_call or function_call_output item)", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise _bad(f"{where}.role must be user, assistant, system or developer, not {item.get('role')!r}",
                           "input")
            out.append(Message(role, _text(item.get("content"), f"{where}.content")))
            joinable = role == "assistant"
        elif kind == "function_call":
            call = ToolCall(id=_field(item, "call_id", where), name=_field(item, "name", where),
                            arguments=_field(item, "arguments", where))
            call_names[call.id] = call.name
            if joinable:
                last = out.pop()
                out.append(Message("assistant", last.content, (*last.tool_calls, call)))
            else:
                out.append(Message("assistant", "", (call,)))
            joinable = True
        elif kind == "function_call_output":
            call_id = _field(item, "call_id", where)
            text = _text(item.get("output"), f"{where}.output", required=True)
            out.append(Message("tool", text, tool_call_id=call_id, name=call_names.get(call_id)))
            joinable = False
        else:
            raise _bad(f"{where} has type {kind!r}: this server accepts message, function_call and "
                       "function_call_output items", "input")
    return out
