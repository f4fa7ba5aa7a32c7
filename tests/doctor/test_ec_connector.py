"""doctor's ec-connector check: vLLM's connectors' packages, an out-of-tree `module:Class`
imported in the engine's Python, and which other checks a connector turns off."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from epdctl.doctor import Check, Completed, run_checks
from epdctl.launch.preflight import check_ec_connector, ec_module, probe_environment, run_command
from tests.doctor.fakes import gpu, topology
from tests.doctor.test_run_checks import ALL, _probes, _runner
from tests.doctor.test_vllm import PY, _report

OOT = "my_pkg.ec:MyConnector"


def test_the_probe_imports_a_module_and_looks_the_class_up() -> None:
    """The real probe in this interpreter: `module:Name` is imported, then Name looked up."""
    report = probe_environment(sys.executable, dict(os.environ),
                               ["json:dumps", "json:nope", "no_such_mod:X"], run_command)
    assert report.modules == {
        "json:dumps": None, "json:nope": "AttributeError: module 'json' has no attribute 'nope'",
        "no_such_mod:X": "ModuleNotFoundError: No module named 'no_such_mod'"}


def test_what_each_connector_needs() -> None:
    assert [ec_module(c) for c in ("EpdctlShmECConnector", "ECExampleConnector",
                                   "ECMooncakeConnector", "ECCPUConnector", OOT)] == [
        None, None, "mooncake.engine", "nixl._api", OOT]
    assert check_ec_connector(None, _report()).status == "skip"
    assert check_ec_connector("EpdctlShmECConnector", _report()) == Check(
        "ec-connector", "skip", "EpdctlShmECConnector: epdctl's own connector (see `plugin`)")
    assert check_ec_connector("ECExampleConnector", None) == Check(
        "ec-connector", "ok", "ECExampleConnector needs no package beyond vLLM")
    assert check_ec_connector("ECCPUConnector", _report(modules={"nixl._api": None})) == Check(
        "ec-connector", "ok", f"ECCPUConnector: `nixl._api` imports in {PY}")
    missing = check_ec_connector("ECMooncakeConnector", _report(modules={
        "mooncake.engine": "ModuleNotFoundError: No module named 'mooncake'"}))
    assert missing == Check(
        "ec-connector", "fail", f"ECMooncakeConnector needs `mooncake.engine`, which does not "
        f"import in {PY}: ModuleNotFoundError: No module named 'mooncake'",
        f"`{PY} -m pip install mooncake-transfer-engine`")
    assert check_ec_connector(OOT, _report(error="boom")).status == "warn"


def test_an_out_of_tree_connector_is_named_with_the_fix() -> None:
    assert check_ec_connector(OOT, _report(modules={OOT: None})) == Check(
        "ec-connector", "ok", f"`my_pkg.ec` imports in {PY} and has `MyConnector`")
    error = "ModuleNotFoundError: No module named 'my_pkg'"
    assert check_ec_connector(OOT, _report(modules={OOT: error})) == Check(
        "ec-connector", "fail", f"cache.connector {OOT}: {error} (in {PY})",
        "make `my_pkg.ec` importable where the engines run (install it, or set PYTHONPATH in "
        "engine.env), and check the class name")


def test_run_checks_probes_the_connector_and_skips_our_plugin(tmp_path: Path) -> None:
    topo = topology(roles={"encode": {"gpus": [0]}, "prefill_decode": {"gpus": [1]}},
                    cache={"connector": OOT})
    run = _runner({OOT: "ModuleNotFoundError: No module named 'my_pkg'"})
    checks = {c.name: c for c in run_checks(topo, tmp_path, _probes([gpu("0"), gpu("1")], run))}
    assert list(checks) == ALL
    assert checks["ec-connector"].status == "fail"
    assert run.calls[0][0][-1] == OOT  # the probe was asked to import it
    assert checks["plugin"] == Check("plugin", "skip", f"cache.connector is {OOT}: epdctl's "
                                     "connector plugin is not used")
    assert checks["ec-store"] == Check("ec-store", "skip", f"cache.connector is {OOT}: it "
                                       "keeps nothing in cache.dir")


def test_example_connector_files_have_no_budget_to_check(tmp_path: Path) -> None:
    topo = topology(roles={"encode": {"gpus": [0]}, "prefill_decode": {"gpus": [1]}},
                    cache={"connector": "ECExampleConnector", "capacity": "1TiB",
                           "dir": str(tmp_path)})
    checks = {c.name: c for c in run_checks(topo, tmp_path, _probes([gpu("0"), gpu("1")],
                                                                    _runner()))}
    store = checks["ec-store"]
    assert store.status == "ok", store  # a 1 TiB budget would not fit: it is not one here
    assert store.detail.endswith("free (ECExampleConnector's files, no budget: they stay "
                                 "until `down`)")


def _placed(topo, tmp_path: Path):
    from epdctl.launch.plan import plan

    return plan(topo, tmp_path / topo.name, visible_gpus=["0", "1"], cpu_count=2)


def test_up_refuses_a_connector_that_does_not_import(tmp_path: Path) -> None:
    """What `up` asks before anything starts (doctor's probe and checks): one line each."""
    from epdctl.launch.preflight import connector_problems

    topo = topology(cache={"connector": OOT})
    run = _runner({OOT: "ModuleNotFoundError: No module named 'my_pkg'"})
    probes = _probes([gpu("0"), gpu("1")], run)
    assert connector_problems(topo, _placed(topo, tmp_path), probes) == [
        f"cache.connector {OOT}: ModuleNotFoundError: No module named 'my_pkg' (in "
        "/venv/bin/python); make `my_pkg.ec` importable where the engines run (install it, or "
        "set PYTHONPATH in engine.env), and check the class name"]
    mooncake = topology(cache={"connector": "ECMooncakeConnector"})
    run = _runner({"mooncake.engine": "ModuleNotFoundError: No module named 'mooncake'"})
    [line] = connector_problems(mooncake, _placed(mooncake, tmp_path),
                                _probes([gpu("0"), gpu("1")], run))
    assert line.endswith("; `/venv/bin/python -m pip install mooncake-transfer-engine`")
    fine = _runner({OOT: None})
    assert connector_problems(topo, _placed(topo, tmp_path),
                              _probes([gpu("0"), gpu("1")], fine)) == []


def test_up_probes_nothing_for_connectors_that_need_nothing(tmp_path: Path) -> None:
    from epdctl.launch.preflight import connector_problems
    from tests.doctor.fakes import FakeRunner

    never = FakeRunner()  # any command would fail the test
    for connector in ("EpdctlShmECConnector", "ECExampleConnector"):
        topo = topology(cache={"connector": connector})
        assert connector_problems(topo, _placed(topo, tmp_path),
                                  _probes([gpu("0"), gpu("1")], never)) == []
    assert never.calls == []
    # An engine Python that cannot be probed is left to the engines (and doctor) to report.
    topo = topology(cache={"connector": OOT})
    broken = FakeRunner({"-c": Completed(1, "", "boom\n")})
    assert connector_problems(topo, _placed(topo, tmp_path),
                              _probes([gpu("0"), gpu("1")], broken)) == []
