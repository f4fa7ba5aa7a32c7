"""The proxy's layout is its flow, and its imports say so: the shared modules at the top of
the package, then transport/, request/, stages/ and server/, each importing only the layers
below it (lazy imports too). docs/architecture.md draws the same."""

from __future__ import annotations

import ast
from pathlib import Path

import epdctl.proxy

PROXY = Path(epdctl.proxy.__file__).parent
LAYERS = {"transport": 1, "request": 2, "stages": 3, "server": 4}
"""Where each part sits: the top-level modules (config, errors, attempts, ...) at 0; the
package's own face (`epdctl.proxy`: its public names) and __main__ (the process entry) above
them all."""
TOP = 5


def layer(module: str) -> int:
    """The layer of `epdctl.proxy.<module>` (dotted, below the package; "" the package)."""
    if module in ("", "__main__"):
        return TOP
    return LAYERS.get(module.split(".")[0], 0)


def imports(path: Path) -> set[str]:
    """The epdctl.proxy modules `path` imports, relative to the package, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.startswith("epdctl.proxy."):
                found.add(name.removeprefix("epdctl.proxy."))
    return found


def own_module(path: Path) -> str:
    rel = path.relative_to(PROXY).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts) or ""


def test_every_proxy_module_imports_only_from_the_layers_below_it_or_its_own():
    upward = []
    for path in sorted(PROXY.rglob("*.py")):
        mine = own_module(path)
        level = layer(mine)
        for target in imports(path):
            if layer(target) > level:
                upward.append(f"{mine or 'epdctl.proxy'} ({level}) imports {target} "
                              f"({layer(target)})")
    assert not upward, "\n".join(upward)


def test_the_layers_are_told_apart():
    """The check itself: a module of each layer is where LAYERS says, and one import upward
    would be caught."""
    assert [layer(m) for m in ("attempts", "transport.base", "request.parse",
                               "stages.replay", "server.handler", "__main__")] \
        == [0, 1, 2, 3, 4, 5]
    assert layer("stages.generate") > layer("request.inflight")
