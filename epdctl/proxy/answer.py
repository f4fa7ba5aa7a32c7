"""What goes back to the client (Answer), and an attempt that failed before the client got a
byte (StageFailed): the stages' results, which the attempt policy and the server read."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from epdctl.proxy.errors import JSON_TYPE, UpstreamError
from epdctl.proxy.upstreams import Instance


@dataclass
class Answer:
    """What goes back to the client: a whole body, or a committed stream."""

    status: int
    content_type: str
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    raw_headers: list[tuple[bytes, bytes]] | None = None
    """An instance's own response headers, relayed instead of content type and `headers`."""


class StageFailed(Exception):
    """One attempt failed before any byte reached the client: no (whole) answer, or a
    refusal (status and body as the instance sent them)."""

    def __init__(self, stage: str, inst: Instance, *, error: UpstreamError | None = None,
                 status: int = 502, content_type: str = JSON_TYPE, body: bytes = b"") -> None:
        super().__init__(f"{stage} {inst.url}: {error or status}")
        self.stage = stage
        self.inst = inst
        self.error = error
        self.status = status
        self.content_type = content_type
        self.body = body

    @property
    def is_retryable(self) -> bool:
        """Only when the instance did not answer at all (refused, or reset before any
        response byte). A refusal is vLLM's answer, and the client gets it as it is."""
        return self.error is not None and self.error.is_retryable

    @property
    def is_timeout(self) -> bool:
        """Never tried again: it would double the wait."""
        return self.error is not None and self.error.kind == "timeout"

    def answer(self) -> Answer:
        """vLLM's refusal unchanged; our own 502/504 when it gave no answer."""
        if self.error is not None:
            err = self.error.to_proxy_error()
            return Answer(err.status, JSON_TYPE, err.body())
        return Answer(self.status, self.content_type, self.body)
