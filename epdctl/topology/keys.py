"""proxy.api_key as written in a topology (a literal, `${VAR}`, or `api_key_file: PATH`) and
the key itself, which only `up` (and what starts a run) reads: plan, render and `--dry-run`
see where it comes from, never its value."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from epdctl.errors import TopologyError
from epdctl.topology.sections import Proxy

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def env_name(proxy: Proxy) -> str | None:
    """The variable `api_key: ${VAR}` names; None for a literal key or none."""
    match = _ENV_REF.fullmatch(proxy.api_key or "")
    return match.group(1) if match else None


def has_api_key(proxy: Proxy) -> bool:
    """Whether clients must present a key, wherever it comes from."""
    return proxy.api_key is not None or proxy.api_key_file is not None


def literal_key(proxy: Proxy) -> str | None:
    """The key written in the topology file itself (None: from the environment, a file, or
    no key)."""
    return proxy.api_key if proxy.api_key is not None and env_name(proxy) is None else None


def read_key_file(path: Path) -> str:
    """The first line of a key file that is yours alone; TopologyError (one line) otherwise."""
    what = f"proxy.api_key_file `{path}`"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise TopologyError(f"{what}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(file.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise TopologyError(f"{what} is not a regular file")
        if st.st_uid != os.geteuid():
            raise TopologyError(f"{what} belongs to uid {st.st_uid}, not to you; "
                                "keep your key in a file of your own")
        if st.st_mode & 0o077:
            raise TopologyError(f"{what} can be read by others (mode "
                                f"{stat.S_IMODE(st.st_mode):04o}); `chmod 600 {path}`")
        first = file.read(4096).decode(errors="replace").partition("\n")[0].strip()
    if not first:
        raise TopologyError(f"{what} is empty; put the key on its first line")
    return first


def resolve_api_key(proxy: Proxy, environ: Mapping[str, str] | None = None) -> str | None:
    """The key clients must present (None: the proxy is open)."""
    environ = os.environ if environ is None else environ
    if proxy.api_key_file is not None:
        return read_key_file(proxy.api_key_file)
    name = env_name(proxy)
    if name is not None:
        value = environ.get(name, "")
        if not value:
            raise TopologyError(f"proxy.api_key is ${{{name}}}, which is not set here; "
                                f"`export {name}=...` before epdctl, or use api_key_file")
        return value
    return proxy.api_key


def with_api_key(proxy: Proxy, environ: Mapping[str, str] | None = None) -> Proxy:
    """The proxy section with the key itself in `api_key` (what the run's plan needs)."""
    key = resolve_api_key(proxy, environ)
    return proxy.model_copy(update={"api_key": key, "api_key_file": None})


def readable_by_others(path: Path) -> bool:
    """Whether anyone but its owner may read the file (its group or everyone)."""
    try:
        return bool(os.stat(path).st_mode & (stat.S_IRGRP | stat.S_IROTH))
    except OSError:
        return False
