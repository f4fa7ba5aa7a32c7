"""The proxy's one JSON codec (orjson): every body it reads or writes goes through here.

orjson parses and writes several times faster than the stdlib `json`, and writes compact
UTF-8 as vLLM's own answers are written (starlette's JSONResponse: no spaces, no `\\uXXXX`
escapes). What it refuses and the stdlib took (NaN, integers past 64 bits, lone surrogates)
is a body the proxy does not take: it goes on to vLLM as it came, which answers for it.

A part that several bodies carry (a keyed media part: E's body and PD's, or P's and D's) is a
`Shared` dict: written once, its bytes spliced into every body it is in (orjson.Fragment).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

JSONDecodeError = orjson.JSONDecodeError
"""A ValueError (and json.JSONDecodeError) subclass: `except ValueError` catches it."""


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """A JSON document; ValueError if it is not one."""
    return orjson.loads(data)


class Shared(dict[str, Any]):
    """A dict that goes into several bodies: serialized at its first dumps, the same bytes
    reused after that. Never changed once built (the bodies are built, then written)."""

    __slots__ = ("_fragment",)

    def fragment(self) -> orjson.Fragment:
        try:
            return self._fragment
        except AttributeError:
            self._fragment: orjson.Fragment = orjson.Fragment(orjson.dumps(dict(self)))
            return self._fragment


def _default(obj: Any) -> Any:
    """What orjson hands back with OPT_PASSTHROUGH_SUBCLASS: a Shared part's bytes, any
    other subclass of a JSON type as that type."""
    if isinstance(obj, Shared):
        return obj.fragment()
    if isinstance(obj, dict):
        return dict(obj)
    if isinstance(obj, list):
        return list(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, int):
        return int(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


_OPTIONS = orjson.OPT_PASSTHROUGH_SUBCLASS


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON bytes (a Shared part as the bytes it was first written as)."""
    return orjson.dumps(obj, default=_default, option=_OPTIONS)


def dumps_event(obj: Any) -> bytes:
    """JSON as vLLM writes its in-stream events (the stdlib's `json.dumps`: `", "` and
    `": "`, ASCII escapes), for the proxy's own error events: rare, and byte for byte in
    vLLM's form. Never a body on the hot path."""
    return json.dumps(obj).encode()
