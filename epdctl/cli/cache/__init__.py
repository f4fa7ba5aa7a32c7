"""`epdctl cache`: inspect and clean the shared-memory EC store."""

from __future__ import annotations

import click

from epdctl.cli.cache.clean import clean
from epdctl.cli.cache.inspect import inspect


@click.group()
def cache() -> None:
    """Inspect or clean the shared-memory encoder cache"""


cache.add_command(inspect)
cache.add_command(clean)
