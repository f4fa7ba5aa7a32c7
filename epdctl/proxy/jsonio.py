"""The proxy's one JSON codec (orjson): every body it reads or writes goes through here.

orjson parses and writes several times faster than the stdlib `json`, and writes compact
UTF-8 as vLLM's own answers are written (starlette's JSONResponse: no spaces, no `\\uXXXX`
escapes). What it refuses and the stdlib took (NaN, integers past 64 bits, lone surrogates)
is a body the proxy does not take: it goes on to vLLM as it came, which answers for it.
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


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON bytes."""
    return orjson.dumps(obj)


def dumps_event(obj: Any) -> bytes:
    """JSON as vLLM writes its in-stream events (the stdlib's `json.dumps`: `", "` and
    `": "`, ASCII escapes), for the proxy's own error events: rare, and byte for byte in
    vLLM's form. Never a body on the hot path."""
    return json.dumps(obj).encode()
