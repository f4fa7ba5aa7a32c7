"""One client request on a completion route as it goes through the stages: its route, the
body parsed once (with the client's bytes kept, sent on as they are where nothing in the
body changes), its stream flag, its trace, what it has attempted, and what PD gets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epdctl.proxy import jsonio
from epdctl.proxy.attempts import Attempts
from epdctl.proxy.request.parse import is_stream
from epdctl.proxy.trace import Trace

Body = dict[str, Any] | bytes
"""A body for an instance: a dict to serialize, or bytes to send as they are."""


@dataclass(eq=False)
class Request:
    """A request in flight. The stages read it and the media stage sets what PD gets
    (`for_pd`); `attempts` holds the one policy for every retry, replay and resume."""

    route: str
    raw: bytes
    """The client's bytes as they came."""
    body: dict[str, Any]
    """The body, parsed once (with the client's media uuids scoped)."""
    trace: Trace
    attempts: Attempts
    is_stream: bool = field(init=False)
    first: Body = field(init=False)
    """What PD (or P, then D) gets first: `raw` until a stage changes the body."""
    fallback: Body = field(init=False)
    """What the next attempt sends after a failed `first` (the media, where `first` has
    them rewritten to E's metadata)."""
    is_rewritten: bool = False

    def __post_init__(self) -> None:
        self.is_stream = is_stream(self.body)
        self.first = self.fallback = self.raw

    def for_pd(self, first: Body, fallback: Body | None = None, *,
               is_rewritten: bool = False) -> None:
        """What PD gets, and what the attempt after a failed `first` sends."""
        self.first = first
        self.fallback = first if fallback is None else fallback
        self.is_rewritten = is_rewritten

    def dict_of(self, body: Body) -> dict[str, Any]:
        """`body` as a dict: the parsed body for the client's own bytes (never parsed
        again), a parse for other bytes."""
        if isinstance(body, dict):
            return body
        if body is self.raw:
            return self.body
        parsed = jsonio.loads(body)
        return parsed if isinstance(parsed, dict) else self.body
