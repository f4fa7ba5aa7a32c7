"""The e2e marker for everything here. The tiny models and the session's baselines are
fixtures of tests/conftest.py (modules elsewhere run real vLLM too)."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e is an e2e test (`-m 'not e2e'` skips them all)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.e2e)
