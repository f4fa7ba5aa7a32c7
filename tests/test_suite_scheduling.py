"""How `pytest -n N` spreads the suite (tests/conftest.py): a module whole on one worker, and
every module that starts real vLLM in one scope, so they run one after another."""

from __future__ import annotations

from pathlib import Path

from tests import conftest

TESTS = Path(__file__).parent


def test_every_real_vllm_module_is_in_one_scope() -> None:
    real = ["tests/e2e/test_cpu_demo.py::test_status_all_ready",
            "tests/e2e/test_fake_topology.py::test_x",  # tests/e2e: all of it
            "tests/reliability/test_replay_real.py::test_references",
            "tests/connector/test_e2e_llava.py::test_x[a-b]",
            "tests/proxy/test_real_vllm.py::test_x"]
    assert {conftest.scope_of(n) for n in real} == {conftest.VLLM_SCOPE}


def test_any_other_module_is_a_scope_of_its_own() -> None:
    assert conftest.scope_of("tests/topology/test_keys.py::test_a[x::y]") == \
        "tests/topology/test_keys.py"
    assert conftest.scope_of("tests/reliability/test_lifecycle.py::test_x") == \
        "tests/reliability/test_lifecycle.py"


def test_a_module_marked_e2e_is_found_by_its_mark() -> None:
    """Every module whose tests carry the e2e mark, wherever it lives, is a real-vLLM one."""
    marked = {p for p in TESTS.rglob("test_*.py") if "pytest.mark.e2e" in p.read_text()}
    assert len(marked) >= 15
    for path in marked:
        assert conftest.runs_real_vllm(str(path.relative_to(TESTS.parent)))
