"""No side doors: every instance of a run requires the run's internal key (with or without
proxy.api_key), which only the proxy gets, and which no shown command line, baseline or argv
carries; render, which has no run, keys the instances only behind a keyed proxy."""

from __future__ import annotations

from pathlib import Path

from epdctl.engines.guard import MIDDLEWARE
from epdctl.launch.plan import flag_value
from epdctl.launch.run import make_plan
from epdctl.launch.state import RunState, Settings, SpecModel
from epdctl.verifier.baseline import baseline_spec
from tests.planning import demo_plan, demo_topology

KEY = "int3rnal-k3y"
ROLES = {"encode": {}, "prefill": {}, "decode": {}}


def test_with_an_api_key_every_instance_requires_the_internal_key() -> None:
    result = demo_plan(demo_topology(ROLES, proxy={"api_key": "outside"}), internal_key=KEY)
    for spec in result.instances:
        assert spec.is_key_required and spec.env["VLLM_API_KEY"] == KEY
        assert flag_value(spec.argv, "--middleware") == MIDDLEWARE
        assert "VLLM_API_KEY=<internal> " in spec.shell() and KEY not in spec.shell()
    assert result.proxy.env == {"EPDCTL_PROXY_API_KEY": "outside",
                                "EPDCTL_PROXY_UPSTREAM_KEY": KEY}
    assert result.proxy.shell().startswith(
        "EPDCTL_PROXY_API_KEY=<proxy.api_key> EPDCTL_PROXY_UPSTREAM_KEY=<internal> ")
    assert all(KEY not in " ".join(s.argv) for s in result.specs)


def test_without_an_api_key_the_instances_still_require_the_internal_key() -> None:
    result = demo_plan(demo_topology(ROLES), internal_key=KEY)
    for spec in result.instances:
        assert spec.is_key_required and spec.env["VLLM_API_KEY"] == KEY
        assert flag_value(spec.argv, "--middleware") == MIDDLEWARE
        assert KEY not in spec.shell()
    assert result.proxy.env == {"EPDCTL_PROXY_UPSTREAM_KEY": KEY}  # the proxy itself is open


def test_without_a_run_key_or_an_api_key_the_plan_is_open() -> None:
    """render's plan: no run, no key to give; the manifests' notes say how to close it."""
    result = demo_plan(demo_topology(ROLES))
    for spec in result.instances:
        assert not spec.is_key_required and "VLLM_API_KEY" not in spec.env
        assert "--middleware" not in spec.argv
    assert result.proxy.env == {}


def test_every_plan_up_makes_has_a_key() -> None:
    plan = make_plan(demo_topology({"prefill_decode": {}}), Path("/state/demo"), is_dry_run=True)
    assert all(s.is_key_required and len(s.env["VLLM_API_KEY"]) >= 40 for s in plan.instances)


def test_each_run_gets_a_fresh_key_kept_in_its_state() -> None:
    topology = demo_topology({"prefill_decode": {}}, proxy={"api_key": "outside"})
    first, second = (make_plan(topology, Path("/state/demo"), is_dry_run=True)
                     for _ in range(2))
    one, two = first.instances[0].env["VLLM_API_KEY"], second.instances[0].env["VLLM_API_KEY"]
    assert one != two and len(one) >= 40
    assert first.proxy.env["EPDCTL_PROXY_UPSTREAM_KEY"] == one
    state = RunState.of(first, "/t.yaml", Settings())
    back = RunState.model_validate_json(state.model_dump_json())
    assert back.internal_key == one and back.proxy_api_key == "outside"
    assert back.specs[0].spec() == first.instances[0]
    assert SpecModel.of(first.instances[0]).is_key_required is True


def test_the_baseline_verify_starts_has_no_key(tmp_path: Path) -> None:
    result = demo_plan(demo_topology({"prefill_decode": {}}, proxy={"api_key": "outside"}),
                   internal_key=KEY)
    twin = baseline_spec(result.instances[0], 9999, tmp_path / "b.log")
    assert "VLLM_API_KEY" not in twin.env and "--middleware" not in twin.argv
