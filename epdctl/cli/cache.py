"""Placeholder: replaced by the real `cache` group."""

from __future__ import annotations

import click


@click.group()
def cache() -> None:
    """Not built yet"""
