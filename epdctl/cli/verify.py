"""Placeholder: replaced by the real `verify` command."""

from __future__ import annotations

import click


@click.command()
def verify() -> None:
    """Not built yet"""
    raise click.ClickException("not built yet")
