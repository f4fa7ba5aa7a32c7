"""The one supervisor loop (foreground `up`, or `python -m epdctl.launch.detached` for
`up -d`)."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from epdctl.errors import EpdctlError, InstanceDiedError, StartupError
from epdctl.host import ipc
from epdctl.host.shm import mapped_files, release
from epdctl.launch import live, restart_one, sidecars
from epdctl.launch.drain import DRAIN_S, Drain
from epdctl.launch.processes import (
    STOP_TIMEOUT_S,
    Proc,
    StopResult,
    describe_failure,
    exit_text,
    spawn,
    stop_all,
)
from epdctl.launch.readiness import STARTUP_TIMEOUT_S, is_ready, judge
from epdctl.launch.restarts import Budget
from epdctl.launch.spec import LaunchSpec
from epdctl.launch.state import Record, RunState, StateDir
from epdctl.logs.stamps import Stamper

TICK_S = 0.2
REBALANCER = "rebalancer"
"""The sidecar `up --rebalance` runs (python -m epdctl.rebalance.loop)."""
HEALTH_INTERVAL_S = 5.0
JANITOR_INTERVAL_S = 5.0
EXIT_SIGINT, EXIT_SIGTERM = 130, 143

Hook = Callable[[RunState], None]


@dataclass
class _Slot:
    spec: LaunchSpec
    proc: Proc | None = None
    restart_at: float | None = None
    probed_at: float = 0.0
    is_asked: bool = False
    """Restarted because `epdctl restart` asked: not counted as a restart after a failure."""
    change: str | None = None
    """The live change that added it, until it is first ready (a death before is the
    change's failure, not the topology's)."""


class Supervisor:
    """Starts the plan in state.json, waits until ready, then watches until told to stop."""

    def __init__(
        self,
        sdir: StateDir,
        state: RunState,
        *,
        timeout_s: float = STARTUP_TIMEOUT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        on_change: Hook | None = None,
        on_ready: Hook | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sdir, self.state = sdir, state
        self.clock = clock  # the wall clock of restart times (state.json keeps them)
        self.timeout_s, self.stop_timeout_s = timeout_s, stop_timeout_s
        self.on_change, self.on_ready = on_change, on_ready
        self.slots = [_Slot(s.spec()) for s in state.specs]
        self.signals: list[int] = []
        self._janitor_at = 0.0
        self._janitor_error = ""  # said once, not every pass
        self._drain: Drain | None = None
        # When each log line was written, for `epdctl logs` (engines write their logs directly).
        self._stamper = Stamper([*(s.spec.log_path for s in self.slots),
                                 sdir.logs_dir / "supervisor.log"])

    def run(self) -> int:
        """Supervise until a signal (returns 130/143) or a failure (raises, all stopped)."""
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum: int, frame: FrameType | None) -> None:
            self.signals.append(signum)  # the loop acts; handlers stay trivial

        for sig in previous:
            signal.signal(sig, handler)
        try:
            return self._loop()
        finally:
            if any(s.proc for s in self.slots) and self.state.phase in ("starting", "running"):
                self.stop()  # an unexpected exception: never leave groups behind
            for sig, old in previous.items():
                signal.signal(sig, old)

    def stop(self) -> StopResult:
        """Stop every group (proxy first) and record the outcome in state.json."""
        self.state.phase = "stopping"
        self._save()
        procs = [s.proc for s in reversed(self.slots) if s.proc is not None]
        # One more Ctrl+C (or SIGTERM) than made it stop skips the grace period: the second
        # (the third where the first drained).
        patience = 2 if self._drain is not None else 1
        result = stop_all(procs, self.stop_timeout_s,
                          should_force=lambda: len(self.signals) > patience)
        self._stamper.tick(force=True)  # the lines written while stopping
        self.state.killed = result.killed
        for record in self.state.records.values():
            release(record.shm_files)
        for slot in self.slots:
            ipc.remove(ipc.ours(slot.spec.env, self.sdir.path, slot.spec.name))
        if self.state.phase == "stopping":
            self.state.phase = "stopped"
        for slot in self.slots:
            slot.proc = None
        self._save()
        return result

    def _loop(self) -> int:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.signals and not self._is_draining():
                self.stop()
                return EXIT_SIGINT if self.signals[0] == signal.SIGINT else EXIT_SIGTERM
            self._check_exits()
            self._restart_requested()
            self._changes_requested()
            self._start_due()
            self._probe()
            self._stamper.tick()
            if self.state.phase == "starting":
                if all(self._state(s) == "ready" for s in self.slots):
                    self.state.phase = "running"
                    self._save()
                    if self.state.settings.rebalance is not None:  # `up --rebalance`
                        sidecars.spawn(self.sdir.path, REBALANCER, sidecars.python_module(
                            "epdctl.rebalance.loop", str(self.sdir.path)))
                    if self.on_ready:
                        self.on_ready(self.state)
                elif time.monotonic() > deadline:
                    late = next(s for s in self.slots if self._state(s) != "ready")
                    what = f"was not ready within {self.timeout_s:g}s"
                    self._fail(StartupError, describe_failure(late.spec.name, what,
                                                              late.spec.log_path))
            else:
                self._janitor()
            time.sleep(TICK_S)

    def _is_draining(self) -> bool:
        """Ctrl+C while serving: the proxy's requests in flight finish first (up to
        DRAIN_S), while everything else goes on; a second Ctrl+C, SIGTERM, or the drain's
        end: no longer (then the loop stops everything)."""
        if self.signals != [signal.SIGINT] or self.state.phase != "running":
            return False
        if self._drain is None:
            self._drain = Drain(self.state, DRAIN_S)
        return not self._drain.is_over()

    def _restart_requested(self) -> None:
        """`epdctl restart NAME`: stop its group and start it again at once (no backoff,
        nothing spent of its restart budget)."""
        for name in restart_one.take(self.sdir.path):
            slot = next((s for s in self.slots if s.spec.name == name), None)
            if slot is None or slot.spec.is_proxy or self.state.phase != "running":
                continue
            print(f"epdctl: restarting `{name}` (asked for)", file=sys.stderr, flush=True)
            if slot.proc is not None:
                stop_all([slot.proc], self.stop_timeout_s)
                slot.proc = None
            record = self.state.records[name]
            release(record.shm_files)
            ipc.remove(ipc.ours(slot.spec.env, self.sdir.path, name))
            record.state, slot.restart_at, slot.is_asked = "backoff", time.monotonic(), True
            self._save()

    def _changes_requested(self) -> None:
        """`epdctl scale`, `switch`, `apply` (launch.live): forget and stop what goes, add
        what comes (started by _start_due), and the proxy's spec for a later restart."""
        for change in live.take(self.sdir.path):
            if self.state.phase != "running":
                live.log(self.sdir.path, {"id": change.id, "error": f"not running "
                                          f"({self.state.phase}): nothing changed"})
                continue
            for name in change.remove:
                self._forget(name)
            for model in change.add:
                self.state.specs.insert(len(self.state.specs) - 1, model)
                self.slots.insert(len(self.slots) - 1, _Slot(model.spec(), change=change.id))
                self._stamper.sizes.setdefault(model.spec().log_path, 0)
            if change.proxy is not None:
                self.state.specs[-1] = change.proxy
                self.slots[-1].spec = change.proxy.spec()
            if change.topology_path is not None:
                self.state.topology_path = change.topology_path
            print(f"epdctl: {change.reason}", file=sys.stderr, flush=True)
            live.log(self.sdir.path, {"id": change.id, "reason": change.reason,
                                      "remove": change.remove,
                                      "add": [m.name for m in change.add]})
            self._save()

    def _forget(self, name: str) -> None:
        """Stop an engine's group and drop it from the run (its log stays)."""
        slot = next((s for s in self.slots if s.spec.name == name and not s.spec.is_proxy),
                    None)
        if slot is None:
            return
        if slot.proc is not None:
            stop_all([slot.proc], self.stop_timeout_s)
        record = self.state.records.pop(name, None)
        if record is not None:
            release(record.shm_files)
        ipc.remove(ipc.ours(slot.spec.env, self.sdir.path, name))
        self.slots.remove(slot)
        self.state.specs = [s for s in self.state.specs if s.name != name]

    def _state(self, slot: _Slot) -> str:
        record = self.state.records.get(slot.spec.name)
        return record.state if record else "pending"

    def _check_exits(self) -> None:
        for slot in list(self.slots):  # a live change's failed start leaves them
            if slot.proc is None or slot.proc.popen is None:
                continue
            code = slot.proc.popen.poll()
            if code is None:
                continue
            record = self.state.records[slot.spec.name]
            record.state, record.exit_code = "exited", code
            # The leader is gone; what it started (engine core, workers) goes with it, or a
            # restart would find the port, memory and GPU still held.
            stop_all([slot.proc], 0.0)
            release(record.shm_files)
            ipc.remove(ipc.ours(slot.spec.env, self.sdir.path, slot.spec.name))
            slot.proc = None
            name, log = slot.spec.name, slot.spec.log_path
            if slot.change is not None:  # added live, never ready: the change failed
                what = f"{exit_text(code)} while starting"
                live.log(self.sdir.path, {"id": slot.change, "name": name,
                                          "error": describe_failure(name, what, log, code)})
                self._forget(name)
                self._save()
                continue
            if self.state.phase == "starting":
                what = f"{exit_text(code)} while starting"
                self._fail(StartupError, describe_failure(name, what, log, code))
            if self.state.settings.restart_policy != "on-failure" or code == 0:
                what = f"{exit_text(code)} while serving"
                self._fail(InstanceDiedError, describe_failure(name, what, log, code))
            elif not self._restart(slot, record, code):
                self._give_up(slot, record, code)

    def _restart(self, slot: _Slot, record: Record, code: int) -> bool:
        """Schedule the restart of an instance that exited while serving, if its budget for
        the window allows one (restarts older than the window are forgiven)."""
        budget, now = Budget.of(self.state.settings), self.clock()
        delay_s = budget.next_delay_s(record.restart_times, now)
        if delay_s is None:
            return False
        record.restart_times = [*budget.recent(record.restart_times, now), now]
        record.state = "backoff"
        slot.restart_at = time.monotonic() + delay_s
        print(f"epdctl: `{slot.spec.name}` {exit_text(code)}; restarting in {delay_s:g}s "
              f"(restart {len(record.restart_times)} of {budget.max_restarts} within "
              f"{budget.window_s:g}s)", file=sys.stderr, flush=True)
        self._save()
        return True

    def _give_up(self, slot: _Slot, record: Record, code: int) -> None:
        """An instance out of restarts stays down (`failed`) while its role has another
        instance running or restarting; the topology fails once a role has none left."""
        budget = Budget.of(self.state.settings)
        recent = budget.recent(record.restart_times, self.clock())
        what = (f"{exit_text(code)} while serving (after {len(recent)} restart(s)); out of "
                f"restarts ({budget.max_restarts} within {budget.window_s:g}s)")
        message = describe_failure(slot.spec.name, what, slot.spec.log_path, code)
        record.state, record.error = "failed", message
        role = slot.spec.role
        peers = [s for s in self.slots if s.spec.role == role]
        alive = [s.spec.name for s in peers if s.proc is not None or s.restart_at is not None]
        if alive:
            print(f"epdctl: {message}\nepdctl: `{slot.spec.name}` stays down; role `{role}` "
                  f"goes on with {', '.join(f'`{n}`' for n in alive)}", file=sys.stderr,
                  flush=True)
            self._save()
            return
        names = ", ".join(f"`{s.spec.name}`" for s in peers)
        self._fail(InstanceDiedError,
                   f"role `{role}` has no instance left ({names} out of restarts); {message}")

    def _start_due(self) -> None:
        now = time.monotonic()
        ready = {s.spec.name for s in self.slots if self._state(s) == "ready"}
        engines = {s.spec.name for s in self.slots if not s.spec.is_proxy}
        for slot in self.slots:
            if slot.proc is not None:
                continue
            record = self.state.records.get(slot.spec.name)
            if record is not None and (slot.restart_at is None or now < slot.restart_at):
                continue
            # The proxy starts last; GPU sharers wait for whoever holds the GPU first.
            needs = engines if slot.spec.is_proxy else set(slot.spec.start_after)
            if not needs <= ready:
                continue
            restarts = record.restarts + (not slot.is_asked) if record else 0
            slot.proc, slot.restart_at = spawn(slot.spec, self.sdir.path), None
            slot.is_asked = False
            self.state.records[slot.spec.name] = Record(
                name=slot.spec.name, pid=slot.proc.pid, pgid=slot.proc.pgid,
                create_time=slot.proc.create_time, start_ticks=slot.proc.start_ticks,
                started_at=time.time(), restarts=restarts,
                restart_times=record.restart_times if record else [],
            )
            self._save()  # recorded before waiting, so `down` finds it even if we die now

    def _probe(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            record = self.state.records.get(slot.spec.name)
            if slot.proc is None or record is None:
                continue
            if record.state != "starting" and now - slot.probed_at < HEALTH_INTERVAL_S:
                continue
            slot.probed_at = now
            is_ok = is_ready(slot.spec.health_url)
            if is_ok:
                known = set(record.shm_files)
                record.shm_files = sorted(known | set(mapped_files(slot.proc.pgid)))
                if len(record.shm_files) != len(known):
                    self._save()
            new = judge(True, is_ok, record.ready_at is not None)
            if is_ok and record.ready_at is None:
                record.ready_at = time.time()
                slot.change = None
            if new != record.state:
                record.state = new  # type: ignore[assignment]
                self._save()

    def _janitor(self) -> None:
        now = time.monotonic()
        if now - self._janitor_at < JANITOR_INTERVAL_S or not self.state.is_our_store:
            return
        self._janitor_at = now
        from epdctl.cache.janitor import keep_topology_store
        from epdctl.cache.store_root import earlier_namespaces

        s = self.state.settings
        ns_dir = Path(self.state.store_dir)
        try:
            keep_topology_store(ns_dir, self.state.name,
                                earlier=earlier_namespaces(self.sdir.path, ns_dir.parent),
                                capacity_bytes=s.cache_capacity_bytes, ttl_s=s.cache_ttl_s,
                                grace_s=s.cache_grace_s)
        except Exception as exc:  # the janitor must never take the topology down
            text = str(exc) if isinstance(exc, EpdctlError) else repr(exc)
            if text != self._janitor_error:
                print(f"epdctl: cache janitor failed: {text}", file=sys.stderr, flush=True)
            self._janitor_error = text
        else:
            self._janitor_error = ""

    def _fail(self, error: type[EpdctlError], message: str) -> None:
        self.state.phase = "failed" if error is StartupError else "exited"
        self.state.error = message
        self._save()
        phase = self.state.phase
        self.stop()
        self.state.phase = phase
        self._save()
        raise error(message)

    def _save(self) -> None:
        self.sdir.write(self.state)
        if self.on_change:
            self.on_change(self.state)
