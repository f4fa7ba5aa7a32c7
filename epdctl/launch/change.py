"""A running topology's instances changed live (`epdctl scale`, `switch`, `apply`), planned
before anything stops: where a new instance goes (its name, ports and devices, none of them
taken), what an instance of an edited topology would be, and what cannot change while the
topology runs (its roles, model and encoder cache, the proxy's settings).

Pure but for the port check: the supervisor carries a plan out (launch.live)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from epdctl.errors import PlanError
from epdctl.launch.connectors import connector_for
from epdctl.launch.engine_spec import Engines, EngineSlot, engine_command, engine_env, engine_spec
from epdctl.launch.plan import compute_namespace, has_quiet_probes, proxy_spec
from epdctl.launch.ports import free_ports, port_blocks, taken_ports
from epdctl.launch.spec import PROBE_PATHS, LaunchSpec
from epdctl.launch.state import RunState
from epdctl.proxy.config import ProxyConfig
from epdctl.topology.keys import has_api_key, with_api_key
from epdctl.topology.model import ROLE_NAMES, ROLE_PREFIX, RoleName, Topology

CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""Where a CPU instance's cores are: set from its place among the instances when it started,
not part of what it is."""
ROLE_URLS = ("encode", "prefill_decode", "prefill", "decode")
"""The ProxyConfig fields that list each role's instances: what a live change alters."""


def as_running(topology: Topology, state: RunState) -> Topology:
    """`topology` with what `up` resolved for the run: its EC store's root and the proxy's
    key (read from its file)."""
    cache = topology.cache.model_copy(update={"dir": Path(state.store_dir).parent})
    return topology.model_copy(update={"cache": cache, "proxy": with_api_key(topology.proxy)})


SHORT = {"encode": "e", "prefill_decode": "pd", "prefill": "p", "decode": "d"}
"""What a command line may call a role for short."""


def role_of(text: str) -> RoleName:
    """A role by its name (prefill_decode), its short name (pd) or its instances' prefix;
    PlanError else."""
    for role in ROLE_NAMES:
        if text in (role, SHORT[role], ROLE_PREFIX[role]):
            return role
    names = ", ".join(f"{r} ({SHORT[r]})" for r in ROLE_NAMES)
    raise PlanError(f"no role {text!r}: roles are {names}")


@dataclass
class Placer:
    """The running topology's engines as a change leaves them, placed one change at a time
    (`engines` is the working copy; the state is not touched)."""

    topology: Topology
    state: RunState
    state_dir: Path
    visible_gpus: Sequence[str] = ()
    cpu_count: int = 1
    python: str = sys.executable
    vllm_version: str = "unknown"
    engines: list[LaunchSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.engines:
            self.engines = [s.spec() for s in self.state.engines]
        self._connector = connector_for(self.topology.cache.connector)
        self._shared = Engines(
            self.topology, self._connector, self.state_dir,
            self.state.namespace, (*engine_command(self.topology, self.python),),
            PROBE_PATHS if has_quiet_probes(self.vllm_version) else (),
            self.state.internal_key is not None or has_api_key(self.topology.proxy))

    def count(self, role: str) -> int:
        return sum(1 for s in self.engines if s.role == role)

    def add(self, role: RoleName, devices: Sequence[str] | None = None) -> LaunchSpec:
        """One more instance of `role`: the first free name, ports and (without `devices`)
        free GPUs; PlanError in one line where none are left."""
        if role not in self.topology.roles:
            raise PlanError(f"`{self.state.name}` has no {role} role (its roles: "
                            f"{', '.join(self.topology.roles)}): a role cannot be added while "
                            "it runs")
        tp = self.topology.roles[role].tensor_parallel
        gpus = tuple(devices) if devices is not None else self._free_gpus(role, tp)
        replica = next(n for n in range(len(self.engines) + 1)
                       if f"{ROLE_PREFIX[role]}-{n}" not in {s.name for s in self.engines})
        port, side, ec = self._free_ports(role, tp)
        slot = EngineSlot(role, replica, len(self.engines), port, side, ec, gpus)
        spec = self._spec(slot, len(self.engines) + 1)
        self.engines.append(spec)
        return spec

    def remove(self, name: str) -> LaunchSpec:
        spec = self.engine(name)
        if self.count(spec.role) == 1:
            raise PlanError(f"`{name}` is the only {spec.role} instance of "
                            f"`{self.state.name}`: its role would have none")
        self.engines.remove(spec)
        return spec

    def engine(self, name: str) -> LaunchSpec:
        found = next((s for s in self.engines if s.name == name), None)
        if found is None:
            names = ", ".join(s.name for s in self.engines)
            raise PlanError(f"no instance `{name}` in `{self.state.name}` (instances: {names})")
        return found

    def replanned(self, spec: LaunchSpec) -> LaunchSpec:
        """What `spec`'s instance would be under this topology, in the same place (name,
        ports, devices, cores): equal to it where nothing about it changed."""
        slot = EngineSlot(spec.role, int(spec.name.rsplit("-", 1)[1]),  # type: ignore[arg-type]
                          0, spec.port, spec.side_channel_port, spec.ec_ports, spec.gpus,
                          spec.start_after)
        new = self._spec(slot, 1)
        env = {k: v for k, v in new.env.items() if k != CPU_BIND_ENV}
        if CPU_BIND_ENV in spec.env and CPU_BIND_ENV in new.env:
            env[CPU_BIND_ENV] = spec.env[CPU_BIND_ENV]
        return dataclasses.replace(new, env=env)

    def changed(self) -> list[str]:
        """The engines this topology would make otherwise than they run (in order)."""
        return [s.name for s in self.engines
                if s.role in self.topology.roles and self.replanned(s) != s]

    def proxy(self) -> LaunchSpec:
        """The proxy's spec for the engines as they are now (its command as it runs: a test
        may have replaced it), so that a proxy restarted later routes to them."""
        running = self.state.proxy.spec()
        new = proxy_spec(self.topology, self.state_dir, self.engines, self.python,
                         self.state.namespace, self.state.internal_key)
        return dataclasses.replace(new, command=running.command)

    def check_fixed(self) -> None:
        """PlanError in one line for what a live change cannot alter: the roles, the encoder
        cache's namespace (the model, what makes its outputs comparable, the connector) and
        the proxy's own settings (it is not restarted)."""
        running = set(s.role for s in self.state.engines)
        if set(self.topology.roles) != running:
            raise PlanError(f"the roles differ ({', '.join(sorted(running))} running, "
                            f"{', '.join(sorted(self.topology.roles))} given): a topology's "
                            "roles are fixed while it runs; `epdctl down` and `up` change them")
        if self.topology.name != self.state.name:
            raise PlanError(f"the name differs (`{self.state.name}` running, "
                            f"`{self.topology.name}` given)")
        if compute_namespace(self.topology, self.vllm_version) != self.state.namespace:
            raise PlanError("the encoder cache's namespace differs (the model, the flags that "
                            "make encoder outputs comparable, or cache.connector changed): "
                            "`epdctl down` and `up` change them")
        if _settings(self.proxy()) != _settings(self.state.proxy.spec()):
            raise PlanError("the proxy's settings differ (or depend on the instances, as "
                            f"{self.topology.cache.connector}'s do): the proxy is not "
                            "restarted by a live change; `epdctl down` and `up` change them")

    def _spec(self, slot: EngineSlot, instances: int) -> LaunchSpec:
        env = engine_env(self.topology, self._connector, self.state_dir, slot, self.cpu_count,
                         instances, self.state.internal_key)
        return engine_spec(self._shared, slot, env)

    def _free_gpus(self, role: RoleName, tp: int) -> tuple[str, ...]:
        """The first `tp` visible GPUs no running instance holds (a role's `gpus` list places
        its replicas at `up`; instances beyond them go where there is room)."""
        if self.topology.device != "cuda":
            return ()
        used = {g for s in self.engines for g in s.gpus}
        free = [g for g in self.visible_gpus if g not in used]
        if len(free) < tp:
            raise PlanError(f"no room for another {role} instance: it needs {tp} free GPU(s), "
                            f"{len(free)} {'is' if len(free) == 1 else 'are'} free; `epdctl "
                            "switch` moves an instance's GPUs to another role")
        return tuple(free[:tp])

    def _free_ports(self, role: RoleName, tp: int
                    ) -> tuple[int, int | None, tuple[int, ...]]:
        """A free HTTP port from ports.base, a NIXL side channel (P and D) and the EC
        connector's ports from side_channel_base: none that a running instance, the proxy
        or another process holds."""
        used = {self.state.proxy.port}
        for s in self.engines:
            used |= {s.port, *s.ec_ports} | ({s.side_channel_port} - {None})  # type: ignore
        ports = self.topology.ports

        def one(start: int, what: str) -> int:
            while True:
                port = free_ports(start, 1, used, what)[0]
                used.add(port)
                if not taken_ports([port]):
                    return port

        http = one(ports.base, "ports -> base")
        side = one(ports.side_channel_base, "ports -> side_channel_base") \
            if role in ("prefill", "decode") else None
        count = self._connector.port_count(role, tp) if "encode" in self.topology.roles else 0
        start = ports.side_channel_base
        while True:
            (ec,) = port_blocks(start, [count], used, "ports -> side_channel_base")
            if not taken_ports(ec):
                return http, side, ec
            start = ec[0] + 1


def _settings(proxy: LaunchSpec) -> tuple[tuple[str, ...], dict[str, str]]:
    """The proxy's flags but its instances' URLs, and its env (the keys)."""
    flags = {f.metadata["flag"] for f in dataclasses.fields(ProxyConfig) if f.name in ROLE_URLS}
    args, kept = list(proxy.args), []
    while args:
        arg = args.pop(0)
        if arg in flags:
            args.pop(0)
        else:
            kept.append(arg)
    return tuple(kept), dict(proxy.env)


def placer(topology: Topology, state: RunState, state_dir: Path) -> Placer:
    """A Placer for the run in `state` on this machine (its GPUs, cores and vLLM)."""
    from epdctl.launch.resolve import vllm_version

    gpus: list[str] = []
    if topology.device == "cuda":
        from epdctl.host.gpus import visible_gpus

        gpus = visible_gpus()
    return Placer(as_running(topology, state), state, state_dir, tuple(gpus),
                  len(os.sched_getaffinity(0)), vllm_version=vllm_version())

