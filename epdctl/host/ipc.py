"""Where an engine's IPC sockets and temp files go: a private directory of the run, gone
with the instance.

vLLM binds its ZMQ IPC sockets (engine core, frontend, message queues) as
`$VLLM_RPC_BASE_PATH/<uuid4>`, by default right in /tmp, and writes its torch.distributed
file store as `$TMPDIR/vllm_dist_<uuid>`; nothing unlinks either when it exits, cleanly or
not. The plan points each engine at a directory of its own instead (both variables), 0700:
`<state dir>/ipc/<instance>`, or, where that would make a socket path longer than a unix
socket's 107 bytes, `$XDG_RUNTIME_DIR/epdctl-<hash>-<instance>` (the system temp dir
without it). Inductor's compile cache, which defaults to the temp dir too, is kept where it
was (TORCHINDUCTOR_CACHE_DIR): it is a cache across runs, not a file of this one. The
launcher makes the directory before the engine starts; the supervisor and `down` remove it
once the instance's process group is gone.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

RPC_ENV = "VLLM_RPC_BASE_PATH"
SOCKET_PATH_MAX = 107  # sun_path is 108 bytes with its terminating NUL
_SOCKET_NAME = len("/") + 36  # vLLM's socket name is a uuid4


def fits(base: str | os.PathLike[str]) -> bool:
    """A socket named by vLLM under `base` stays within the unix socket path limit."""
    return len(os.fsencode(base)) + _SOCKET_NAME <= SOCKET_PATH_MAX


def _fallback_name(state_dir: Path, instance: str) -> str:
    digest = hashlib.sha256(os.fsencode(state_dir.absolute())).hexdigest()[:12]
    return f"epdctl-{digest}-{instance}"


def _fallback_bases(environ: Mapping[str, str]) -> list[Path]:
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    return ([Path(runtime)] if runtime else []) + [Path(tempfile.gettempdir())]


def rpc_dir(state_dir: Path, instance: str, environ: Mapping[str, str] | None = None) -> Path:
    """The IPC directory of `instance` of the run kept in `state_dir`."""
    preferred = state_dir.absolute() / "ipc" / instance
    if fits(preferred):
        return preferred
    environ = os.environ if environ is None else environ
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    name = _fallback_name(state_dir, instance)
    base = runtime if runtime and fits(Path(runtime) / name) else tempfile.gettempdir()
    return Path(base) / name


def inductor_cache_dir() -> str:
    """Where torch's inductor keeps its compile cache by default (in the temp dir)."""
    import getpass

    try:
        user = getpass.getuser()  # torch's default directory is named after the user
    except (KeyError, OSError):
        user = str(os.getuid())
    return str(Path(tempfile.gettempdir()) / f"torchinductor_{user}")


def engine_env(state_dir: Path, instance: str) -> dict[str, str]:
    """What the plan gives the engine (under what the topology sets itself)."""
    path = str(rpc_dir(state_dir, instance))
    return {RPC_ENV: path, "TMPDIR": path, "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir()}


def ours(env: Mapping[str, str], state_dir: Path, instance: str) -> Path | None:
    """The IPC directory `env` gives the instance, if it is one epdctl made for this run (a
    VLLM_RPC_BASE_PATH of the user's own is left alone)."""
    value = env.get(RPC_ENV)
    if not value:
        return None
    path = Path(value)
    if path == state_dir.absolute() / "ipc" / instance or (
            path.name == _fallback_name(state_dir, instance)):
        return path
    return None


def make(path: Path) -> None:
    """Create the directory 0700 (a planted link or another user's directory is refused)."""
    from epdctl.errors import StartupError
    from epdctl.host.private import make_dir, own_dir

    if path.parent.name == "ipc":
        own_dir(path.parent)
    make_dir(path, "the engine IPC directory", "remove it", StartupError)


def remove_all(state_dir: Path, environ: Mapping[str, str] | None = None) -> None:
    """Every IPC directory of the run in `state_dir`, its instances' names unknown (the
    state is gone: `down --force`)."""
    remove(state_dir.absolute() / "ipc")
    prefix = _fallback_name(state_dir, "")
    for base in _fallback_bases(os.environ if environ is None else environ):
        for path in base.glob(f"{prefix}*"):
            remove(path)


def remove(path: Path | None) -> None:
    """Remove the directory and the sockets in it (nothing when it is gone already)."""
    if path is None:
        return
    shutil.rmtree(path, ignore_errors=True)
    if path.parent.name == "ipc":
        try:
            path.parent.rmdir()  # <state dir>/ipc, once no instance's directory is left
        except OSError:
            pass
