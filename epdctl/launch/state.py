"""The state dir of one topology: lock, atomic state.json, and liveness of recorded pids."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from epdctl.cache import CONNECTOR_NAME
from epdctl.errors import AlreadyRunningError, EpdctlError, NotRunningError, StateError
from epdctl.host import private
from epdctl.launch.identity import still_ours
from epdctl.launch.spec import HOST, LaunchSpec, Plan
from epdctl.proxy.config import API_KEY_ENV, UPSTREAM_KEY_ENV
from epdctl.topology.sections import Cache, Rebalance, Restart

STATE_VERSION = 2
# Kept by `down` instead of state.json, so `logs` still knows names and their order.
LAST_RUN = "last-run.json"
Phase = Literal["starting", "running", "stopping", "stopped", "failed", "exited"]
InstanceState = Literal["pending", "starting", "ready", "unhealthy", "exited", "backoff",
                        "failed"]

_CONFIG = ConfigDict(extra="forbid")
_RESTART, _CACHE = Restart(), Cache()


class SpecModel(BaseModel):
    """A LaunchSpec as stored in state.json: the same fields (argv stays derived)."""

    model_config = _CONFIG
    name: str
    role: str
    command: list[str]
    port: int
    log_path: str
    host: str = HOST
    args: list[str] = []
    served_model_name: str | None = None
    tensor_parallel: int = 1
    gpu_memory_utilization: float | None = None
    ec_config: dict[str, Any] | None = None
    kv_config: dict[str, Any] | None = None
    env: dict[str, str] = {}
    gpus: list[str] = []
    side_channel_port: int | None = None
    start_after: list[str] = []
    ec_ports: list[int] = []
    is_key_required: bool = False
    quiet_paths: list[str] = []
    log_requests: bool = False

    @classmethod
    def of(cls, spec: LaunchSpec) -> SpecModel:
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        fields["log_path"] = str(spec.log_path)
        return cls.model_validate(fields)

    def spec(self) -> LaunchSpec:
        fields: dict[str, Any] = {
            name: tuple(value) if isinstance(value, list) else value
            for name, value in self.model_dump().items()
        }
        fields["log_path"] = Path(self.log_path)
        return LaunchSpec(**fields)

    # What a LaunchSpec derives from these fields, the stored one derives the same way.
    url = property(lambda self: self.spec().url)
    health_url = property(lambda self: self.spec().health_url)
    is_proxy = property(lambda self: self.spec().is_proxy)


class Record(BaseModel):
    """One process epdctl started: enough to find it again, and to know it is still ours."""

    model_config = _CONFIG
    name: str
    pid: int
    pgid: int
    create_time: float
    start_ticks: int | None = None
    """Its start in clock ticks since boot: what says it is still ours, whatever the clock
    did since (state written before it existed: none, and create_time decides)."""
    started_at: float
    """Wall-clock time of the spawn."""
    ready_at: float | None = None
    state: InstanceState = "starting"
    restarts: int = 0
    """Restarts in the run's whole life (`status` shows it)."""
    restart_times: list[float] = []
    """Wall-clock times of its restarts within `restart.window` (the budget counts these;
    state written before it existed: none)."""
    exit_code: int | None = None
    error: str | None = None
    """Why the supervisor gave up on it (state `failed`): its exit and its log's last lines."""
    shm_files: list[str] = []
    """/dev/shm files its processes mapped: unlinked once the group is gone (see shm.py)."""


class Settings(BaseModel):
    """The topology settings the supervisor needs after `up` returned."""

    model_config = _CONFIG
    # Defaults are the topology's own (run.settings_of maps a topology into these).
    restart_policy: Literal["no", "on-failure"] = _RESTART.policy
    max_restarts: int = _RESTART.max_restarts
    backoff_s: float = _RESTART.backoff
    restart_window_s: float = _RESTART.window
    max_backoff_s: float = _RESTART.max_backoff
    cache_capacity_bytes: int = _CACHE.capacity
    cache_ttl_s: float = _CACHE.ttl
    cache_grace_s: float = _CACHE.grace
    keep_cache_on_down: bool = _CACHE.keep_on_down
    rebalance: Rebalance | None = None
    """`up --rebalance` (or `rebalance.enabled`): the rebalancer's policy (else none runs)."""


class RunState(BaseModel):
    """state.json: the plan, where every process is, and how the run is going."""

    model_config = _CONFIG
    version: int = STATE_VERSION
    name: str
    topology_path: str
    created_at: float
    mode: str
    namespace: str
    store_dir: str
    """The namespace's directory: epdctl's store, or ECExampleConnector's files."""
    model_name: str
    ec_connector: str = CONNECTOR_NAME
    """cache.connector (state written before it existed: epdctl's)."""
    specs: list[SpecModel]
    """Engines in start order, the proxy last."""
    settings: Settings = Settings()
    phase: Phase = "starting"
    error: str | None = None
    """Why the run failed, for the `up -d` that waits on a detached supervisor."""
    killed: list[str] = []
    supervisor: Record | None = None
    records: dict[str, Record] = {}

    @classmethod
    def of(cls, plan: Plan, topology_path: str, settings: Settings) -> RunState:
        return cls(
            name=plan.name, topology_path=topology_path, created_at=time.time(), mode=plan.mode,
            namespace=plan.namespace, store_dir=str(plan.store_dir), model_name=plan.model_name,
            ec_connector=plan.ec_connector, specs=[SpecModel.of(s) for s in plan.specs],
            settings=settings,
        )

    @property
    def is_our_store(self) -> bool:
        """Whether the EC connector is epdctl's own shared-memory store."""
        return self.ec_connector == CONNECTOR_NAME

    @property
    def proxy(self) -> SpecModel:
        return next(s for s in self.specs if s.is_proxy)

    @property
    def engines(self) -> list[SpecModel]:
        """The engine instances, in start order."""
        return [s for s in self.specs if not s.is_proxy]

    @property
    def proxy_api_key(self) -> str | None:
        """The key the proxy requires (None: open), for epdctl's own requests through it."""
        return self.proxy.env.get(API_KEY_ENV)

    @property
    def internal_key(self) -> str | None:
        """The key the instances require (None: open), for epdctl's own requests to them."""
        return self.proxy.env.get(UPSTREAM_KEY_ENV)


class StateDir:
    """`<root>/<name>/`: state.json, lock, logs/."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.state_file = path / "state.json"
        self.lock_file = path / "lock"
        self.logs_dir = path / "logs"
        self._lock_fd: int | None = None

    def exists(self) -> bool:
        return self.state_file.exists()

    def read(self) -> RunState:
        """The validated state; NotRunningError when absent, StateError when unreadable."""
        way_out = f"run `epdctl down --force --name {self.path.name}` to stop whatever it started"
        try:
            # Bytes, not text: pydantic reports bad UTF-8 as corrupt JSON, not a traceback.
            data = self.state_file.read_bytes()
        except FileNotFoundError:
            raise NotRunningError(
                f"`{self.path.name}` is not running (no {self.state_file})"
            ) from None
        except OSError as exc:
            raise StateError(
                f"cannot read {self.state_file}: {exc.strerror or exc}; {way_out}"
            ) from None
        try:
            return RunState.model_validate_json(data)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "file"
            raise StateError(f"{self.state_file} is corrupt ({where}: {first['msg']}); {way_out}"
                             ) from None

    def make(self) -> None:
        """Create the state dir 0700 (its root too, when missing); StateError if it is not
        the user's alone. state.json holds the API keys; the logs hold prompts' traces."""
        self.path.parent.mkdir(mode=private.DIR_MODE, parents=True, exist_ok=True)
        private.own_dir(self.path)
        private.check_dir(self.path, "the state dir", "pick another --state-dir", StateError)

    def write(self, state: RunState) -> None:
        """Atomically replace state.json (0600, see private.write_file), so a reader never
        sees half a file and a link planted at its name is not followed."""
        self.make()
        private.write_file(self.state_file, state.model_dump_json(indent=1).encode())

    def retire(self) -> None:
        """Keep the last run's state as last-run.json (logs need the names); drop state.json."""
        try:
            os.replace(self.state_file, self.path / LAST_RUN)
        except FileNotFoundError:
            pass
        except OSError:
            # state.json is something os.replace cannot move over last-run.json (a
            # directory, say): it is not a run's state either way, so it goes.
            import shutil

            shutil.rmtree(self.state_file, ignore_errors=True)
            self.state_file.unlink(missing_ok=True)

    def finish(self, state: RunState, *, keep_cache: bool = False) -> None:
        """After the last process is gone: retire state.json and drop the EC store dir."""
        import shutil

        self.retire()
        if not (keep_cache or state.settings.keep_cache_on_down):
            shutil.rmtree(state.store_dir, ignore_errors=True)
            try:
                os.rmdir(Path(state.store_dir).parent)  # the store root, once nothing is left
            except OSError:
                pass  # another namespace lives there (or it was never ours to make)

    def last_run(self) -> RunState | None:
        try:
            return RunState.model_validate_json((self.path / LAST_RUN).read_text("utf-8"))
        except (OSError, ValidationError):
            return None

    def lock(self) -> int:
        """Take the supervisor lock (non-blocking); AlreadyRunningError if someone holds it."""
        self.make()
        try:
            fd = private.open_file(self.lock_file, os.O_RDWR)
        except OSError as exc:  # a link, or a file that is not ours, planted at its name
            raise StateError(f"cannot open {self.lock_file}: {exc.strerror or exc}; remove "
                             "it") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunningError(
                f"`{self.path.name}` is already running (its supervisor holds {self.lock_file}); "
                f"`epdctl down --name {self.path.name}` stops it"
            ) from None
        self._lock_fd = fd
        return fd

    def adopt_lock(self, fd: int) -> None:
        """Take over a lock fd inherited from the `up` that spawned us (same open file)."""
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def is_locked(self) -> bool:
        """Whether some process holds the lock right now."""
        if self._lock_fd is not None:
            return True
        try:
            fd = os.open(self.lock_file, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops our probe lock too

    def live_names(self, state: RunState) -> list[str]:
        """Recorded processes (supervisor included) that are still alive and still ours."""
        records = list(state.records.values())
        if state.supervisor is not None:
            records.append(state.supervisor)
        return [r.name for r in records if still_ours(r)]

    def is_running(self) -> bool:
        """Lock held, or a readable state.json with live processes."""
        if self.is_locked():
            return True
        try:
            return bool(self.live_names(self.read()))
        except (NotRunningError, StateError):
            return False



def _candidates(root: Path, marker: str) -> list[StateDir]:
    if not root.is_dir():
        return []
    return [StateDir(p) for p in sorted(root.iterdir()) if (p / marker).exists()]


def find_state_dir(root: Path, name: str | None, *, past_runs: bool = False) -> StateDir:
    """The state dir for `name` (a topology name or file), else the only one under root.

    With past_runs, topologies that were brought down (logs kept) count too.
    """
    if name is not None:
        if name.endswith((".yaml", ".yml")) or Path(name).is_file():
            from epdctl.topology.model import load_topology

            name = load_topology(name).name
        return StateDir(root / name)
    found = _candidates(root, "state.json")
    if len(found) > 1:
        running = [d for d in found if d.is_running()]
        found = running or found
    if not found and past_runs:
        found = _candidates(root, LAST_RUN)
    if len(found) == 1:
        return found[0]
    if not found:
        raise NotRunningError(f"nothing is running (no topology under {root})")
    names = ", ".join(d.path.name for d in found)
    raise EpdctlError(f"several topologies under {root} ({names}); pick one with --name NAME")
