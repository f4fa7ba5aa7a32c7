"""The App context object every command receives: consoles and the state dir root."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import click
from rich.console import Console


def default_state_root() -> Path:
    """`$XDG_STATE_HOME/epdctl`, or ~/.local/state/epdctl."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "epdctl"


@dataclass
class App:
    """Shared by all commands: where state lives, how loud and how colourful to be."""

    state_root: Path = field(default_factory=default_state_root)
    verbose: int = 0
    color: bool | None = None

    def __post_init__(self) -> None:
        no_color = self.color is False or (self.color is None and "NO_COLOR" in os.environ)
        force = True if self.color else None
        self.out = Console(highlight=False, no_color=no_color, force_terminal=force, soft_wrap=True)
        self.err = Console(
            stderr=True, highlight=False, no_color=no_color, force_terminal=force, soft_wrap=True
        )

    def state_dir(self, name: str) -> Path:
        """The state dir of topology `name`."""
        return self.state_root / name


pass_app = click.make_pass_decorator(App)
