"""Where a run's EC store lives, which namespaces its topology's runs used, and how private
a run's store is.

- resolve_root: `cache.dir`, except that the default root (`/dev/shm/epdctl-<uid>`, which
  anyone can create first) is used only if it is the user's alone; otherwise the run gets a
  private root of epdctl's own (one it made before, else a fresh one: an unguessable name,
  0700), said in one warning. The
  plan puts the root into every engine's EC config and the proxy's argv, and state.json
  records it (`store_dir`), so every later command finds it. A `cache.dir` the user set is
  never swapped: `up` refuses it with the fix instead (launch.run._claim).
- the namespace record (`<state dir>/namespaces.json`): every (root, namespace) the runs of
  this topology used. The janitor removes an earlier namespace only if it is recorded here.
- store_safety: where a run's store is and whether it is private (`status`, `doctor`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from epdctl import cache
from epdctl.host import private
from epdctl.launch.connectors import connector_for

if TYPE_CHECKING:
    from epdctl.launch.state import RunState
    from epdctl.topology.model import Topology

RECORD = "namespaces.json"
"""In the state dir: the namespaces this topology's runs used, where."""

Warn = Callable[[str], None]


def uses_store(topology: Topology) -> bool:
    """Whether the run keeps EC items under `cache.dir` (an encode role, and a connector
    that writes there: epdctl's, ECExampleConnector, or one of your own)."""
    return "encode" in topology.roles and connector_for(topology.cache.connector).uses_store


def is_fresh_root(path: Path, uid: int | None = None) -> bool:
    """Whether `path` is named as a root resolve_root makes when the default is unusable."""
    default = Path(cache.default_store_root(uid))
    return path.parent == default.parent and path.name.startswith(f"{default.name}-")


def resolve_root(topology: Topology, state_dir: Path, *, is_dry_run: bool = False,
                 warn: Warn | None = None, made: list[Path] | None = None) -> Path:
    """The store root this run uses (see the module docstring). Unless a dry run, the
    default root is created here (0700) when missing, and a fresh root when it is unusable
    (either is appended to `made`, so that a start that fails before it begins can take it
    back: discard_root); a dry run creates nothing and only warns."""
    default = Path(cache.default_store_root())
    if topology.cache.dir != default or not uses_store(topology):
        return topology.cache.dir
    existed = default.is_dir()
    problem = _default_problem(default, create=not is_dry_run)
    if problem is None:
        if made is not None and not existed and not is_dry_run:
            made.append(default)
        return default
    chosen = next((r for r in _fresh_roots(default, state_dir) if _problem(r) is None), None)
    if is_dry_run:
        where = f"`{chosen}`" if chosen else "a fresh private root of its own"
        _say(warn, f"warning: the EC store root `{default}` is not usable ({problem}); "
                   f"`up` will use {where}")
        return chosen or default
    if chosen is None:
        # mkdtemp: 0700, a name nobody can guess (and so create first).
        chosen = Path(tempfile.mkdtemp(prefix=f"{default.name}-", dir=default.parent))
        if made is not None:
            made.append(chosen)
    _say(warn, f"warning: not using the EC store root `{default}` ({problem}); this run's "
               f"store is `{chosen}`, private to you")
    return chosen


def discard_root(path: Path) -> None:
    """Remove a root resolve_root made for a start that then failed before anything used it
    (left alone if something is in it by now)."""
    try:
        path.rmdir()
    except OSError:
        pass


def _fresh_roots(default: Path, state_dir: Path) -> list[Path]:
    """Fresh roots to reuse: this topology's (so a store kept by `down --keep-cache` is
    found again), then any other of ours (one a `verify` planned with, say). Nobody else
    can make a directory that is ours, so a private one of that name is one we made."""
    recorded = [r for r in recorded_roots(state_dir) if is_fresh_root(r)]
    try:
        others = sorted(default.parent.glob(f"{default.name}-*"))
    except OSError:
        others = []
    return list(dict.fromkeys([*reversed(recorded), *others]))


def _default_problem(default: Path, *, create: bool) -> str | None:
    """Why the default root cannot be used (None: it can, or it cannot be made at all,
    which `up` then says itself)."""
    if create:
        try:
            default.mkdir(mode=private.DIR_MODE)
        except FileExistsError:
            pass
        except OSError:
            return None  # no /dev/shm, say: _claim's check names the problem
    return _problem(default)


def _problem(path: Path) -> str | None:
    try:
        return private.dir_problem(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


def _read_record(state_dir: Path) -> list[tuple[str, str]]:
    try:
        data = json.loads((state_dir / RECORD).read_bytes())
        return [(str(u["root"]), str(u["namespace"])) for u in data["used"]]
    except (OSError, ValueError, TypeError, KeyError):
        return []


def recorded_roots(state_dir: Path) -> list[Path]:
    """The store roots this topology's runs used, most recent last."""
    return list(dict.fromkeys(Path(root) for root, _ in _read_record(state_dir)))


def earlier_namespaces(state_dir: Path, root: Path) -> set[str]:
    """The namespaces this topology's runs used under `root` (the janitor's proof that a
    namespace is this topology's own)."""
    return {ns for r, ns in _read_record(state_dir) if Path(r) == root}


def record_namespace(state_dir: Path, root: Path, namespace: str,
                     previous: tuple[Path, str] | None = None) -> None:
    """Add (root, namespace) to the record (and `previous`, the last run's, which runs
    before the record existed did not write); namespaces that are gone are dropped. The
    state dir must be made and checked already (StateDir.make); written as state.json is."""
    used = _read_record(state_dir)
    if previous is not None:
        used.insert(0, (str(previous[0]), previous[1]))
    used.append((str(root), namespace))
    kept = [u for u in dict.fromkeys(used)
            if u == (str(root), namespace) or os.path.isdir(Path(u[0]) / u[1])]
    body = {"used": [{"root": r, "namespace": ns} for r, ns in kept]}
    private.write_file(state_dir / RECORD, json.dumps(body, indent=1).encode())


@dataclass(frozen=True)
class StoreSafety:
    """Where a run's EC store is and whether anyone but its user can reach it."""

    root: Path
    """The store root (state.json's `store_dir` is its namespace's directory)."""
    namespace_dir: Path
    is_used: bool
    """Whether the run's connector keeps items there at all (not Mooncake or ECCPU, and
    only with an encode role)."""
    is_private: bool
    """The root and the namespace dir (those that exist) are the user's alone: owned, mode
    0700, no links (private.dir_problem)."""
    problem: str | None
    """Why not, as `<path>: <what is wrong; the fix>`; None when private."""
    is_fresh: bool
    """A root of epdctl's own, picked because the default one was not usable."""


def store_safety(state: RunState) -> StoreSafety:
    """The safety of `state`'s store now, for the one-line summaries of status and doctor."""
    ns_dir = Path(state.store_dir)
    root = ns_dir.parent
    is_used = any(s.role == "encode" for s in state.specs) \
        and connector_for(state.ec_connector).uses_store
    problem = None
    for path in (root, ns_dir):
        why = _problem(path)
        if why is not None:
            problem = f"{path}: {why}"
            break
    return StoreSafety(root=root, namespace_dir=ns_dir, is_used=is_used,
                       is_private=problem is None, problem=problem,
                       is_fresh=is_fresh_root(root))


def _say(warn: Warn | None, line: str) -> None:
    if warn is not None:
        warn(line)
