"""OpenAI error objects: {"error": {"message", "type", "param", "code"}} with the right status code."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         413: "invalid_request_error", 502: "server_error", 503: "server_error", 500: "server_error"}


class APIError(Exception):
    """An error to send to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. Retry-After on a 503 of a busy server

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type names to the location: keep the field path only.
    param = ".".join(p for p in loc if not p[:1].isupper() and p not in ("str", "list[int]", "list[str]")) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", None, "invalid_json")
    return APIError(400, f"invalid parameter {param!r}: {msg}" if param else msg, param, "invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail)))
