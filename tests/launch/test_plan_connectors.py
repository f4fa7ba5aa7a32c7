"""cache.connector: each EC connector in each mode planned (argv, env, ports, proxy, notes),
refused where it cannot run, and cleaned up by `down` where it keeps files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from epdctl import cache
from epdctl.errors import PlanError, TopologyError
from epdctl.launch.plan import Plan, compute_namespace, flag_value, plan
from epdctl.launch.spec import LaunchSpec
from epdctl.topology.model import Topology, parse_topology

STATE = Path("/state/demo")
MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
STORE = Path(cache.default_store_root())
OOT = "my_pkg.connectors:MyECConnector"
MODES = {
    "e-pd": {"encode": {}, "prefill_decode": {"replicas": 2}},
    "epd": {"encode": {}, "prefill": {}, "decode": {}},
}
CONNECTORS = (cache.CONNECTOR_NAME, "ECExampleConnector", "ECMooncakeConnector",
              "ECCPUConnector", OOT)


def _topology(roles: dict, connector: str = cache.CONNECTOR_NAME, **extra: Any) -> Topology:
    cache_section = {"connector": connector, **extra.pop("cache", {})}
    return parse_topology({"name": "demo", "model": MODEL, "roles": roles,
                           "cache": cache_section, **extra})


def _plan(topology: Topology) -> Plan:
    return plan(topology, STATE, visible_gpus=[str(i) for i in range(6)], vllm_version="0.32.0",
                python="/py", cpu_count=4)


def _ec(spec: LaunchSpec) -> dict | None:
    value = flag_value(spec.argv, "--ec-transfer-config")
    return None if value is None else json.loads(value)


def _runs(connector: str, mode: str) -> bool:
    return not (connector == "ECMooncakeConnector" and mode == "epd")


CASES = [(c, m) for c in CONNECTORS for m in MODES if _runs(c, m)]


@pytest.mark.parametrize(("connector", "mode"), CASES)
def test_every_instance_gets_the_connector_with_its_role(connector: str, mode: str) -> None:
    result = _plan(_topology(MODES[mode], connector))
    module, _, name = connector.rpartition(":")
    for spec in result.instances:
        ec = _ec(spec)
        assert ec is not None
        assert ec["ec_connector"] == (name if module else connector)
        assert ec["ec_role"] == ("ec_producer" if spec.role == "encode" else "ec_consumer")
        assert ec["engine_id"] == f"demo-{spec.name}"
        if module:
            assert ec["ec_connector_module_path"] == module
        elif connector != cache.CONNECTOR_NAME:
            # vLLM's own: resolved from its registry, which a module path would not change.
            assert "ec_connector_module_path" not in ec
    ports = [p for s in result.specs for p in (s.port, s.side_channel_port, *s.ec_ports)
             if p is not None]
    assert len(ports) == len(set(ports)), "every port is unique"
    assert result.ec_connector == connector


@pytest.mark.parametrize("mode", MODES)
def test_example_connector_writes_under_the_namespace_dir(mode: str) -> None:
    result = _plan(_topology(MODES[mode], "ECExampleConnector"))
    assert result.store_dir == STORE / result.namespace
    for spec in result.instances:
        assert _ec(spec)["ec_connector_extra_config"] == {
            "shared_storage_path": str(STORE / result.namespace)}
        assert spec.ec_ports == ()
        assert not any(k.startswith("VLLM_EC_") or k == "VLLM_USE_V2_MODEL_RUNNER"
                       for k in spec.env)
    proxy = result.proxy.argv
    assert "--ec-protocol" not in proxy and "--ec-consumer" not in proxy
    (note,) = result.notes
    assert note.startswith(f"EC transfer: ECExampleConnector, one safetensors file per item "
                           f"under {STORE / result.namespace} (the namespace is in the path")
    assert "nothing is evicted" in note


def test_mooncake_e_pd_is_the_local_twin_of_render_k8s() -> None:
    topology = _topology({"encode": {"replicas": 2},
                          "prefill_decode": {"replicas": 2, "tensor_parallel": 2}},
                         "ECMooncakeConnector", ports={"base": 8100, "side_channel_base": 8102})
    result = _plan(topology)
    e0, e1, pd0, pd1 = result.instances
    # HTTP 8100-8103 come first; each PD binds one control socket per TP rank, from ec_port.
    assert (pd0.ec_ports, pd1.ec_ports) == ((8104, 8105), (8106, 8107))
    assert e0.ec_ports == e1.ec_ports == ()
    assert _ec(e0) == {"ec_connector": "ECMooncakeConnector", "ec_role": "ec_producer",
                       "engine_id": "demo-encode-0",
                       "ec_connector_extra_config": {"mooncake_protocol": "tcp"}}
    assert _ec(pd1) == {"ec_connector": "ECMooncakeConnector", "ec_role": "ec_consumer",
                        "engine_id": "demo-pd-1", "ec_ip": "127.0.0.1", "ec_port": 8106,
                        "ec_connector_extra_config": {"mooncake_protocol": "tcp"}}
    argv = list(result.proxy.argv)
    assert argv[argv.index("--ec-protocol") + 1] == "mooncake"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--ec-consumer"] == [
        f"{pd0.url}=tcp://127.0.0.1:8104", f"{pd1.url}=tcp://127.0.0.1:8106"]
    (note,) = result.notes
    assert "control ports: pd-0 8104-8105, pd-1 8106-8107" in note


def test_ec_cpu_connector_gets_the_v2_runner_and_a_side_channel_per_producer() -> None:
    topology = _topology(MODES["epd"], "ECCPUConnector",
                         cache={"capacity": "1GiB", "extra_config": {"consumer_ack_timeout_s": 5}})
    result = _plan(topology)
    encode, prefill, decode = result.instances
    assert encode.ec_ports == (5602,)  # after prefill's and decode's NIXL side channels
    assert (prefill.side_channel_port, decode.side_channel_port) == (5600, 5601)
    assert encode.env["VLLM_EC_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert encode.env["VLLM_EC_SIDE_CHANNEL_PORT"] == "5602"
    for spec in result.instances:
        assert spec.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
        assert _ec(spec)["ec_connector_extra_config"] == {
            "ec_cpu_bytes": 1 << 30, "ec_enable_nixl": True, "consumer_ack_timeout_s": 5}
    assert "VLLM_EC_SIDE_CHANNEL_PORT" not in prefill.env
    # The proxy forwards E's ec_transfer_params (peer host/port) as for any connector.
    assert "--ec-protocol" not in result.proxy.argv


def test_out_of_tree_connector_gets_extra_config_verbatim() -> None:
    topology = _topology(MODES["e-pd"], OOT,
                         cache={"extra_config": {"root": "/data/ec", "depth": 2}})
    result = _plan(topology)
    for spec in result.instances:
        assert _ec(spec) == {
            "ec_connector": "MyECConnector", "ec_connector_module_path": "my_pkg.connectors",
            "ec_role": "ec_producer" if spec.role == "encode" else "ec_consumer",
            "engine_id": f"demo-{spec.name}",
            "ec_connector_extra_config": {"root": "/data/ec", "depth": 2}}
    (note,) = result.notes
    assert "epdctl's namespace does not reach it" in note and "`verify` cannot see" in note


def test_our_connector_takes_extra_config_too_and_has_no_notes() -> None:
    topology = _topology(MODES["e-pd"], cache={"extra_config": {"trace": True}})
    result = _plan(topology)
    assert _ec(result.instances[0])["ec_connector_extra_config"] == {
        "store_dir": str(STORE), "namespace": result.namespace,
        "capacity_bytes": topology.cache.capacity, "trace": True}
    assert result.notes == ()


def test_without_an_encoder_no_instance_gets_a_connector() -> None:
    result = _plan(_topology({"prefill_decode": {}}, "ECExampleConnector"))
    assert _ec(result.instances[0]) is None and result.instances[0].ec_ports == ()
    assert result.notes == ("cache.connector ECExampleConnector is not used: there is no "
                            "encode role",)


def test_the_namespace_depends_on_the_connector_but_not_for_ours() -> None:
    ours = _topology(MODES["e-pd"])
    names = {c: compute_namespace(_topology(MODES["e-pd"], c), "0.32.0") for c in CONNECTORS}
    assert len(set(names.values())) == len(CONNECTORS)
    assert names[cache.CONNECTOR_NAME] == compute_namespace(ours, "0.32.0")
    plain = parse_topology({"name": "demo", "model": MODEL, "roles": MODES["e-pd"]})
    assert compute_namespace(plain, "0.32.0") == names[cache.CONNECTOR_NAME]


def test_ec_ports_past_65535() -> None:
    topology = _topology({"encode": {}, "prefill_decode": {"tensor_parallel": 2}},
                         "ECMooncakeConnector", ports={"side_channel_base": 65535})
    with pytest.raises(PlanError) as info:
        _plan(topology)
    assert str(info.value) == ("ports -> side_channel_base: 2 port(s) from 65535 do not fit "
                               "below 65536")


def _problems(data: dict) -> list[str]:
    with pytest.raises(TopologyError) as info:
        parse_topology({"name": "demo", "model": MODEL, **data})
    return str(info.value).splitlines()[1:]


@pytest.mark.parametrize(("data", "line"), [
    ({"cache": {"connector": "ECMooncakeConnector"}, "roles": MODES["epd"]},
     "cache -> connector: ECMooncakeConnector works with E|PD only (vLLM's Mooncake consumer "
     "routing does not cover P|D); use ECCPUConnector, ECExampleConnector or "
     "EpdctlShmECConnector"),
    ({"cache": {"connector": "ECMooncakeConnector"}, "device": "cpu", "roles": MODES["e-pd"]},
     "cache -> connector: ECMooncakeConnector is planned for `device: cuda` only (its transfer "
     "buffers are CUDA memory); on CPU use ECExampleConnector"),
    ({"cache": {"connector": "ECMooncakeConnector"},
      "roles": {"encode": {"tensor_parallel": 2}, "prefill_decode": {}}},
     "roles -> encode -> tensor_parallel: ECMooncakeConnector producers need 1, not 2; use "
     "more encode replicas instead"),
    ({"cache": {"connector": "ECCPUConnector"}, "device": "cpu", "roles": MODES["e-pd"]},
     "cache -> connector: ECCPUConnector cannot run on `device: cpu`: it needs vLLM's V2 model "
     "runner and CUDA (streams, events, cudaHostRegister; see vLLM's ec_connector/cpu/); use "
     "ECExampleConnector"),
    ({"cache": {"connector": "ECExampleConnector",
                "extra_config": {"shared_storage_path": "/tmp/x"}}, "roles": MODES["e-pd"]},
     "cache -> extra_config: shared_storage_path is planned by epdctl for ECExampleConnector "
     "(under cache.dir); set cache.dir instead"),
    ({"cache": {"extra_config": {"namespace": "mine"}}, "roles": MODES["e-pd"]},
     "cache -> extra_config: namespace is planned by epdctl for EpdctlShmECConnector (under "
     "cache.dir); set cache.dir instead"),
    ({"cache": {"extra_config": {"capacity_bytes": 1}}, "roles": MODES["e-pd"]},
     "cache -> extra_config: capacity_bytes is planned by epdctl for EpdctlShmECConnector "
     "(from cache.capacity); set cache.capacity instead"),
    ({"cache": {"connector": "ECSharedMemoryConnector"}, "roles": MODES["e-pd"]},
     "cache -> connector: expected EpdctlShmECConnector, ECExampleConnector, "
     "ECMooncakeConnector, ECCPUConnector or module.path:ClassName, got "
     "`ECSharedMemoryConnector`"),
    ({"cache": {"connector": "my-pkg.ec:Mine"}, "roles": MODES["e-pd"]},
     "cache -> connector: expected EpdctlShmECConnector, ECExampleConnector, "
     "ECMooncakeConnector, ECCPUConnector or module.path:ClassName, got `my-pkg.ec:Mine`"),
    ({"cache": {"connector": "my_pkg.ec:ECExampleConnector"}, "roles": MODES["e-pd"]},
     "cache -> connector: `ECExampleConnector` is vLLM's own connector name, so vLLM would "
     "load that one and ignore `my_pkg.ec`; give your class another name"),
    ({"cache": {"connector": "ECMooncakeConnector"}, "device": "cpu", "roles": MODES["epd"]},
     "cache -> connector: ECMooncakeConnector is planned for `device: cuda` only (its transfer "
     "buffers are CUDA memory); on CPU use ECExampleConnector"),
])
def test_unsupported_combinations_are_one_line_each(data: dict, line: str) -> None:
    assert _problems(data) == [f"  {line}"]


def test_cleanup_follows_the_connector(tmp_path: Path) -> None:
    """`down` (StateDir.finish) drops ECExampleConnector's directory, unless kept."""
    from epdctl.launch.run import settings_of
    from epdctl.launch.state import RunState, StateDir

    for keep in (False, True):
        topology = _topology(MODES["e-pd"], "ECExampleConnector",
                             cache={"dir": str(tmp_path / "store"), "keep_on_down": keep})
        placed = plan(topology, tmp_path / f"state-{keep}", vllm_version="0.32.0",
                      visible_gpus=["0", "1", "2"])
        item = placed.store_dir / "key" / "encoder_cache.safetensors"
        item.parent.mkdir(parents=True)
        item.write_bytes(b"x")
        state = RunState.of(placed, "t.yaml", settings_of(topology))
        assert state.ec_connector == "ECExampleConnector" and not state.is_our_store
        sdir = StateDir(placed.state_dir)
        sdir.write(state)
        sdir.finish(sdir.read())
        assert item.exists() is keep
        item.unlink(missing_ok=True)


def test_the_janitor_runs_for_our_store_only(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    from epdctl.cache import janitor
    from epdctl.launch.run import settings_of
    from epdctl.launch.state import RunState, StateDir
    from epdctl.launch.supervisor import Supervisor

    calls: list[str] = []
    monkeypatch.setattr(janitor, "keep_topology_store", lambda ns_dir, name, **kw: calls.append(
        name))
    for connector in (cache.CONNECTOR_NAME, "ECExampleConnector", OOT):
        topology = _topology(MODES["e-pd"], connector)
        state = RunState.of(_plan(topology), "t.yaml", settings_of(topology))
        Supervisor(StateDir(tmp_path), state)._janitor()
    assert calls == ["demo"]


def test_ports_check_names_the_ec_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    from epdctl.launch import ports

    result = _plan(_topology({"encode": {}, "prefill_decode": {}}, "ECMooncakeConnector"))
    asked: list[int] = []
    monkeypatch.setattr(ports, "_bind_error", lambda port, host: asked.append(port))
    ports.check_plan_ports(result)
    assert result.instances[1].ec_ports[0] in asked
