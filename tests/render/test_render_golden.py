"""`epdctl render k8s` output for every shipped topology, byte for byte against golden files.

Regenerate after an intended change with `EPDCTL_UPDATE_GOLDEN=1 pytest tests/render`, then
review the diff: the goldens are the contract with `kubectl apply`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from _k8s_schema import validate

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
GOLDEN = HERE / "golden"
SHOULD_UPDATE = os.environ.get("EPDCTL_UPDATE_GOLDEN") == "1"

CASES: list[tuple[str, Path, tuple[str, ...]]] = [
    (p.stem, p, ()) for p in sorted((REPO / "topologies").glob("*.yaml"))
] + [
    (f"fixture-{p.stem}", p, ()) for p in sorted((HERE / "topologies").glob("*.yaml"))
] + [
    ("fixture-e-p-d.gpn2", HERE / "topologies" / "e-p-d.yaml",
     ("--gpus-per-node", "2", "--namespace", "epd", "--image", "registry.local/epd:1",
      "--ec-connector", "ECCPUConnector")),
    ("fixture-e-pd.eccpu", HERE / "topologies" / "e-pd.yaml", ("--ec-connector", "ECCPUConnector")),
    # A model path in the pods, on a PVC (mounted at its directory) or a node directory.
    ("fixture-pod-path.pvc", HERE / "topologies" / "pod-path.yaml",
     ("--model-pvc", "qwen-weights")),
    ("fixture-pod-path.hostpath", HERE / "topologies" / "pod-path.yaml",
     ("--model-host-path", "/mnt/models/qwen2.5-vl-3b", "--model-mount", "/models/qwen2.5-vl-3b")),
    # A hub id with a shared cache and a token from a Secret.
    ("fixture-e-pd.hf", HERE / "topologies" / "e-pd.yaml",
     ("--hf-cache-pvc", "hf-cache", "--hf-token-secret", "hf-token:token")),
]


def _render(epdctl, path: Path, args: tuple[str, ...]):
    # Render from a path relative to the repo so the golden does not hold this checkout's path.
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return epdctl("render", "k8s", str(path.relative_to(REPO)), *args)
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize(("golden", "path", "args"), CASES, ids=[c[0] for c in CASES])
def test_matches_golden(epdctl, golden: str, path: Path, args: tuple[str, ...], tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # a fresh machine: no tiny model built yet
    result = _render(epdctl, path, args)
    out, err = GOLDEN / f"{golden}.yaml", GOLDEN / f"{golden}.err"
    if SHOULD_UPDATE:
        keep, drop = (out, err) if result.exit_code == 0 else (err, out)
        keep.write_text(result.stdout if result.exit_code == 0 else result.stderr)
        drop.unlink(missing_ok=True)
    if out.exists():
        assert result.exit_code == 0, result.stderr
        assert result.stdout == out.read_text(), f"{out.name} differs; see the module docstring"
    elif err.exists():
        assert result.exit_code == 1
        assert result.stdout == ""
        assert result.stderr == err.read_text()
    else:
        pytest.fail(f"no golden for {golden}: run with EPDCTL_UPDATE_GOLDEN=1 and review it")


@pytest.mark.parametrize("golden", sorted(p.name for p in GOLDEN.glob("*.yaml")))
def test_golden_validates_against_kubernetes_schemas(golden: str) -> None:
    docs = [d for d in yaml.safe_load_all((GOLDEN / golden).read_text()) if d is not None]
    assert docs
    for doc in docs:
        validate(doc)


def test_no_orphan_goldens() -> None:
    known = {c[0] for c in CASES}
    orphans = {p.stem for p in GOLDEN.iterdir() if p.suffix in (".yaml", ".err")} - known
    assert not orphans, f"goldens without a topology: {sorted(orphans)}"
