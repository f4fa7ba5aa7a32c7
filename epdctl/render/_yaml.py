"""Rendered objects as YAML: one multi-document stream, or one file per object in a directory."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import yaml

from epdctl.errors import RenderError
from epdctl.render.k8s import Rendering

MARK = "# Rendered by `epdctl render k8s`"
WIDTH = 100


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the topology in the ConfigMap) as literal blocks; no &anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def header(rendering: Rendering, source: str) -> str:
    """A comment block naming the source and listing the notes."""
    lines = [f"{MARK} from {source}.", "# Differs from `epdctl up` on one machine:"]
    for note in rendering.notes:
        wrapped = textwrap.wrap(note, WIDTH - 5, break_on_hyphens=False)
        lines += [f"#  - {wrapped[0]}", *(f"#    {rest}" for rest in wrapped[1:])]
    return "\n".join(lines) + "\n"


def dump(obj: dict[str, Any]) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=WIDTH, allow_unicode=True)


def dump_all(rendering: Rendering, source: str) -> str:
    """Every object in one stream, the notes as a comment header."""
    body = "---\n".join(dump(obj) for obj in rendering.objects)
    return f"{header(rendering, source)}---\n{body}"


def file_name(index: int, obj: dict[str, Any]) -> str:
    return f"{index:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def write_dir(rendering: Rendering, source: str, out_dir: Path) -> list[Path]:
    """One file per object; files an earlier render wrote and this one does not are removed."""
    head = header(rendering, source)
    written = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for index, obj in enumerate(rendering.objects):
            path = out_dir / file_name(index, obj)
            path.write_text(f"{head}---\n{dump(obj)}", encoding="utf-8")
            written.append(path)
    except OSError as exc:
        raise RenderError(f"{out_dir}: cannot write manifests: {exc.strerror or exc}") from None
    # A replica or role dropped from the topology must not linger for `kubectl apply -f DIR`.
    for path in sorted(out_dir.glob("*.yaml")):
        if path not in written and _is_ours(path):
            path.unlink()
    return written


def _is_ours(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as f:
            return f.readline().startswith(MARK)
    except (OSError, UnicodeDecodeError):
        return False
