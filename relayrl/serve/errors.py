"""Errors of `relayrl serve` and of the recording OpenAI app, in one shape on every route.

Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}` (SGLang answers the same way), so an
`openai` client, SGLang's clients and relayrl's RemoteEngine all read it. Client errors name the offending
field (`param`, and the message starts with it) so the client can fix its request. Anything else is a bug or
a fault of the server: the client gets only "internal error" and a request id, the traceback goes to the
server's log under that id -- an exception's text may hold paths, tensor shapes or library internals that a
remote client has no business seeing.

Bodies are read here with a size limit (413 past it) and parsed off the event loop, and every string in them
must be valid Unicode: a lone surrogate (`"\\ud800"`) parses as JSON but makes the tokenizer raise, so it is
refused with the path of the field that holds it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("relayrl.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          499: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}
_PARSE_OFF_LOOP = 64 * 1024  # bodies above this are parsed in a thread: the event loop keeps serving others


class ApiError(Exception):
    """A refusal with its HTTP status; `field` names the offending request field (None: the request as a whole)."""

    def __init__(self, status: int, field: str | None, message: str, code: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.status, self.field, self.code = status, field, code


class BadRequest(ApiError, ValueError):
    """HTTP 400 naming a field; the message starts with the field so clients can fix their request."""

    def __init__(self, field: str, message: str, code: str = "invalid_value"):
        super().__init__(400, field, message, code)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's (and SGLang's) error body, so clients of either API read our errors the usual way."""
    body = {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}
    return JSONResponse({"error": body}, status_code=status)


def api_error_response(e: ApiError) -> JSONResponse:
    return error_response(e.status, str(e), e.field, e.code)


def log_error(where: str, exc: BaseException) -> str:
    """Log `exc` with its traceback under a fresh request id, which is all the client is told."""
    rid = uuid.uuid4().hex[:16]
    log.error("internal error %s in %s", rid, where, exc_info=(type(exc), exc, exc.__traceback__))
    return rid


def internal_error(request: Request, exc: BaseException) -> JSONResponse:
    """500 with a request id only; the traceback goes to the server log under the same id."""
    rid = log_error(f"{request.method} {request.url.path}", exc)
    return error_response(500, f"internal error (request id {rid}; details are in the server log)",
                          code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Route-level errors (unknown route, wrong method, auth) and uncaught exceptions in the one shape."""
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), code="invalid_api_key" if exc.status_code == 401
                              else None)

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = (exc.errors() or [{}])[0]
        field = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"{field}: {first.get('msg', 'invalid')}" if field else "invalid request", field)

    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return api_error_response(exc)

    async def crash(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(request, exc)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Exception, crash)


# ---- request bodies ---------------------------------------------------------------------------------------
async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refused with 413 as soon as it passes `max_bytes` (a declared Content-Length is checked
    before anything is read), so a huge upload costs neither memory nor time."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, "body", f"{int(declared)} bytes is more than this server accepts ({max_bytes}; "
                       "--max-body-bytes)", "body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, "body", f"more than the {max_bytes} bytes this server accepts (--max-body-bytes)",
                           "body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes, empty: Any = None) -> Any:
    """JSON from bytes; syntax errors, invalid UTF-8, nesting too deep for the parser and invalid Unicode in
    any string are all client errors (400), never a 500."""
    if not raw.strip():
        if empty is not None:
            return empty
        raise BadRequest("body", "is empty (send a JSON object)")
    try:
        value = json.loads(raw)
    except UnicodeDecodeError:
        raise BadRequest("body", "is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise BadRequest("body", f"is not valid JSON (line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError):  # an integer of thousands of digits, or nesting deeper than the parser
        raise BadRequest("body", "is not JSON this server can parse (nesting or a number too large)") from None
    bad = invalid_unicode(value)
    if bad is not None:
        raise BadRequest(bad or "body", "is not valid Unicode (lone surrogate)")
    return value


async def read_json(request: Request, max_bytes: int, empty: Any = None) -> dict[str, Any]:
    """A JSON object body (`empty` when the body is blank and that is allowed), within `max_bytes`."""
    raw = await read_body(request, max_bytes)
    body = await asyncio.to_thread(parse_json, raw, empty) if len(raw) > _PARSE_OFF_LOOP else parse_json(raw, empty)
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    return body


def invalid_unicode(value: Any) -> str | None:
    """Path (`messages[0].content`) of the first string or key that is not valid Unicode, else None. Iterative:
    the parser accepts nesting deeper than Python's recursion limit."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return path
        elif isinstance(v, dict):
            for k, item in v.items():
                if not _encodable(k):
                    return path or "body"
                stack.append((f"{path}.{k}" if path else k, item))
        elif isinstance(v, list):  # token-id lists are long: only strings and containers are looked into
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v) if isinstance(item, (str, dict, list)))
    return None


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
