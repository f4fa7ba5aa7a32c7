"""Errors the proxy answers with, in vLLM's JSON error shape (numeric `code` = the status)."""

from __future__ import annotations

from http import HTTPStatus

from epdctl.proxy import jsonio

JSON_TYPE = "application/json"
# vLLM's `type` for the statuses its own errors use (serve/exception_handling); any other
# status gets its HTTP phrase, as vLLM's handler for framework errors does.
VLLM_TYPES = {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError",
              500: "InternalServerError", 501: "NotImplementedError",
              503: "ServiceUnavailableError"}
# What `vllm serve --api-key` answers without a valid key (its AuthenticationMiddleware).
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
ENGINE_DEAD = b"EngineCore encountered an issue"
"""vLLM's message when its engine died (EngineDeadError): the instance is going down."""


def vllm_type(status: int) -> str:
    """The `type` vLLM writes for an error with this status."""
    try:
        return VLLM_TYPES.get(status) or HTTPStatus(status).phrase
    except ValueError:
        return "Error"


class ProxyError(Exception):
    """An answer for the client: status, message, the offending parameter, extra headers."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.status, self.param)


class UpstreamError(Exception):
    """A stage's instance gave no (whole) answer.

    `kind`: "unavailable" (no response at all: refused, or reset before any response byte),
    "broken" (the response began, then the connection failed), "timeout", "too large".
    """

    def __init__(self, stage: str, url: str, kind: str, detail: str) -> None:
        super().__init__(f"{stage} instance {url}: {kind}: {detail}")
        self.stage = stage
        self.url = url
        self.kind = kind
        self.detail = detail

    @property
    def is_retryable(self) -> bool:
        """Only a request the instance never answered may be sent again: a timeout would
        double the wait, and a broken answer may have been acted on."""
        return self.kind == "unavailable"

    def to_proxy_error(self) -> ProxyError:
        """504 for a timeout, 502 for anything else, naming the stage and the instance."""
        return ProxyError(504 if self.kind == "timeout" else 502, str(self))


def error_body(message: str, status: int, param: str | None = None) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}` as vLLM writes it, as bytes."""
    error = {"message": message, "type": vllm_type(status), "param": param, "code": status}
    return jsonio.dumps({"error": error})


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param)
