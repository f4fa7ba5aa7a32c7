"""The run API: prepare a topology's run, start it (foreground or detached), find it, stop it.

`up`, `down`, `verify` and `bench` are option parsing, a call here, and rendering: nothing in
this module prints, and nothing here knows about click.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from epdctl.cache import CONNECTOR_NAME
from epdctl.errors import (
    AlreadyRunningError,
    EpdctlError,
    NotRunningError,
    PlanError,
    StartupError,
)
from epdctl.host import ipc
from epdctl.host.shm import release
from epdctl.launch import sidecars
from epdctl.launch.identity import still_ours
from epdctl.launch.processes import (
    STOP_TIMEOUT_S,
    Proc,
    StopResult,
    describe_failure,
    exit_text,
    group_alive,
    scan_marked,
    stop_all,
)
from epdctl.launch.readiness import STARTUP_TIMEOUT_S, is_ready
from epdctl.launch.resolve import Resolved, resolve, vllm_version
from epdctl.launch.spec import Plan
from epdctl.launch.state import Record, RunState, Settings, StateDir
from epdctl.topology.model import Topology, load_topology, require_local_model

# Replaces `python -m epdctl.proxy` (its arguments kept): tests, or a proxy of your own.
PROXY_COMMAND_ENV = "EPDCTL_PROXY_COMMAND"
POLL_S = 0.2

Hook = Callable[[RunState], None]
Warn = Callable[[str], None]


def make_plan(topology: Topology | Resolved, state_dir: Path, *, is_dry_run: bool = False,
              warn: Warn | None = None) -> Plan:
    """plan() on this machine: its GPUs, CPUs and vLLM version, the run's keys (a Topology is
    resolved here first, with its own cache.dir); see PROXY_COMMAND_ENV."""
    from epdctl.launch.plan import plan

    if not isinstance(topology, Resolved):
        topology = resolve(topology, is_dry_run=is_dry_run, warn=warn)
    result = plan(topology.topology, state_dir, visible_gpus=topology.visible_gpus,
                  vllm_version=vllm_version(), cpu_count=len(os.sched_getaffinity(0)),
                  internal_key=topology.internal_key)
    command = os.environ.get(PROXY_COMMAND_ENV)
    if command:
        proxy = replace(result.proxy, command=tuple(shlex.split(command)))
        result = replace(result, proxy=proxy)
    return result


def settings_of(topology: Topology) -> Settings:
    """What the supervisor needs of the topology once `up` has returned."""
    r, c = topology.restart, topology.cache
    return Settings(restart_policy=r.policy, max_restarts=r.max_restarts, backoff_s=r.backoff,
                    restart_window_s=r.window, max_backoff_s=r.max_backoff,
                    cache_capacity_bytes=c.capacity, cache_ttl_s=c.ttl, cache_grace_s=c.grace,
                    keep_cache_on_down=c.keep_on_down)


@dataclass(frozen=True)
class Run:
    """A topology placed on this machine, not started yet."""

    resolved: Resolved
    topology_path: Path
    plan: Plan
    sdir: StateDir
    """Its state dir (one object: it holds the lock while the run starts)."""
    is_rebalanced: bool = False
    """`up --rebalance` (or `rebalance.enabled`): the rebalancer's policy goes into state."""

    @property
    def topology(self) -> Topology:
        return self.resolved.topology

    def initial_state(self) -> RunState:
        settings = settings_of(self.topology)
        if self.is_rebalanced or self.topology.rebalance.enabled:
            settings = settings.model_copy(update={"rebalance": self.topology.rebalance})
        return RunState.of(self.plan, str(self.topology_path.absolute()), settings)


def prepare(topology_path: Path, state_root: Path, *, is_dry_run: bool = False,
            warn: Warn | None = None, topology: Topology | None = None) -> Run:
    """Load (unless given) and plan a topology; nothing is started. Unless for a dry run, a
    local model path must exist, the connectors must import where the engines run, and the
    EC store root is made (the default one, or a fresh private one when the default is not
    the user's alone: store_root.resolve_root)."""
    from epdctl.cache.store_root import discard_root, resolve_root

    topology = topology or load_topology(topology_path)
    if not is_dry_run:
        require_local_model(topology)
    state_dir = state_root / topology.name
    # Resolved before the plan: the engines' EC config and the proxy's argv name the root.
    made: list[Path] = []
    root = resolve_root(topology, state_dir, is_dry_run=is_dry_run, warn=warn, made=made)
    try:
        resolved = resolve(topology, root, is_dry_run=is_dry_run, warn=warn)
        plan = make_plan(resolved, state_dir)
        if not is_dry_run:
            from epdctl.launch.preflight import connector_problems

            if problems := connector_problems(resolved.topology, plan):
                raise PlanError("\n".join(f"`{topology.name}`: {line}" for line in problems))
    except BaseException:
        for path in made:  # nothing started: leave no store root behind either
            discard_root(path)
        raise
    return Run(resolved, Path(topology_path), plan, StateDir(plan.state_dir))


def _refuse_if_running(sdir: StateDir) -> None:
    """A state.json whose processes still live means a run we do not own the lock of."""
    try:
        live = sdir.live_names(sdir.read())
    except NotRunningError:
        return
    if live:
        raise AlreadyRunningError(
            f"`{sdir.path.name}` is already running ({', '.join(live)} alive); "
            f"`epdctl down --name {sdir.path.name}` stops it")


def _claim(run: Run) -> tuple[RunState, int]:
    """Take the lock, check what must hold before anything starts, write state.json."""
    from epdctl.launch.ports import check_plan_ports

    sdir = run.sdir
    fd = sdir.lock()
    try:
        _refuse_if_running(sdir)
        check_plan_ports(run.plan)
        _claim_store(run)
        state = run.initial_state()
        sdir.write(state)
    except BaseException:
        sdir.unlock()
        raise
    return state, fd


def _claim_store(run: Run) -> None:
    """Make (or check) the store root and the namespace's directory before any engine
    starts, whichever connector writes there: 0700 and the user's alone, so vLLM never
    makes them with umask modes and a planted one is refused here (with the fix). Then the
    namespace is recorded as this topology's (the janitor's proof, store_root)."""
    from epdctl.cache import make_store_dir
    from epdctl.cache.capacity import check_capacity
    from epdctl.cache.store_root import record_namespace, uses_store
    from epdctl.host import private

    if not uses_store(run.topology):
        return
    ns_dir = run.plan.store_dir
    if run.plan.ec_connector == CONNECTOR_NAME:
        check_capacity(ns_dir.parent, run.topology.cache.capacity)
    else:
        make_store_dir(ns_dir.parent)
    # An earlier run's directory that others could read (vLLM made ECExampleConnector's
    # with umask modes) but never write, in a root only we can reach: ours to tighten.
    private.tighten(ns_dir)
    make_store_dir(ns_dir)
    last = run.sdir.last_run()
    previous = (Path(last.store_dir).parent, last.namespace) if last else None
    record_namespace(run.sdir.path, ns_dir.parent, run.plan.namespace, previous)


def start_foreground(run: Run, timeout_s: float = STARTUP_TIMEOUT_S, *,
                     on_change: Hook | None = None, on_ready: Hook | None = None) -> int:
    """Start and supervise here until a signal (130/143) or a failure (raises); all stopped."""
    from epdctl.launch.supervisor import Supervisor

    state, _ = _claim(run)
    sdir = run.sdir
    try:
        return Supervisor(sdir, state, timeout_s=timeout_s, on_change=on_change,
                          on_ready=on_ready).run()
    finally:
        sdir.unlock()
        sdir.finish(state)


def start_detached(run: Run, timeout_s: float = STARTUP_TIMEOUT_S, *,
                   on_change: Hook | None = None) -> RunState:
    """Start under a background supervisor; return once everything is ready.

    A failed start leaves nothing running and raises StartupError (with the log excerpt);
    KeyboardInterrupt abandons the start, stops everything and is raised again.
    """
    from epdctl.launch.detached import spawn_detached

    _, fd = _claim(run)
    sdir = run.sdir
    try:
        popen = spawn_detached(sdir, fd, timeout_s)
    finally:
        sdir.unlock()
    try:
        while popen.poll() is None:
            state = sdir.read()
            if on_change is not None:
                on_change(state)
            if state.phase == "running":
                return state
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        popen.send_signal(signal.SIGTERM)  # the supervisor stops everything it started
        popen.wait()
        sdir.finish(sdir.read())
        raise
    state = sdir.read()
    # A supervisor that failed cleanly stopped everything; one that was killed (SIGKILL, the
    # OOM killer) left its instances running, and without state.json `down` can't find them.
    _stop_processes(sdir, state)
    sdir.finish(state)
    log_path = sdir.logs_dir / "supervisor.log"
    raise StartupError(state.error or describe_failure("supervisor", exit_text(popen.returncode),
                                                       log_path))


def find(state_root: Path, name: str | None, *, past_runs: bool = False) -> StateDir:
    """The state dir of `name` (a topology name or file), else the only one there is."""
    from epdctl.launch.state import find_state_dir

    return find_state_dir(state_root, name, past_runs=past_runs)


def not_ready(state: RunState) -> list[str]:
    """The instances of a running topology that do not pass the readiness rule now."""
    return [s.name for s in state.specs if not is_ready(s.health_url)]


def require_ready(sdir: StateDir) -> RunState:
    """The state of a run that is up and every instance ready; NotRunningError otherwise."""
    state = sdir.read()
    late = not_ready(state)
    if state.phase != "running" or late:
        why = ", ".join(late) or state.phase
        raise NotRunningError(f"`{state.name}` is running but not ready ({why}); "
                              f"see `epdctl status --name {state.name}`")
    return state


def stop(sdir: StateDir, state: RunState | None, timeout_s: float = STOP_TIMEOUT_S, *,
         should_scan: bool = False, should_keep_cache: bool = False) -> StopResult:
    """`down`: ask the supervisor to stop, stop whatever is left, then retire the state
    (and drop the EC store unless kept). stopped = was alive."""
    result = _stop_processes(sdir, state, timeout_s, should_scan=should_scan)
    if state is not None:
        sdir.finish(state, keep_cache=should_keep_cache)
    else:
        sdir.retire()
    return result


FORCED_EXIT_S = 10.0
"""How long a supervisor told to stop at once (a second SIGTERM) may take to SIGKILL its
groups and exit, before `down` kills it too."""


def _wait_gone(proc: Record, until: float) -> None:
    while still_ours(proc) and time.monotonic() < until:
        time.sleep(0.05)


def _stop_processes(
    sdir: StateDir, state: RunState | None, timeout_s: float = STOP_TIMEOUT_S, *,
    should_scan: bool = False,
) -> StopResult:
    deadline = time.monotonic() + timeout_s
    helpers = [p for p in sidecars.recorded(sdir.path)  # what acts on the run goes first
               if still_ours(p)]
    helped = stop_all(helpers, min(timeout_s, 10.0)) if helpers else StopResult()
    procs: list[Proc] = []
    if state is not None:
        # Supervisor first (a stuck one must not restart what we stop), then proxy first.
        records = [state.records[s.name] for s in reversed(state.specs) if s.name in state.records]
        procs = [Proc.of(r) for r in ([state.supervisor] if state.supervisor else []) + records]
    if should_scan:
        known = {p.pgid for p in procs}
        procs += [p for p in scan_marked(sdir.path) if p.pgid not in known]
    alive = [p.name for p in procs if still_ours(p)
             or (p.pgid != p.pid and group_alive(p.pgid))]
    sup = state.supervisor if state else None
    is_sup_alive = sup is not None and bool(still_ours(sup))
    if sup is not None and is_sup_alive:
        os.kill(sup.pid, signal.SIGTERM)  # it stops the groups itself, proxy first
        _wait_gone(sup, deadline)
        if still_ours(sup):
            # Past the deadline a second SIGTERM makes it SIGKILL what is left at once (and
            # write down what it killed): a few moments, however loaded the machine.
            os.kill(sup.pid, signal.SIGTERM)
            _wait_gone(sup, time.monotonic() + FORCED_EXIT_S)
    last = stop_all(procs, max(deadline - time.monotonic(), 0.5))
    if state is not None:
        for record in state.records.values():
            release(record.shm_files)
        for spec in state.specs:
            ipc.remove(ipc.ours(spec.env, sdir.path, spec.name))
    ipc.remove_all(sdir.path)  # what no state names any more (`down --force`)
    sidecars.forget(sdir.path)
    killed = list(last.killed)
    if is_sup_alive:  # what it SIGKILLed itself, it wrote down
        try:
            killed += [n for n in sdir.read().killed if n not in killed]
        except EpdctlError:
            pass
    stopped = [n for n in alive if n not in killed and n not in last.stale]
    return StopResult(stopped=helped.stopped + stopped, killed=helped.killed + killed,
                      stale=last.stale)

