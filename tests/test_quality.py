"""The house rules CI enforces on the code itself: ruff clean, mypy clean, imports one way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_ruff_is_clean() -> None:
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_cli_and_proxy_import_no_vllm_or_torch() -> None:
    code = (
        "import sys, epdctl.cli, epdctl.proxy.server.app, epdctl.launch.plan, epdctl.render.k8s, "
        "epdctl.doctor\n"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
