"""run_checks(): which checks run for which topology, wired to fake probes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from epdctl.doctor import Completed, Probes, run_checks
from epdctl.doctor._vllm import PLUGIN_VALUE
from epdctl.errors import PlanError
from tests.doctor.fakes import FakeRunner, disk, gpu, topology

ENV_ONLY = ["vllm", "plugin", "gpus", "ec-store"]
ALL = ["vllm", "plugin", "kv-connector", "ec-connector", "gpus", "placement", "gpu-memory",
       "ec-store", "ports", "model", "combination", "safety"]


def _runner(modules: dict[str, str | None] | None = None) -> FakeRunner:
    from epdctl import __version__

    report = {"python": "/venv/bin/python", "vllm": ["vllm", "0.33.0"],
              "plugin": {"value": PLUGIN_VALUE, "error": None},
              "epdctl": [__version__, "/src/epdctl/__init__.py"], "modules": modules or {}}
    return FakeRunner({"--version": Completed(0, "0.33.0\n", ""),
                       "-c": Completed(0, json.dumps(report) + "\n", "")})


def _probes(gpus: object, run: FakeRunner, **fields: object) -> Probes:
    def nvml() -> object:
        if isinstance(gpus, PlanError):
            raise gpus
        return gpus

    which = {"vllm": "/venv/bin/python"}.get  # as if `vllm` were that Python
    base: dict = dict(run=run, which=lambda p: p if p.startswith("/") else which(p),
                      gpus=nvml, disk_usage=disk(free_gib=30), fs_type=lambda p: "tmpfs",
                      writable=lambda p: True, check_ports=lambda p: None,
                      environ={"PATH": "/venv/bin"}, cpu_count=2,
                      vllm_requirement=">=0.32,<0.34")
    base.update(fields)
    return Probes(**base)


def _by_name(checks: list) -> dict:
    return {c.name: c for c in checks}


def test_environment_only_on_a_machine_without_gpus(tmp_path: Path) -> None:
    run = _runner()
    checks = run_checks(None, tmp_path, _probes(PlanError("no NVIDIA GPU found"), run))
    assert [c.name for c in checks] == ENV_ONLY
    assert [c.status for c in checks] == ["ok", "ok", "warn", "ok"]
    # No GPU: the CPU engine of this interpreter is what a topology would run.
    assert run.calls[0][0][:2] == [sys.executable, "-c"]
    assert run.calls[1][0] == [sys.executable, "-m", "epdctl.engines.vllm_cpu", "--version"]


def test_environment_only_with_gpus_asks_vllm_on_path(tmp_path: Path) -> None:
    script = tmp_path / "vllm"
    script.write_text("#!/gpu-venv/bin/python3\nfrom vllm.entrypoints.cli.main import main\n")
    run = _runner()
    probes = _probes([gpu("0"), gpu("1")], run,
                     which=lambda p: str(script) if p == "vllm" else None)
    checks = run_checks(None, tmp_path, probes)
    assert [c.status for c in checks] == ["ok", "ok", "ok", "ok"]
    assert run.calls[1][0] == ["vllm", "--version"]
    assert run.calls[0][0][:2] == ["/gpu-venv/bin/python3", "-c"]  # the script's `#!` line


def test_cpu_topology(tmp_path: Path) -> None:
    topo = topology(device="cpu", model=str(tmp_path), roles={"encode": {},
                                                              "prefill_decode": {}})
    (tmp_path / "config.json").write_text("{}")
    checks = _by_name(run_checks(topo, tmp_path, _probes(PlanError("none"), _runner())))
    assert list(checks) == ALL
    assert {n: c.status for n, c in checks.items()} == {
        "vllm": "ok", "plugin": "ok", "kv-connector": "skip", "ec-connector": "skip",
        "gpus": "skip", "placement": "ok",
        "gpu-memory": "skip", "ec-store": "ok", "ports": "ok", "model": "ok",
        "combination": "ok", "safety": "ok"}


def test_epd_on_too_few_gpus(tmp_path: Path) -> None:
    topo = topology(roles={"encode": {"gpus": [0]}, "prefill": {"gpus": [1]},
                           "decode": {"tensor_parallel": 2}})
    run = _runner({"nixl._api": "ModuleNotFoundError: No module named 'nixl'"})
    checked: list = []
    checks = _by_name(run_checks(topo, tmp_path, _probes([gpu("0"), gpu("1")], run,
                                                         check_ports=checked.append)))
    assert checks["placement"].status == "fail"
    assert checks["placement"].detail.startswith("roles -> decode -> gpus: needs 2 GPUs")
    assert checks["gpu-memory"].status == "skip"
    # Ports are still checked, on the plan as if the GPUs were there.
    assert checks["ports"].status == "ok" and [s.name for s in checked[0].instances] == [
        "encode-0", "prefill-0", "decode-0"]
    assert checks["kv-connector"].status == "fail"
    assert run.calls[0][0][-1] == "nixl._api"  # the probe was asked to import it


def test_overcommitted_shared_gpu_still_checks_the_engine(tmp_path: Path) -> None:
    topo = topology(roles={"encode": {"gpus": [0], "gpu_memory_utilization": 0.5},
                           "prefill_decode": {"gpus": [0], "gpu_memory_utilization": 0.6}})
    checks = _by_name(run_checks(topo, tmp_path, _probes([gpu("0")], _runner())))
    assert checks["placement"].status == "fail" and "adds up to 1.10" in checks[
        "placement"].detail
    assert checks["ports"].status == "skip"
    assert checks["vllm"].status == "ok" and checks["plugin"].status == "ok"


def test_baseline_without_an_encoder_skips_the_plugin(tmp_path: Path) -> None:
    topo = topology(roles={"prefill_decode": {"gpus": [0]}})
    checks = _by_name(run_checks(topo, tmp_path, _probes([gpu("0")], _runner())))
    assert checks["plugin"].status == "skip" and checks["ec-store"].status == "skip"
    assert checks["gpu-memory"].status == "ok"


def test_the_engine_env_reaches_the_probes(tmp_path: Path) -> None:
    topo = topology(engine={"env": {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}})
    run = _runner()
    checks = _by_name(run_checks(topo, tmp_path, _probes([gpu("0"), gpu("1")], run)))
    assert checks["model"].status == "fail"  # offline, and not in that HF_HOME
    assert all(env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/venv/bin"
               for _, env, _ in run.calls)
