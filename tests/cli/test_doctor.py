"""`epdctl doctor` through CliRunner: its lines, --json, exit codes, and the topology it reads."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

import epdctl.doctor as doctor_module
from epdctl.doctor import Check
from epdctl.errors import PlanError
from tests.doctor.fakes import disk
from tests.doctor.test_run_checks import ALL, _runner

CHECKS = [
    Check("vllm", "ok", "vLLM 0.33.0 (`vllm --version`)"),
    Check("gpus", "warn", "no NVIDIA GPU found"),
    Check("ports", "fail", "port 8000 for `proxy` is already in use", "stop what holds it"),
    Check("gpu-memory", "skip", "`device: cpu`: no GPU memory needed"),
]


class FakeRunChecks:
    """Stands in for run_checks: records what it was asked, answers with `answer`."""

    def __init__(self) -> None:
        self.answer = list(CHECKS)
        self.calls: list[tuple] = []

    def __call__(self, topology, state_root, topology_path=None) -> list[Check]:
        self.calls.append((topology, state_root))
        return list(self.answer)


@pytest.fixture
def fake_checks(monkeypatch: pytest.MonkeyPatch) -> FakeRunChecks:
    fake = FakeRunChecks()
    monkeypatch.setattr(doctor_module, "run_checks", fake)
    return fake


def test_lines_summary_and_exit_1_on_a_failure(epdctl, fake_checks, state_root) -> None:
    result = epdctl("doctor")
    assert result.exit_code == 1
    assert result.stdout == (
        "ok    vllm          vLLM 0.33.0 (`vllm --version`)\n"
        "warn  gpus          no NVIDIA GPU found\n"
        "fail  ports         port 8000 for `proxy` is already in use\n"
        "                    fix: stop what holds it\n"
        "skip  gpu-memory    `device: cpu`: no GPU memory needed\n"
    )
    assert result.stderr == "1 ok, 1 warn, 1 fail, 1 skip\n"
    assert fake_checks.calls == [(None, state_root)]


def test_warnings_alone_exit_0(epdctl, fake_checks) -> None:
    fake_checks.answer = [c for c in CHECKS if c.status != "fail"]
    result = epdctl("doctor")
    assert result.exit_code == 0
    assert result.stderr == "1 ok, 1 warn, 1 skip\n"


def test_json(epdctl, fake_checks) -> None:
    result = epdctl("doctor", "--json")
    assert result.exit_code == 1 and result.stderr == ""
    doc = json.loads(result.stdout)
    assert list(doc) == ["ok", "checks"] and doc["ok"] is False
    assert doc["checks"][2] == {"name": "ports", "status": "fail",
                                "detail": "port 8000 for `proxy` is already in use",
                                "fix": "stop what holds it"}
    fake_checks.answer = CHECKS[:2]
    assert json.loads(epdctl("doctor", "--json").stdout)["ok"] is True


def test_a_bad_topology_is_one_error(epdctl, tmp_path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("name: t\nmodel: m\nroles: {encode: {}}\n")
    result = epdctl("doctor", str(path))
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == (f"Error: {path}: invalid topology\n  roles: encode alone serves "
                             "nothing; add prefill_decode, or prefill and decode\n")
    assert epdctl("doctor", str(tmp_path / "none.yaml")).stderr == (
        f"Error: {tmp_path}/none.yaml: no such file\n")


def test_a_missing_tiny_model_is_a_check_not_an_error(epdctl, tmp_path, monkeypatch) -> None:
    """The real checks on fake probes: the model line names the build command."""
    monkeypatch.setenv("EPDCTL_TINY_MODEL_DIR", str(tmp_path / "tiny"))
    monkeypatch.setattr(doctor_module, "Probes", functools.partial(
        doctor_module.Probes, run=_runner(), gpus=lambda: (_ for _ in ()).throw(PlanError("x")),
        disk_usage=disk(free_gib=8), fs_type=lambda p: "tmpfs", writable=lambda p: True,
        check_ports=lambda p: None, vllm_requirement=None))
    path = tmp_path / "cpu.yaml"
    path.write_text(f"name: c\nmodel: {tmp_path}/tiny/llava\ndevice: cpu\n"
                    "roles: {encode: {}, prefill_decode: {}}\n")
    result = epdctl("doctor", str(path))
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert [line.split()[1] for line in lines if not line.startswith(" ")] == ALL
    model = lines.index(f"fail  model         local path {tmp_path}/tiny/llava does not exist")
    assert lines[model + 1].strip().startswith("fix: build it: `")
    assert lines[model + 1].endswith(" -m epdctl.dev.tiny_models llava`")


def test_help_explains_every_check(epdctl) -> None:
    text = epdctl("doctor", "--help").stdout
    assert text.startswith("Usage: cli doctor [OPTIONS] [TOPOLOGY]\n")
    for name in ALL:
        assert f"\n  {name} " in text, name
    assert "start nothing" in epdctl("--help").stdout


def test_state_root_is_passed(epdctl, fake_checks, tmp_path: Path) -> None:
    epdctl("--state-dir", str(tmp_path / "s"), "doctor")
    assert fake_checks.calls == [(None, tmp_path / "s")]
