"""render_k8s() as pure data: connector choices, DNS wiring, labels, errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _k8s_schema import validate

from epdctl.errors import RenderError
from epdctl.render import K8sOptions, render_k8s
from epdctl.render.k8s import escape
from epdctl.topology.model import parse_topology

E_P_D = {
    "name": "epd",
    "model": "m/vl",
    "engine": {"args": ["--dtype", "bfloat16"], "env": {"HF_HUB_OFFLINE": "1"}},
    "roles": {"encode": {"replicas": 2}, "prefill": {"tensor_parallel": 2},
              "decode": {"tensor_parallel": 4, "args": ["--x", "$(HOME)"]}},
}


E_PD = {"name": "vl", "model": "m/vl",
        "roles": {"encode": {}, "prefill_decode": {"replicas": 2}}}
CPU_EC = "ECCPUConnector"  # E|P|D cannot use the default Mooncake connector


def _render(data: dict[str, Any] | None = None, **options: Any):
    if data is None:
        options.setdefault("ec_connector", CPU_EC)
    topology = parse_topology(data or E_P_D)
    return render_k8s(topology, "name: x\n", K8sOptions(**options))


def _by(rendering, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendering.objects if o["kind"] == kind}


def _container(obj: dict) -> dict:
    spec = obj["spec"]
    template = spec.get("template") or spec["leaderWorkerTemplate"]["leaderTemplate"]
    return template["spec"]["containers"][0]


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_engine_argv_is_the_local_plans_with_cluster_host_port_and_connectors() -> None:
    pods = _by(_render(), "StatefulSet")
    prefill = _container(pods["epd-prefill"])
    argv = prefill["command"]
    assert argv[:7] == ["vllm", "serve", "m/vl", "--host", "0.0.0.0", "--port", "8000"]
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert _flag(argv, "--dtype") == "bfloat16"
    assert argv.count("--host") == 1 and argv.count("--port") == 1
    ec = json.loads(_flag(argv, "--ec-transfer-config"))
    assert ec == {"ec_connector": CPU_EC, "ec_role": "ec_consumer", "engine_id": "$(POD_NAME)",
                  "ec_connector_extra_config": {"ec_cpu_bytes": 8 << 30, "ec_enable_nixl": True}}
    kv = json.loads(_flag(argv, "--kv-transfer-config"))
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    env = {e["name"]: e for e in prefill["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env
    # POD_IP must be defined before the entries that reference it.
    names = [e["name"] for e in prefill["env"]]
    assert names.index("POD_IP") < names.index("VLLM_NIXL_SIDE_CHANNEL_HOST")
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == "2"
    encode = json.loads(_flag(_container(pods["epd-encode"])["command"], "--ec-transfer-config"))
    assert encode["ec_role"] == "ec_producer"


def test_user_dollar_paren_is_escaped_so_kubelet_passes_it_literally() -> None:
    argv = _container(_by(_render(), "StatefulSet")["epd-decode"])["command"]
    assert _flag(argv, "--x") == "$$(HOME)"
    assert escape("a$(B)c$$") == "a$$(B)c$$"


def test_proxy_urls_are_pod_dns_names_the_statefulsets_create() -> None:
    rendering = _render()
    sets, services = _by(rendering, "StatefulSet"), _by(rendering, "Service")
    argv = _container(_by(rendering, "Deployment")["epd-proxy"])["command"]
    urls = [argv[i + 1] for i, a in enumerate(argv) if a in ("--encode", "--prefill", "--decode")]
    assert len(urls) == 4
    for url in urls:
        host, port = url.removeprefix("http://").split(":")
        pod, service = host.split(".")
        owner = sets[service]
        assert owner["spec"]["serviceName"] == service
        assert services[service]["spec"]["clusterIP"] == "None"
        assert int(pod.rsplit("-", 1)[1]) < owner["spec"]["replicas"]
        assert port == "8000"
    assert _flag(argv, "--host") == "0.0.0.0"


def test_every_object_is_labelled_and_valid() -> None:
    rendering = _render(namespace="epd")
    for obj in rendering.objects:
        assert obj["metadata"]["labels"]["epdctl/topology"] == "epd"
        assert obj["metadata"]["namespace"] == "epd"
        if obj["kind"] != "ConfigMap":
            assert obj["metadata"]["labels"]["epdctl/role"]
        validate(obj)


def test_gpus_per_node_makes_a_leader_worker_set_for_wide_tp() -> None:
    rendering = _render(gpus_per_node=2)
    lws = _by(rendering, "LeaderWorkerSet")
    assert set(lws) == {"epd-decode"}
    group = lws["epd-decode"]["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    leader = group["leaderTemplate"]["spec"]["containers"][0]
    worker = group["workerTemplate"]["spec"]["containers"][0]
    assert _flag(leader["command"], "--nnodes") == "2"
    assert _flag(leader["command"], "--tensor-parallel-size") == "4"
    assert "--headless" not in leader["command"] and worker["command"][-1] == "--headless"
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "readinessProbe" in leader and "readinessProbe" not in worker
    assert "epd-decode" not in _by(rendering, "Service")  # LWS makes its own
    assert any("LeaderWorkerSet" in n for n in rendering.notes)
    validate(lws["epd-decode"])


def test_api_key_goes_to_a_secret_not_the_config_map() -> None:
    data = {**E_P_D, "proxy": {"api_key": "k3y"}}
    text = "name: epd\nproxy:\n  api_key: k3y\n"
    rendering = render_k8s(parse_topology(data), text, K8sOptions(ec_connector=CPU_EC))
    assert "k3y" not in _by(rendering, "ConfigMap")["epd-topology"]["data"]["topology.yaml"]
    assert _by(rendering, "Secret")["epd-proxy-api-key"]["stringData"] == {"api-key": "k3y"}
    env = _container(_by(rendering, "Deployment")["epd-proxy"])["env"]
    assert env[0]["valueFrom"]["secretKeyRef"]["name"] == "epd-proxy-api-key"
    ref = {"secretKeyRef": {"name": "epd-proxy-api-key", "key": "api-key"}}
    assert {e["name"]: e["valueFrom"] for e in env} == {
        "EPDCTL_PROXY_API_KEY": ref, "EPDCTL_PROXY_UPSTREAM_KEY": ref}
    # The instances require the key too, from the same Secret; it is nowhere else.
    for obj in _by(rendering, "StatefulSet").values():
        container = _container(obj)
        assert {"name": "VLLM_API_KEY", "valueFrom": ref} in container["env"]
        assert "--middleware" not in container["command"]  # the image need not have epdctl
    shown = json.dumps([o for o in rendering.objects if o["kind"] != "Secret"])
    assert "k3y" not in shown and "k3y" not in " ".join(rendering.notes)
    assert any("NetworkPolicy" in n for n in rendering.notes)


@pytest.mark.parametrize(
    ("change", "options", "message"),
    [
        ({"device": "cpu", "roles": {"encode": {}, "prefill_decode": {}}}, {},
         "`epd` is a `device: cpu` topology: it runs on one machine only"),
        ({"roles": {"encode": {"tensor_parallel": 2}, "prefill_decode": {}}}, {},
         "roles -> encode -> tensor_parallel: ECMooncakeConnector producers need 1, not 2"),
        ({}, {"ec_connector": "EpdctlShmECConnector"},
         "--ec-connector EpdctlShmECConnector: epdctl's shared-memory store does not cross"),
        ({}, {"gpus_per_node": 3, "ec_connector": CPU_EC},
         "roles -> decode -> tensor_parallel: 4 does not split into nodes of 3 GPU(s)"),
        ({"name": "9lives"}, {}, "name: `9lives` must start with a letter"),
        ({}, {}, "`epd` is E|P|D: ECMooncakeConnector works with E|PD only"),
    ],
)
def test_what_cannot_run_on_a_cluster_is_refused(change, options, message) -> None:
    with pytest.raises(RenderError) as info:
        _render({**E_P_D, **change}, **options)
    assert str(info.value).startswith(message)


def test_other_ec_connectors_get_no_mooncake_settings() -> None:
    rendering = _render(ec_connector="ECCPUConnector")
    container = _container(_by(rendering, "StatefulSet")["epd-encode"])
    ec = json.loads(_flag(container["command"], "--ec-transfer-config"))
    assert ec["ec_connector_extra_config"] == {"ec_cpu_bytes": 8 << 30, "ec_enable_nixl": True}
    assert "ec_ip" not in ec
    unknown = _render(ec_connector="MyEC")
    ec = json.loads(_flag(_container(_by(unknown, "StatefulSet")["epd-encode"])["command"],
                          "--ec-transfer-config"))
    assert ec == {"ec_connector": "MyEC", "ec_role": "ec_producer", "engine_id": "$(POD_NAME)"}
    assert any("knows no settings for MyEC" in n for n in unknown.notes)


def test_pd_topology_without_encoder_has_no_ec_config_or_notes() -> None:
    rendering = _render({"name": "pd", "model": "m", "roles": {"prefill_decode": {}}})
    argv = _container(_by(rendering, "StatefulSet")["pd-pd"])["command"]
    assert "--ec-transfer-config" not in argv and "--kv-transfer-config" not in argv
    assert not any("EC transfer" in n for n in rendering.notes)


def test_mooncake_consumers_and_the_proxy_flags_that_name_their_control_sockets() -> None:
    rendering = _render(E_PD)
    pods = _by(rendering, "StatefulSet")
    pd = _container(pods["vl-pd"])
    ec = json.loads(_flag(pd["command"], "--ec-transfer-config"))
    assert ec == {"ec_connector": "ECMooncakeConnector", "ec_role": "ec_consumer",
                  "engine_id": "$(POD_NAME)", "ec_ip": "$(POD_IP)", "ec_port": 14579,
                  "ec_connector_extra_config": {"mooncake_protocol": "tcp"}}
    assert {"name": "ec-control", "containerPort": 14579} in pd["ports"]
    argv = _container(_by(rendering, "Deployment")["vl-proxy"])["command"]
    assert _flag(argv, "--ec-protocol") == "mooncake"
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--ec-consumer"]
    assert pairs == ["http://vl-pd-0.vl-pd:8000=tcp://vl-pd-0.vl-pd:14579",
                     "http://vl-pd-1.vl-pd:8000=tcp://vl-pd-1.vl-pd:14579"]
    # The pairs name exactly the --prefill-decode URLs the proxy routes to: it refuses to
    # start otherwise.
    pd_urls = [argv[i + 1] for i, a in enumerate(argv) if a == "--prefill-decode"]
    assert [p.split("=", 1)[0] for p in pairs] == pd_urls
    from epdctl.proxy.__main__ import parse_args

    config = parse_args(argv[3:])
    assert config.consumer_zmq(pd_urls[1]) == "tcp://vl-pd-1.vl-pd:14579"
    assert not any("NOT YET WORKING" in n for n in rendering.notes)
    assert any("--ec-protocol mooncake" in n for n in rendering.notes)


def test_other_connectors_leave_the_proxy_on_the_shared_protocol() -> None:
    argv = _container(_by(_render(E_PD, ec_connector=CPU_EC), "Deployment")["vl-proxy"])[
        "command"]
    assert "--ec-protocol" not in argv and "--ec-consumer" not in argv


def test_a_topology_on_mooncake_locally_renders_with_the_clusters_sockets() -> None:
    """cache.connector plans local control sockets; the pods and proxy get the cluster's."""
    local = {**E_PD, "cache": {"connector": "ECMooncakeConnector",
                               "extra_config": {"mooncake_protocol": "rdma"}}}
    rendering = _render(local)
    argv = _container(_by(rendering, "Deployment")["vl-proxy"])["command"]
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--ec-consumer"]
    assert pairs == ["http://vl-pd-0.vl-pd:8000=tcp://vl-pd-0.vl-pd:14579",
                     "http://vl-pd-1.vl-pd:8000=tcp://vl-pd-1.vl-pd:14579"]
    pd = _container(_by(rendering, "StatefulSet")["vl-pd"])
    ec = json.loads(_flag(pd["command"], "--ec-transfer-config"))
    assert (ec["ec_ip"], ec["ec_port"]) == ("$(POD_IP)", 14579)
    assert ec["ec_connector_extra_config"] == {"mooncake_protocol": "rdma"}  # the topology's
    other = _container(_by(_render(local, ec_connector=CPU_EC), "Deployment")["vl-proxy"])
    assert "--ec-protocol" not in other["command"] and "--ec-consumer" not in other["command"]


def test_the_cli_defaults_to_the_topologys_network_connector(epdctl, tmp_path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("name: vl\nmodel: m/vl\ncache: {connector: ECCPUConnector}\n"
                    "roles: {encode: {}, prefill_decode: {}}\n")
    result = epdctl("render", "k8s", str(path))
    assert result.exit_code == 0, result.stderr
    assert '"ec_connector":"ECCPUConnector"' in result.stdout
    assert "--ec-protocol" not in result.stdout


@pytest.mark.parametrize(("proxy", "command"), [
    ({"api_key_file": "/run/keys/proxy"}, "--from-file=api-key=/run/keys/proxy"),
    ({"api_key": "${PROXY_KEY}"}, '--from-literal=api-key="$PROXY_KEY"'),
])
def test_a_key_from_a_file_or_the_environment_is_never_rendered(proxy, command) -> None:
    """render cannot and must not read it: no Secret object, the notes say how to make it,
    and the pods read it from that Secret as they would a literal key's."""
    rendering = render_k8s(parse_topology({**E_P_D, "proxy": proxy}), "name: epd\n",
                           K8sOptions(ec_connector=CPU_EC))
    assert "Secret" not in {o["kind"] for o in rendering.objects}
    note = next(n for n in rendering.notes if "kubectl create secret" in n)
    assert "generic epd-proxy-api-key" in note and command in note
    ref = {"secretKeyRef": {"name": "epd-proxy-api-key", "key": "api-key"}}
    env = _container(_by(rendering, "Deployment")["epd-proxy"])["env"]
    assert {e["name"]: e["valueFrom"] for e in env} == {
        "EPDCTL_PROXY_API_KEY": ref, "EPDCTL_PROXY_UPSTREAM_KEY": ref}
