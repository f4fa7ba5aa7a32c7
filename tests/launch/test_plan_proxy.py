"""The proxy's part of a plan: its argv from the topology's proxy section, and back."""

from __future__ import annotations

from pathlib import Path

import pytest

from epdctl.errors import TopologyError
from epdctl.launch.plan import flag_value
from tests.planning import PY, demo_plan, demo_topology


def test_proxy_options() -> None:
    topology = demo_topology({"prefill_decode": {}}, served_model_name="qwen",
                         proxy={"host": "0.0.0.0", "port": 9000, "api_key": "s3cret",
                                "metadata_rewrite": False, "decode_timeout": "5m"})
    result = demo_plan(topology)
    (pd,) = result.instances
    assert flag_value(pd.argv, "--served-model-name") == "qwen"
    assert result.model_name == "qwen"
    assert result.proxy.argv == (
        PY, "-m", "epdctl.proxy", "--host", "0.0.0.0", "--port", "9000", "--model", "qwen",
        "--prefill-decode", "http://127.0.0.1:8100",
        "--encode-timeout", "60.0", "--prefill-timeout", "120.0", "--decode-timeout", "300.0",
        "--stream-idle-timeout", "60.0", "--max-inflight", "256", "--no-metadata-rewrite",
    )
    assert result.proxy.env == {"EPDCTL_PROXY_API_KEY": "s3cret"}
    assert result.proxy.health_url == "http://127.0.0.1:9000/health"
    v6 = demo_plan(demo_topology({"prefill_decode": {}}, proxy={"host": "::1"}))
    assert v6.proxy.health_url == "http://[::1]:8000/health"


def test_client_uuids_reaches_the_proxy_and_parses_back() -> None:
    from epdctl.proxy.argv import parse_argv

    for given, flag in ((False, "--no-client-uuids"), (True, None), (None, None)):
        proxy = {} if given is None else {"client_uuids": given}
        topology = demo_topology({"encode": {}, "prefill_decode": {}}, proxy=proxy)
        argv = demo_plan(topology).proxy.argv
        assert argv[:3] == (PY, "-m", "epdctl.proxy")
        assert (flag in argv) if flag else not any("client-uuids" in a for a in argv)
        assert parse_argv(argv[3:]).client_uuids is (given is not False)
    with pytest.raises(TopologyError, match="proxy -> client_uuids: expected true or false"):
        demo_topology({"prefill_decode": {}}, proxy={"client_uuids": "no"})


def test_the_proxy_looks_in_the_topologys_store_unless_switched_off(tmp_path: Path) -> None:
    from epdctl.proxy.argv import parse_argv

    topology = demo_topology({"encode": {}, "prefill_decode": {}}, cache={"dir": str(tmp_path)})
    result = demo_plan(topology)
    config = parse_argv(result.proxy.args)
    assert (config.store_dir, config.namespace) == (str(tmp_path), result.namespace)
    assert result.store_dir == tmp_path / config.namespace  # the namespace E and PD use
    assert config.should_look_up
    off = demo_plan(demo_topology({"encode": {}, "prefill_decode": {}},
                          proxy={"skip_cached_items": False}))
    assert "--no-skip-cached-items" in off.proxy.args
    assert not parse_argv(off.proxy.args).should_look_up
    aggregated = demo_plan(demo_topology({"prefill_decode": {}}))  # no encoder: nothing to skip
    assert "--store-dir" not in aggregated.proxy.args
