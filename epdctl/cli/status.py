"""Placeholder: replaced by the real `status` command."""

from __future__ import annotations

import click


@click.command()
def status() -> None:
    """Not built yet"""
    raise click.ClickException("not built yet")
