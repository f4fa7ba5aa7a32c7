"""Every shipped topology's derived argv and env equal what plan() produced before launch
specs kept their parts as fields (tests/golden/plans-before-refactor.json)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from epdctl.launch.plan import CPU_IN_PROCESS_WORKER, plan
from epdctl.topology.model import load_topology

ROOT = Path(__file__).parents[2]
# The namespace hashes the model's absolute path, here under a temporary HOME: masked.
NAMESPACE = re.compile(r'(\\?"namespace\\?":\\?")[a-z0-9-]+-[0-9a-f]{12}')


def _masked(text: str) -> str:
    return NAMESPACE.sub(r"\1NS", text)


def _masked_argv(argv: list[str]) -> list[str]:
    """The proxy's `--namespace NS` masked too (the same namespace as in the EC config)."""
    return ["NS" if n and argv[n - 1] == "--namespace" else a for n, a in enumerate(argv)]


GOLDEN = json.loads(_masked(
    (Path(__file__).parents[1] / "golden" / "plans-before-refactor.json").read_text()))
for _specs in GOLDEN.values():
    for _spec in _specs.values():
        _spec["argv"] = _masked_argv(_spec["argv"])


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HOME whose tiny-model paths exist but hold no config (the namespace then hashes
    the path alone, as when the golden file was written)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for kind in ("llava", "qwen2vl"):
        (tmp_path / ".cache" / "epdctl" / "tiny-models" / kind).mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_derived_argv_and_env_equal_the_plan_before_the_refactor(name: str, home: Path) -> None:
    topology = load_topology(ROOT / "topologies" / name)
    need = sum(r.replicas * r.tensor_parallel for r in topology.roles.values())
    result = plan(topology, Path("/state") / topology.name, vllm_version="0.32.0", python="/py",
                  visible_gpus=[str(i) for i in range(max(need, 8))], cpu_count=2)

    def clean(value: str) -> str:
        # The default store root is per user: this user's uid is masked.
        value = value.replace(f"/dev/shm/epdctl-{os.geteuid()}", "/dev/shm/epdctl-<uid>")
        return _masked(value.replace(str(home), "~"))

    got = {s.name: {"role": s.role, "argv": _masked_argv([clean(a) for a in s.argv]),
                    "env": {k: clean(v) for k, v in s.env.items()}, "port": s.port,
                    "health_url": s.health_url, "log_path": str(s.log_path),
                    "gpus": list(s.gpus), "side_channel_port": s.side_channel_port,
                    "start_after": list(s.start_after)} for s in result.specs}
    # Added since the golden file: each engine's IPC sockets and temp files in a directory
    # of the run (tests/host/test_ipc.py).
    from epdctl.host import ipc

    for spec_name, spec in got.items():
        if spec["role"] != "proxy":
            added = ipc.engine_env(Path("/state") / topology.name, spec_name)
            assert {k: spec["env"].pop(k) for k in added} == added
            # And a CPU instance's worker in its engine core's process (tests/launch/test_plan.py).
            if topology.device == "cpu":
                assert spec["env"].pop(CPU_IN_PROCESS_WORKER[0]) == CPU_IN_PROCESS_WORKER[1]
    assert got == GOLDEN[name]
