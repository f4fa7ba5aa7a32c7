"""Placeholder: replaced by the real `up` command."""

from __future__ import annotations

import click


@click.command()
def up() -> None:
    """Not built yet"""
    raise click.ClickException("not built yet")
