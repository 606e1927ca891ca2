"""OpenAI error objects: {"error": {"message", "type", "param", "code"}} with the right status code, for every
error the controller answers: its own (APIError), invalid requests (400 naming the parameter), Starlette's (404,
405) and any unexpected fault (500, logged with its traceback). Under the Ollama API's paths (/api/...) the same
errors are Ollama's error JSON, {"error": "message"}, with the same status codes."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

# pydantic adds a union member's type to an error's location (messages.0.content.list[TextPart].0.type): a
# location part is the request's own when it is an index, a field name or a dict key made of digits
_PARAM_PART = re.compile(r"^(\d+|[a-z_][a-z0-9_]*)$")
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "bytes"}


def error_type(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


class APIError(Exception):
    """An error to send to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. Retry-After on a 503 of a busy server

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": error_type(self.status), "param": self.param,
                          "code": self.code}}


OLLAMA_PREFIX = "/api/"  # the Ollama API's routes (server/ollama_routes.py): its error shape


def ollama_path(path: str) -> bool:
    return path.startswith(OLLAMA_PREFIX)


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """The error as the API at `path` answers it: Ollama's {"error": message} under /api/, else OpenAI's."""
    body = {"error": err.message} if ollama_path(path) else err.body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def _param(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(p for p in parts if _PARAM_PART.match(p) and p not in _TYPE_TAGS) or None


def validation_error(errors: list[dict]) -> APIError:
    """The first of pydantic's errors as a 400 naming the parameter (protocol.invalid() names its own)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", None, "invalid_json")
    ctx = first.get("ctx") or {}
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "edgespec_invalid":
        return APIError(400, msg, ctx.get("param"), ctx.get("code", "invalid_value"))
    param = _param(first.get("loc", ()))
    msg = msg.removeprefix("Value error, ")  # what pydantic puts before a validator's own message
    return APIError(400, f"invalid parameter {param!r}: {msg}" if param else msg, param, "invalid_value")


def internal_error() -> APIError:
    return APIError(500, "The server had an error while processing your request; it has been logged.", None,
                    "internal_error")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(validation_error(list(exc.errors())), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers), request.url.path)

    # Starlette runs a handler for Exception in its outermost middleware, so that even a fault in another
    # middleware is answered as an error object rather than its plain-text page (it re-raises afterwards, and
    # uvicorn logs it once more)
    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(internal_error(), request.url.path)
