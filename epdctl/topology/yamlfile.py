"""Reading a topology file safely, and pydantic errors as one human line per problem."""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from epdctl.errors import TopologyError

MAX_TOPOLOGY_BYTES = 1 << 20
# YAML aliases can make a small file expand to a huge tree; validation would walk all of it.
MAX_TOPOLOGY_VALUES = 100_000
_YAML_HINTS = {
    "'\\t'": " (indent with spaces, not tabs)",
    "<block end>": " (check the indentation)",
    "mapping values are not allowed": " (quote a value that holds ': ', or check the indentation)",
}
_MESSAGES = {
    "missing": "required key is missing",
    "int_type": "expected an integer, got {input}",
    "int_parsing": "expected an integer, got {input}",
    "int_from_float": "expected an integer, got {input}",
    "float_type": "expected a number, got {input}",
    "float_parsing": "expected a number, got {input}",
    "bool_type": "expected true or false, got {input}",
    "bool_parsing": "expected true or false, got {input}",
    "string_type": "expected a string, got {input}",
    "list_type": "expected a list, got {input}",
    "dict_type": "expected a mapping, got {input}",
    "model_type": "expected a mapping, got {input}",
    "path_type": "expected a path, got {input}",
    "greater_than": "must be more than {gt}, got {input}",
    "greater_than_equal": "must be at least {ge}, got {input}",
    "less_than_equal": "must be at most {le}, got {input}",
    "literal_error": "expected {expected}, got {input}",
    "string_too_short": "must not be empty",
    "too_short": "must not be empty",
}


def show(value: Any) -> str:
    """A value as the user wrote it in YAML, short enough for one error line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, int | float):
        text = str(value)
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


class Problems(ValueError):
    """Several cross-field problems at once, each already prefixed with its location."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def invalid(source: str, lines: Sequence[str]) -> TopologyError:
    """The one error shape for a bad topology: a header, then one indented line each."""
    body = "\n".join(f"  {line}" for line in lines)
    return TopologyError(f"{source}: invalid topology\n{body}")


def _suggest(word: Any, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _location(loc: Sequence[int | str]) -> str:
    return " -> ".join(str(part) for part in loc)


def _position(data: Any, loc: Sequence[int | str]) -> list[int]:
    """Where loc sits in the parsed YAML, so problems are listed in file order."""
    key = []
    for part in loc:
        if isinstance(data, dict) and part in data:
            key.append(list(data).index(part))
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            key.append(part)
            data = data[part]
        else:
            key.append(1 << 30)  # a missing key: after everything that is there
            break
    return key


FieldsAt = Callable[[tuple[int | str, ...]], Sequence[str]]


def _format_error(err: Any, fields_at: FieldsAt, keys: dict[str, Sequence[str]]) -> list[str]:
    loc = tuple(err["loc"])
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if isinstance(ctx.get("error"), Problems):
        return list(ctx["error"].lines)
    if loc[-1:] == ("[key]",) and str(loc[0]) in keys:
        # A bad key of a dict with fixed keys (roles): pydantic says "Input should be ...".
        noun, choices = str(loc[0]).removesuffix("s"), keys[str(loc[0])]
        listed = ", ".join(choices[:-1]) + f" and {choices[-1]}"
        return [f"{_location(loc[:-1])}: unknown {noun}{_suggest(loc[-2], choices)}; "
                f"{loc[0]} are {listed}"]
    if kind == "extra_forbidden":
        msg = "unknown key" + _suggest(loc[-1], fields_at(loc[:-1]))
    elif kind == "value_error":
        msg = str(ctx.get("error", err["msg"]))
    elif kind in _MESSAGES:
        msg = _MESSAGES[kind].format(**{**ctx, "input": show(err.get("input"))})
    else:
        msg = err["msg"]
    return [f"{_location(loc)}: {msg}" if loc else msg]


def format_errors(
    exc: ValidationError, data: Any, fields_at: FieldsAt, keys: dict[str, Sequence[str]]
) -> list[str]:
    """One line per problem, in file order: `roles -> encode -> gpus: expected ...`.

    fields_at(loc) lists the keys allowed at loc (for "did you mean"); keys maps a
    top-level dict with fixed keys (roles) to those keys.
    """
    errors = sorted(exc.errors(include_url=False), key=lambda e: _position(data, e["loc"]))
    lines = [line for err in errors for line in _format_error(err, fields_at, keys)]
    return list(dict.fromkeys(lines))


def _too_big(data: Any, budget: int) -> bool:
    """True when data holds more than budget values (walks at most budget of them)."""
    stack, seen = [data], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > budget:
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


@functools.cache
def _loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one)."""

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    line = first.setdefault(key, key_node.start_mark.line)
                except TypeError:
                    continue  # unhashable: SafeLoader reports it
                if line != key_node.start_mark.line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key `{key}` (first on line {line + 1})",
                        key_node.start_mark,
                    )
            return super().construct_mapping(node, deep)

    return Loader


def _parse_yaml(text: str, source: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        if not problem.startswith("duplicate key"):
            hint = next((h for text, h in _YAML_HINTS.items() if text in problem), "")
            problem = f"not valid YAML: {problem}{hint}"
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise invalid(source, [where + problem]) from None


def read_yaml(path: Path) -> Any:
    """The parsed YAML of a topology file; TopologyError for anything but a YAML value."""
    source = str(path)
    try:
        size = path.stat().st_size
        if size > MAX_TOPOLOGY_BYTES:
            raise invalid(source, [f"the file is {size} bytes; a topology file is at most 1 MiB"])
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TopologyError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise TopologyError(f"{source}: is a directory, not a topology file") from None
    except OSError as exc:
        raise TopologyError(f"{source}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(source, [
            f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        ]) from None
    data = _parse_yaml(text, source)
    if _too_big(data, MAX_TOPOLOGY_VALUES):
        raise invalid(source, [
            f"the file expands to more than {MAX_TOPOLOGY_VALUES} values (YAML aliases?)"
        ])
    return data
