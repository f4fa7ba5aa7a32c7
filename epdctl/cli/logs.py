"""Placeholder: replaced by the real `logs` command."""

from __future__ import annotations

import click


@click.command()
def logs() -> None:
    """Not built yet"""
    raise click.ClickException("not built yet")
