"""Placeholder: replaced by the real `down` command."""

from __future__ import annotations

import click


@click.command()
def down() -> None:
    """Not built yet"""
    raise click.ClickException("not built yet")
