"""Which EC store the cache commands use: --store-dir, the running topology's, or the default."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click

from epdctl import cache
from epdctl.cli._app import App
from epdctl.topology.ec_names import EXAMPLE


@dataclass(frozen=True)
class StoreView:
    """Which store a command looks at, and what the running topology says about it."""

    root: Path
    capacity_bytes: int | None = None
    active_namespace: str | None = None
    connector: str = cache.CONNECTOR_NAME
    """The running topology's EC connector (epdctl's when none runs, or with --store-dir)."""
    topology: str | None = None

    @property
    def is_ours(self) -> bool:
        return self.connector == cache.CONNECTOR_NAME

    @property
    def example_dir(self) -> Path | None:
        """ECExampleConnector's directory (the running topology's namespace), else None."""
        if self.connector != EXAMPLE or self.active_namespace is None:
            return None
        return self.root / self.active_namespace

    def not_ours(self) -> str:
        """The plain line the cache commands print when the connector is not epdctl's."""
        line = f"`{self.topology}` runs {self.connector}, not epdctl's store"
        if self.example_dir is not None:
            return f"{line}: its files are in {self.example_dir}"
        return (f"{line}: epdctl cannot see what it holds (--store-dir DIR looks at an epdctl "
                "store)")


def resolve_store(app: App, store_dir: Path | None) -> StoreView:
    """--store-dir, else the running topology's store, else /dev/shm/epdctl-<uid>."""
    if store_dir is not None:
        return StoreView(store_dir.absolute())
    from epdctl.errors import EpdctlError
    from epdctl.launch.state import find_state_dir

    try:
        sdir = find_state_dir(app.state_root, None)
        state = sdir.read() if sdir.is_running() else None
    except EpdctlError:
        state = None
    if state is None:
        return StoreView(Path(cache.default_store_root()))
    ns_dir = Path(state.store_dir)
    # state.json records the namespace's own dir; the store root is its parent.
    root = ns_dir.parent if ns_dir.name == state.namespace else ns_dir
    return StoreView(root, state.settings.cache_capacity_bytes, state.namespace,
                     state.ec_connector, state.name)


store_dir_option = click.option(
    "--store-dir",
    "store_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Store root; default: the running topology's, else /dev/shm/epdctl-<uid>.",
)
