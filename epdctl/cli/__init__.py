"""The `epdctl` command: root group, global options, and the one place exit codes are chosen."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from epdctl import __version__
from epdctl.cli._app import App
from epdctl.cli.bench import bench
from epdctl.cli.cache import cache
from epdctl.cli.change import apply, scale, switch
from epdctl.cli.doctor import doctor
from epdctl.cli.down import down
from epdctl.cli.logs import logs
from epdctl.cli.rebalance import rebalance
from epdctl.cli.render import render
from epdctl.cli.restart import restart
from epdctl.cli.status import status
from epdctl.cli.top import top
from epdctl.cli.tune import tune
from epdctl.cli.up import up
from epdctl.cli.verify import verify
from epdctl.errors import EpdctlError


class _Failure(click.ClickException):
    """An EpdctlError as click shows it: `Error: message`, with the error's exit code."""

    def __init__(self, exc: EpdctlError) -> None:
        super().__init__(str(exc))
        # click declares exit_code on the class; each instance carries the error's own.
        self.exit_code = exc.exit_code  # type: ignore[misc]


class _Root(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except EpdctlError as exc:
            raise _Failure(exc) from exc


@click.group(cls=_Root, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="epdctl")
@click.option(
    "--state-dir",
    "state_root",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="EPDCTL_STATE_DIR",
    help="Where running topologies keep state.json and logs (one sub-dir per topology). "
    "[env: EPDCTL_STATE_DIR; default: ~/.local/state/epdctl]",
)
@click.option("-v", "--verbose", count=True, help="More detail; repeat for more.")
@click.option("--color/--no-color", default=None,
              help="Force colour on or off (NO_COLOR is honoured).")
@click.pass_context
def cli(ctx: click.Context, state_root: Path | None, verbose: int, color: bool | None) -> None:
    """Bring up and manage a vLLM Encoder/Prefill/Decode topology on one machine.

    \b
    epdctl up topologies/cpu-demo.yaml -d   start it (detached)
    epdctl status                           what runs, and is it ready
    epdctl logs -f                          all instances' logs, in time order
    epdctl top                              requests, latencies, cache hits, live
    epdctl cache inspect                    the shared-memory encoder cache
    epdctl restart pd-0                     one instance, while the others serve
    epdctl scale pd=2                       add or remove instances, while serving
    epdctl switch pd-1 encode               move an instance's GPUs to another role
    epdctl apply topology.yaml              bring it to an edited file: what changed
    epdctl rebalance --profiles DIR --slo ...   move GPUs between roles for the traffic now
    epdctl down                             stop everything (after a drain)
    """
    app = App(verbose=verbose, color=color)
    if state_root is not None:
        app.state_root = state_root.absolute()
    ctx.obj = app


for command in (up, down, restart, scale, switch, apply, rebalance, status, logs, top, cache,
                verify, bench, tune, render, doctor):
    cli.add_command(command)


def main() -> None:
    """Console-script entry point."""
    try:
        cli(prog_name="epdctl")
    except KeyboardInterrupt:
        sys.exit(130)
