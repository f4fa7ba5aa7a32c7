"""Errors the proxy answers with, in OpenAI's JSON error shape."""

from __future__ import annotations

import json

JSON_TYPE = "application/json"


class ProxyError(Exception):
    """An answer for the client: status, OpenAI error type and code, extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


class UpstreamError(Exception):
    """A stage's instance could not answer: `kind` is "timeout" or "unavailable"."""

    def __init__(self, stage: str, url: str, kind: str, detail: str) -> None:
        super().__init__(f"{stage} instance {url}: {kind}: {detail}")
        self.stage = stage
        self.url = url
        self.kind = kind
        self.detail = detail

    def to_proxy_error(self) -> ProxyError:
        """504 for a timeout, 502 for anything else, naming the stage and the instance."""
        status = 504 if self.kind == "timeout" else 502
        code = "upstream_timeout" if self.kind == "timeout" else "upstream_unavailable"
        return ProxyError(status, str(self), type_="upstream_error", code=code)


def error_body(
    message: str, type_: str, code: str | int | None = None, param: str | None = None
) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}` as bytes."""
    error = {"message": message, "type": type_, "param": param, "code": code}
    return json.dumps({"error": error}).encode()


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, code="invalid_request", param=param)
