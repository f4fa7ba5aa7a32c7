"""The proxy's one JSON codec (orjson): every body it reads or writes goes through here.

orjson parses and writes several times faster than the stdlib `json`, and writes compact
UTF-8 as vLLM's own answers are written (starlette's JSONResponse: no spaces, no `\\uXXXX`
escapes). What it refuses and the stdlib took (NaN, integers past 64 bits, lone surrogates)
is a body the proxy does not take: it goes on to vLLM as it came, which answers for it.

A part that several bodies carry (a keyed media part: E's body and PD's, or P's and D's) is a
`Shared` dict: written once, its bytes spliced into every body it is in (orjson.Fragment).

Large items (a video of tens of MiB inline): orjson reserves its worst case up front, about
12 bytes per input byte to parse a document and as many per character to write a string
(virtual memory, mostly never touched, yet allocated and kept with the result). So a body of
LARGE_BYTES or more is parsed by the stdlib (no larger than its input, refusing what orjson
refuses), and a Shared part's large strings are spliced in as they are, not written.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import orjson

JSONDecodeError = orjson.JSONDecodeError
"""A ValueError (and json.JSONDecodeError) subclass: `except ValueError` catches it."""
LARGE_BYTES = 4 << 20
"""Documents and strings from this size on avoid orjson's worst-case reservations."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_INT_RANGE = range(-(2**63), 2**64)  # what orjson reads as an integer (the rest: a float)


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """A JSON document; ValueError if it is not one."""
    if isinstance(data, str) or len(data) < LARGE_BYTES or _SURROGATE_ESCAPE.search(data):
        return orjson.loads(data)  # a surrogate escape: only orjson refuses a lone one
    try:
        return json.loads(str(data, "utf-8"), parse_constant=_refuse, parse_int=_as_orjson,
                          parse_float=_finite)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _as_orjson(text: str) -> int | float:
    value = int(text)
    return value if value in _INT_RANGE else _finite(text)


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is infinity when parsed as double")
    return value


class Shared(dict[str, Any]):
    """A dict that goes into several bodies: serialized at its first dumps, the same bytes
    reused after that. Never changed once built (the bodies are built, then written)."""

    __slots__ = ("_fragment",)

    def fragment(self) -> orjson.Fragment:
        try:
            return self._fragment
        except AttributeError:
            self._fragment: orjson.Fragment = orjson.Fragment(_written(dict(self)))
            return self._fragment


def _written(part: dict[str, Any]) -> bytes | str:
    """orjson's bytes for a part, but for its large plain strings (a data URL), spliced into
    them as they are: the same JSON, one copy of each string, no reservation for it."""
    large: list[str] = []
    token = ""  # made for the first large string: most parts have none

    def stand_in(value: Any) -> Any:
        nonlocal token
        if isinstance(value, dict) and not isinstance(value, Shared):
            return {k: stand_in(v) for k, v in value.items()}
        if isinstance(value, str) and len(value) >= LARGE_BYTES and _is_plain(value):
            token = token or os.urandom(8).hex()
            large.append(value)
            return f"{token}-{len(large) - 1}"
        return value

    small = orjson.dumps(stand_in(part), default=_default, option=_OPTIONS)
    if not large:
        return small
    rest, pieces = small.decode(), []
    for n, value in enumerate(large):
        before, _, rest = rest.partition(f'"{token}-{n}"')
        pieces += [before, '"', value, '"']
    return "".join([*pieces, rest])


def _is_plain(text: str) -> bool:
    """Whether orjson writes `text` as it is, in quotes: ASCII, printable, no `"` or `\\`."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


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
