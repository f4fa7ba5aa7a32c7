"""Placeholder: replaced by the real `render` group."""

from __future__ import annotations

import click


@click.group()
def render() -> None:
    """Not built yet"""
