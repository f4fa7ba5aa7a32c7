"""A live change as steps, planned whole before anything stops (a step that cannot fit is
refused first), then carried out one at a time while the rest serves:

- add: the supervisor starts the new instance; once ready, the proxy routes to it;
- remove: the proxy drains it and takes it out of its pools; then the supervisor stops it;
- replace (`apply`: the same name, ports and devices, another definition): drained in the
  proxy as for `restart`, stopped, started as defined now, re-admitted once ready;
- switch: removed, then started as another role on its devices.

A replace or switch whose new instance does not become ready brings the old one back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from epdctl.errors import ChangeError, PlanError
from epdctl.launch import drain, live
from epdctl.launch.change import Placer
from epdctl.launch.spec import LaunchSpec
from epdctl.launch.state import RunState, SpecModel, StateDir

Kind = Literal["add", "remove", "replace", "switch"]
STOP_WAIT_S = 60.0
"""How long the supervisor may take to stop an instance it was asked to forget."""


@dataclass(frozen=True)
class Step:
    kind: Kind
    old: LaunchSpec | None
    new: LaunchSpec | None
    proxy: LaunchSpec
    """The proxy's spec once the step is done (what a restarted proxy routes to)."""

    @property
    def name(self) -> str:
        spec = self.new or self.old
        assert spec is not None
        return spec.name

    def describe(self) -> str:
        old, new = self.old, self.new
        if self.kind == "add" and new is not None:
            return f"add {new.name} ({new.role}{_on(new)})"
        if self.kind == "remove" and old is not None:
            return f"remove {old.name} ({old.role})"
        if self.kind == "replace" and new is not None:
            return f"restart {new.name} as the file now defines it"
        assert old is not None and new is not None
        return f"switch {old.name} ({old.role}) to {new.name} ({new.role}{_on(new)})"


def _on(spec: LaunchSpec) -> str:
    return f" on GPU {','.join(spec.gpus)}" if spec.gpus else ""


def scale_steps(placer: Placer, wanted: Mapping[str, int]) -> list[Step]:
    """Each role to its count: new instances on free devices, or the newest removed."""
    steps = []
    for role, count in wanted.items():
        if count < 1:
            raise PlanError(f"{role}={count}: a role keeps at least one instance while the "
                            "topology runs (its roles decide each request's path)")
        while placer.count(role) < count:
            new = placer.add(role)  # type: ignore[arg-type]
            steps.append(Step("add", None, new, placer.proxy()))
        while placer.count(role) > count:
            newest = max((s for s in placer.engines if s.role == role), key=replica)
            steps.append(Step("remove", placer.remove(newest.name), None, placer.proxy()))
    return steps


def replica(spec: LaunchSpec) -> int:
    return int(spec.name.rsplit("-", 1)[1])


def switch_steps(placer: Placer, name: str, role: str) -> list[Step]:
    """`name` stopped and its devices given to a new instance of `role`."""
    old = placer.engine(name)
    if old.role == role:
        raise PlanError(f"`{name}` is already an instance of {role}")
    placer.remove(name)
    tp = placer.topology.roles[role].tensor_parallel if role in placer.topology.roles else 1
    if old.gpus and len(old.gpus) != tp:
        raise PlanError(f"`{name}` has {len(old.gpus)} GPU(s); a {role} instance takes {tp} "
                        f"(roles -> {role} -> tensor_parallel)")
    new = placer.add(role, old.gpus if old.gpus else None)  # type: ignore[arg-type]
    return [Step("switch", old, new, placer.proxy())]


def apply_steps(placer: Placer) -> list[Step]:
    """What brings the running topology to `placer.topology`: the roles with too many
    instances scaled down first (the newest go), then the instances it defines otherwise
    restarted (one at a time), then the roles with too few scaled up."""
    placer.check_fixed()
    wanted: dict[str, int] = {role: r.replicas for role, r in placer.topology.roles.items()}
    steps = scale_steps(placer, {r: n for r, n in wanted.items() if placer.count(r) > n})
    for name in placer.changed():
        old = placer.engine(name)
        listed = placer.topology.roles[old.role].gpus  # type: ignore[index]
        if isinstance(listed, list) and not {int(g) for g in old.gpus} <= set(listed):
            raise PlanError(f"`{name}` runs on GPU {','.join(old.gpus)}, not among roles -> "
                            f"{old.role} -> gpus {listed}: moving a running instance is "
                            "`epdctl switch`, or a scale down and up")
        new = placer.replanned(old)
        placer.engines[placer.engines.index(old)] = new
        steps.append(Step("replace", old, new, placer.proxy()))
    return steps + scale_steps(placer, wanted)


@dataclass
class Rollout:
    """Steps carried out on the run in `sdir`, each waited on; `say` hears progress."""

    sdir: StateDir
    reason: str
    drain_s: float
    timeout_s: float
    say: Callable[[str], None] = lambda text: None
    topology_path: Path | None = None
    """The file the run follows once the last step is done (`apply FILE`)."""
    _is_last: bool = False
    _followed: str = ""
    """The file the run followed before (what an undo puts back)."""

    def run(self, steps: list[Step]) -> list[dict[str, Any]]:
        done = []
        self._followed = self.sdir.read().topology_path
        for i, step in enumerate(steps):
            began = time.monotonic()
            self.say(f"{step.describe()} ({i + 1}/{len(steps)})")
            self._is_last = i == len(steps) - 1
            drained = getattr(self, f"_{step.kind}")(self.sdir.read(), step)
            done.append({"step": step.kind, "name": step.name,
                         "role": (step.new or step.old).role,  # type: ignore[union-attr]
                         "seconds": round(time.monotonic() - began, 1),
                         "finished": drained.finished if drained else None,
                         "cut": drained.in_flight if drained else None})
        return done

    def _ask(self, step: Step, *, remove: tuple[LaunchSpec, ...] = (),
             add: tuple[LaunchSpec, ...] = (), proxy: LaunchSpec | None = None
             ) -> live.Request:
        """Leave the supervisor a change; `proxy` given: an undo (the run's file stays)."""
        path = str(self.topology_path.absolute()) if self.topology_path and self._is_last \
            else None
        change = live.new_request(
            f"{self.reason}: {step.describe()}" + (" (undone)" if proxy else ""),
            remove=[s.name for s in remove], add=[SpecModel.of(s) for s in add],
            proxy=SpecModel.of(proxy or step.proxy),
            topology_path=self._followed if proxy else path)
        live.request(self.sdir, change)
        return change

    def _add(self, state: RunState, step: Step) -> None:
        new = step.new
        assert new is not None
        change = self._ask(step, add=(new,))
        try:
            live.wait_ready(self.sdir, change, new.name, self.timeout_s)
        except ChangeError:
            self._ask(step, remove=(new,), proxy=state.proxy.spec())  # one that never came up
            raise
        if not drain.add_instance(state, new.url, new.role):
            raise ChangeError(f"`{new.name}` is ready, but the proxy did not take it into its "
                              "pools (is it running? `epdctl status`)")

    def _remove(self, state: RunState, step: Step) -> drain.Drained:
        old = step.old
        assert old is not None
        drained = drain.remove_instance(state, old.url, self.drain_s)
        if drained is None:
            raise ChangeError(f"the proxy did not take `{old.name}` out of its pools; nothing "
                              "was stopped (is it running? `epdctl status`)")
        self._ask(step, remove=(old,))
        live.wait_gone(self.sdir, old.name, STOP_WAIT_S)
        return drained

    def _replace(self, state: RunState, step: Step) -> drain.Drained | None:
        old, new = step.old, step.new
        assert old is not None and new is not None
        drained = drain.drain_instance(state, old.url, self.drain_s)
        try:
            self._swap(state, step, old, new)
        finally:
            drain.admit_instance(state, old.url)  # the same URL: new, or the old one back
        return drained

    def _switch(self, state: RunState, step: Step) -> drain.Drained:
        old, new = step.old, step.new
        assert old is not None and new is not None
        drained = drain.remove_instance(state, old.url, self.drain_s)
        if drained is None:
            raise ChangeError(f"the proxy did not take `{old.name}` out of its pools; nothing "
                              "was stopped (is it running? `epdctl status`)")
        try:
            self._swap(state, step, old, new)
        except ChangeError:
            drain.add_instance(state, old.url, old.role)  # back as it was
            raise
        drain.add_instance(state, new.url, new.role)
        return drained

    def _swap(self, state: RunState, step: Step, old: LaunchSpec, new: LaunchSpec) -> None:
        """Stop `old`, start `new` in its place; where `new` is not ready in time, `old`
        is started again (ChangeError says both)."""
        change = self._ask(step, remove=(old,), add=(new,))
        try:
            live.wait_ready(self.sdir, change, new.name, self.timeout_s)
        except ChangeError as exc:
            back = self._ask(step, remove=(new,), add=(old,), proxy=state.proxy.spec())
            try:
                live.wait_ready(self.sdir, back, old.name, self.timeout_s)
            except ChangeError as again:
                raise ChangeError(f"{exc}; and `{old.name}` did not come back: {again}"
                                  ) from None
            raise ChangeError(f"{exc}; `{old.name}` is back as it was") from None
