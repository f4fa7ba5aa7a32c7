from __future__ import annotations

from pathlib import Path

import pytest

from epdctl.launch.run import prepare
from tests.conftest import FAKE_PROXY, is_running, run_pids

pytestmark = pytest.mark.timeout(60)


def test_dry_run_prints_every_command_and_starts_nothing(epdctl, fake_topology, state_root,
                                                          monkeypatch) -> None:
    topo = fake_topology()
    result = epdctl("up", str(topo), "--dry-run")
    assert result.exit_code == 0, result.stderr
    monkeypatch.setenv("EPDCTL_PROXY_COMMAND", FAKE_PROXY)
    plan = prepare(topo, state_root).plan
    expected = "".join(f"# {s.name} ({s.role})\n{s.shell()}\n" for s in plan.specs)
    assert result.stdout == expected
    assert result.stdout.splitlines()[0] == "# encode-0 (encode)"
    assert "VLLM_CPU_OMP_THREADS_BIND=0 " in result.stdout
    assert not (state_root / "fake").exists()


def test_up_detached_then_second_up_refused(epdctl, fake_topology, state_root) -> None:
    topo = fake_topology()
    result = epdctl("up", str(topo), "-d", "--timeout", "20")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "fake is ready (e-pd): 2 instance(s), model fake-model"
    assert lines[1].startswith("  proxy     http://127.0.0.1:")
    assert lines[-1].startswith("  curl http://127.0.0.1:")
    assert '"model": "fake-model"' in lines[-1]
    assert "pd-0: ready" in result.stderr
    assert result.stderr.endswith("Detached; `epdctl down --name fake` stops it.\n")
    again = epdctl("up", str(topo), "-d")
    assert again.exit_code == 1
    assert again.stderr.startswith("Error: `fake` is already running")
    assert epdctl("down").exit_code == 0


def test_early_death_exits_3_with_the_log_tail(epdctl, fake_topology, state_root) -> None:
    topo = fake_topology(pd_args=("--exit-after", "0.3", "--ready-after", "30"))
    result = epdctl("up", str(topo), "-d", "--timeout", "20")
    assert result.exit_code == 3
    assert "Error: `pd-0` exited with code 1 while starting; last lines of " in result.stderr
    assert "  fake: exiting with code 1\n" in result.stderr
    assert not (state_root / "fake" / "state.json").exists()
    assert not any(is_running(pid) for pid in run_pids(state_root).values())


def test_missed_deadline_exits_3(epdctl, fake_topology, state_root) -> None:
    topo = fake_topology(encode_args=("--ready-after", "60"))
    result = epdctl("up", str(topo), "-d", "--timeout", "1")
    assert result.exit_code == 3
    assert "Error: `encode-0` was not ready within 1s" in result.stderr
    assert not any(is_running(pid) for pid in run_pids(state_root).values())


def test_bad_topology_is_exit_1(epdctl, tmp_path: Path) -> None:
    result = epdctl("up", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 1
    assert result.stderr == f"Error: {tmp_path / 'nope.yaml'}: no such file\n"


def test_a_missing_local_model_is_refused_before_anything_starts(epdctl, fake_topology,
                                                                  state_root, tmp_path) -> None:
    topo = fake_topology()
    topo.write_text(topo.read_text().replace("model: fake-model", "model: ./no-model"))
    assert epdctl("up", str(topo), "--dry-run").exit_code == 0  # planning needs no model
    result = epdctl("up", str(topo), "-d")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr == (f"Error: `fake`: model path {tmp_path / 'no-model'} does not exist; "
                             "put the model there, or name a Hugging Face id\n")
    assert not (state_root / "fake").exists()


@pytest.mark.parametrize("connector, error", [
    ("no_such_ec_pkg.mod:MyConnector", "ModuleNotFoundError: No module named 'no_such_ec_pkg'"),
    ("json:MyConnector", "AttributeError: module 'json' has no attribute 'MyConnector'"),
])
def test_a_connector_the_engines_cannot_import_is_refused_before_anything_starts(
        epdctl, fake_topology, state_root, connector: str, error: str) -> None:
    """The probe runs in the engine command's own Python (here this interpreter)."""
    topo = fake_topology(cache=f"connector: {connector!r}")
    assert epdctl("up", str(topo), "--dry-run").exit_code == 0  # planning imports nothing
    result = epdctl("up", str(topo), "-d")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"Error: `fake`: cache.connector {connector}: {error} (in ")
    assert len(result.stderr.splitlines()) == 1
    assert not (state_root / "fake").exists()


def test_store_smaller_than_the_cache_budget_is_refused(epdctl, fake_topology, state_root,
                                                        tmp_path: Path) -> None:
    topo = fake_topology(cache="capacity: 1000TiB")
    result = epdctl("up", str(topo), "-d")
    assert result.exit_code == 1
    assert f"Error: the EC store `{tmp_path / 'shm'}` has " in result.stderr
    assert "but the cache capacity is" in result.stderr
    assert "lower cache.capacity" in result.stderr
    assert not (state_root / "fake" / "logs").exists()


def test_dry_run_without_gpus_plans_on_assumed_ones(epdctl, monkeypatch, state_root,
                                                    tmp_path) -> None:
    from epdctl import cache
    from epdctl.errors import PlanError

    monkeypatch.setattr(cache, "STORE_BASE", str(tmp_path))

    def no_gpu() -> list[str]:
        raise PlanError("no NVIDIA GPU found (NVML: test)")

    monkeypatch.setattr("epdctl.host.gpus.visible_gpus", no_gpu)
    topo = Path(__file__).resolve().parents[2] / "topologies" / "qwen2_5-vl-2e2pd-tp2.yaml"
    result = epdctl("up", str(topo), "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "planning as if GPUs 0-5 were visible (dry run only)" in result.stderr
    assert "CUDA_VISIBLE_DEVICES=4,5 " in result.stdout  # pd-1: tensor_parallel 2
    started = epdctl("up", str(topo), "-d")
    assert started.exit_code == 1
    assert started.stderr == "Error: no NVIDIA GPU found (NVML: test)\n"
    # Nothing started, so nothing left: not even the store root made before the plan.
    assert not Path(cache.default_store_root()).exists()
