"""Every failure as OpenAI's error JSON: the one place that shapes them (app and on_ray).

    400 a malformed body, a bad field, a prompt over the context (with the numbers)
    401 a missing or wrong key          404 an unknown model or route
    413 a body over --max-body-bytes    429 a key over its share
    500 a library error (e.g. a model with no chat template)
    503 a server that is full or stopping, or a request that failed while running
"""
from __future__ import annotations

import math

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..conductor import ConductorError, ContextFull, NoRoom, Stopping
from ..errors import SwarmKVError
from .schemas import ErrorBody, ErrorDetail

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


#: Anthropic's error types by HTTP status, for the routes under /v1/messages.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                   500: "api_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = "/v1/messages"


class Refused(Exception):
    """A request the server will not run; `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None, details: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param
        self.retry_after = retry_after        # seconds, sent as Retry-After (the openai client honours it)
        self.details = details or {}          # more fields of the error object (llama-server's)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None,
               details: dict | None = None) -> dict:
    """OpenAI's error object: a response's body, or an event in a stream that has begun;
    `details` adds fields (or a more precise type) clients of llama-server read."""
    detail = ErrorDetail(message=message, type=ERROR_TYPES.get(status, "server_error"), param=param, code=code)
    body = ErrorBody(error=detail).model_dump()
    body["error"].update(details or {})
    return body


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error object (the `anthropic` SDK raises its exceptions from it)."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   path: str = "", headers: dict | None = None, details: dict | None = None) -> JSONResponse:
    """The error as the API at `path` writes it: Anthropic's under /v1/messages, else OpenAI's."""
    if path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
    return JSONResponse(error_body(status, message, code, param, details), status_code=status, headers=headers)


def refused_response(exc: Refused, path: str = "") -> JSONResponse:
    headers = None if exc.retry_after is None else {"Retry-After": str(math.ceil(exc.retry_after))}
    return error_response(exc.status, str(exc), exc.code, exc.param, path, headers, exc.details)


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """The failed field that says most, named: (message, param). A value refused with a
    reason of ours (a ValueError) is named before a type mismatch; where a field takes
    several forms (text or a list of parts), the form that was not sent is not named."""
    errors = exc.errors()
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    where = ".".join(str(p) for p in first.get("loc", ()) if p not in UNION_BRANCHES and "[" not in str(p))
    said = first["msg"].removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        said = ("this server does not act on this field, so it refuses it rather than ignore it "
                "(docs/serve.md lists the fields it honours)")
    elif where.startswith("response_format"):
        said = (f"{said} (response_format is {{'type': 'text'}}, {{'type': 'json_object'}} or "
                "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}})")
    return (f"{where}: {said}" if where else said), where or None


#: The names pydantic gives the forms of a field that takes several (not fields themselves).
UNION_BRANCHES = {"body", "str", "unsupported"}


def validated(schema, data):
    """`data` as the pydantic type `schema`, or a 400 naming the field at fault (coded
    unsupported_parameter for a field the server refuses)."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise Refused(400, message, "unsupported_parameter" if unsupported(exc) else None, param) from None


def unsupported(exc: ValidationError) -> bool:
    """The body names a field the server refuses (a 400 coded unsupported_parameter)."""
    return exc.errors()[0].get("type") == "extra_forbidden"


def context_exceeded(exc: ContextFull, what: str) -> Refused:
    """A prompt and max_tokens over the context, in OpenAI's words; `what`: "messages" or
    "prompt", the field at fault."""
    asked = exc.held + exc.new + exc.max_tokens
    return Refused(400, f"This model's maximum context length is {exc.limit} tokens. However, you "
                   f"requested {asked} tokens ({exc.held + exc.new} in the {what}, {exc.max_tokens} in the "
                   "completion). Please reduce the length of the messages or completion.",
                   "context_length_exceeded", what,
                   details={"type": "exceed_context_size_error", "n_prompt_tokens": exc.held + exc.new,
                            "n_ctx": exc.limit})


def refused(exc: BaseException) -> Refused:
    """What a choice that failed says: a stopping server is 503, a request the conductor
    would not run 400, anything else 503 with its reason."""
    if isinstance(exc, Refused):
        return exc
    if isinstance(exc, Stopping):
        return Refused(503, "the server is stopping; this request was not run", "server_stopping")
    if isinstance(exc, ConductorError):
        return Refused(400, str(exc), exc.code.lower())
    if isinstance(exc, NoRoom):
        return Refused(503, str(exc), "no_room")
    return Refused(503, f"the request failed: {exc}")


def install(app: FastAPI) -> None:
    """Route every error an app raises through this module."""
    async def on_refused(request, exc: Refused):
        return refused_response(exc, request.url.path)

    async def on_http(request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), path=request.url.path)

    async def on_library(request, exc: SwarmKVError):
        return error_response(500, str(exc), "server_error", path=request.url.path)

    async def on_invalid(request, exc: RequestValidationError):
        return error_response(400, *validation_message(exc), path=request.url.path)

    app.add_exception_handler(Refused, on_refused)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(SwarmKVError, on_library)
    app.add_exception_handler(RequestValidationError, on_invalid)
