"""plan(): argv, env, ports, GPUs and connector JSON, as pure data (no processes, no sockets)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from epdctl import cache
from epdctl.errors import PlanError
from epdctl.launch.plan import compute_namespace, flag_value, has_quiet_probes
from epdctl.topology.model import load_topology, parse_topology
from tests.planning import (
    GPUS,
    MODEL,
    PY,
    ROOT,
    SHIPPED,
    STATE,
    VLLM,
    demo_plan,
    demo_topology,
    json_flag,
    load_shipped,
)


def _ipc(instance: str) -> dict[str, str]:
    """The env every engine of the demo plan gets for its sockets and temp files
    (tests/host/test_ipc.py checks it)."""
    from epdctl.host import ipc

    return ipc.engine_env(STATE, instance)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_topology_plans(path: Path) -> None:
    topology = load_shipped(path)
    result = demo_plan(topology, visible_gpus=GPUS[:4] if "2e2pd" not in path.name else GPUS)
    ports = [s.port for s in result.specs]
    ports += [s.side_channel_port for s in result.specs if s.side_channel_port is not None]
    assert len(ports) == len(set(ports)), "every port is unique"
    has_e = "encode" in topology.roles
    cuda = topology.device == "cuda"
    for spec in result.instances:
        assert spec.argv[spec.argv.index("--port") + 1] == str(spec.port)
        assert flag_value(spec.argv, "--host") == "127.0.0.1"
        assert topology.model in spec.argv
        assert spec.health_url == f"http://127.0.0.1:{spec.port}/health"
        assert spec.log_path == STATE / "logs" / f"{spec.name}.log"
        ec = json_flag(spec, "--ec-transfer-config")
        role = {"ec_role": "ec_producer" if spec.role == "encode" else "ec_consumer",
                "engine_id": f"{topology.name}-{spec.name}"}
        if has_e and topology.cache.connector == "ECExampleConnector":
            assert ec == {"ec_connector": "ECExampleConnector", **role,
                          "ec_connector_extra_config": {
                              "shared_storage_path": str(result.store_dir)}}
        elif has_e:
            assert topology.cache.connector == cache.CONNECTOR_NAME
            assert ec == {
                "ec_connector": cache.CONNECTOR_NAME,
                "ec_connector_module_path": cache.CONNECTOR_MODULE, **role,
                "ec_connector_extra_config": {"store_dir": str(topology.cache.dir),
                                              "namespace": result.namespace,
                                              "capacity_bytes": topology.cache.capacity},
            }
        else:
            assert ec is None
        kv = json_flag(spec, "--kv-transfer-config")
        if spec.role in ("prefill", "decode"):
            assert kv is not None
            assert kv["kv_connector"] == ("NixlConnector" if cuda else "ExampleConnector")
            assert kv["kv_role"] == ("kv_producer" if spec.role == "prefill" else "kv_consumer")
            assert spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(spec.side_channel_port)
        else:
            assert kv is None
            assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in spec.env
        if cuda:
            assert spec.env["CUDA_VISIBLE_DEVICES"] == ",".join(spec.gpus)
            assert len(spec.gpus) == topology.roles[spec.role].tensor_parallel
            assert "VLLM_CPU_OMP_THREADS_BIND" not in spec.env
        else:
            assert "CUDA_VISIBLE_DEVICES" not in spec.env
            assert spec.env["VLLM_CPU_OMP_THREADS_BIND"]
    assert result.proxy.argv[:3] == (PY, "-m", "epdctl.proxy")
    assert result.store_dir == topology.cache.dir / result.namespace


def test_1e1pd_exact() -> None:
    result = demo_plan(load_topology(ROOT / "topologies" / "qwen2_5-vl-1e1pd.yaml"))
    assert result.mode == "e-pd"
    assert [s.name for s in result.specs] == ["encode-0", "pd-0", "proxy"]
    encode, pd = result.instances
    ns = result.namespace
    assert ns == compute_namespace(load_topology(ROOT / "topologies" / "qwen2_5-vl-1e1pd.yaml"),
                                   VLLM)
    common = ["--dtype", "bfloat16", "--max-model-len", "16384", "--limit-mm-per-prompt",
              '{"image": 4, "video": 0}', "--mm-processor-kwargs", '{"max_pixels": 1003520}']
    quiet = ["--disable-access-log-for-endpoints", "/health,/metrics"]

    def ec(role: str, name: str) -> str:
        return (
            '{"ec_connector":"EpdctlShmECConnector","ec_connector_module_path":"epdctl.connector",'
            f'"ec_role":"{role}","engine_id":"qwen-vl-1e1pd-{name}","ec_connector_extra_config":'
            f'{{"store_dir":"/dev/shm/epdctl-{os.geteuid()}","namespace":"{ns}",'
            f'"capacity_bytes":{8 << 30}}}}}'
        )

    assert encode.argv == (
        "vllm", "serve", MODEL, "--host", "127.0.0.1", "--port", "8100", *quiet, *common,
        "--enforce-eager", "--max-num-batched-tokens", "114688", "--max-num-seqs", "128",
        "--ec-transfer-config", ec("ec_producer", "encode-0"),
    )
    assert pd.argv == (
        "vllm", "serve", MODEL, "--host", "127.0.0.1", "--port", "8101", *quiet, *common,
        "--max-num-seqs", "128", "--ec-transfer-config", ec("ec_consumer", "pd-0"),
    )
    assert encode.env == {**_ipc("encode-0"), "CUDA_VISIBLE_DEVICES": "0",
                          "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert pd.env == {**_ipc("pd-0"), "CUDA_VISIBLE_DEVICES": "1",
                      "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert (encode.start_after, pd.start_after) == ((), ())
    assert result.proxy.argv == (
        PY, "-m", "epdctl.proxy", "--host", "127.0.0.1", "--port", "8000", "--model", MODEL,
        "--encode", "http://127.0.0.1:8100", "--prefill-decode", "http://127.0.0.1:8101",
        "--encode-timeout", "60.0", "--prefill-timeout", "120.0", "--decode-timeout", "120.0",
        "--stream-idle-timeout", "60.0", "--max-inflight", "256",
        "--store-dir", f"/dev/shm/epdctl-{os.geteuid()}", "--namespace", ns,
    )
    assert result.proxy.env == {}
    assert result.proxy.health_url == "http://127.0.0.1:8000/health"


def test_1e1p1d_exact() -> None:
    result = demo_plan(load_topology(ROOT / "topologies" / "qwen2_5-vl-1e1p1d.yaml"))
    assert result.mode == "epd"
    encode, prefill, decode = result.instances
    assert [s.name for s in result.instances] == ["encode-0", "prefill-0", "decode-0"]
    assert [s.port for s in result.instances] == [8100, 8101, 8102]
    assert json_flag(prefill, "--kv-transfer-config") == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert json_flag(decode, "--kv-transfer-config") == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    # D consumes the encoder cache too, or it re-runs the vision tower.
    assert json_flag(decode, "--ec-transfer-config")["ec_role"] == "ec_consumer"
    assert json_flag(encode, "--kv-transfer-config") is None
    assert prefill.env == {**_ipc("prefill-0"), "UCX_TLS": "all", "UCX_NET_DEVICES": "all",
                           "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
                           "CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert decode.env == {**_ipc("decode-0"), "UCX_TLS": "all", "UCX_NET_DEVICES": "all",
                          "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601",
                          "CUDA_VISIBLE_DEVICES": "2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert (prefill.side_channel_port, decode.side_channel_port) == (5600, 5601)
    assert result.proxy.argv[7:15] == (
        "--model", MODEL, "--encode", "http://127.0.0.1:8100",
        "--prefill", "http://127.0.0.1:8101", "--decode", "http://127.0.0.1:8102",
    )


def test_2e2pd_tp2_exact() -> None:
    result = demo_plan(load_topology(ROOT / "topologies" / "qwen2_5-vl-2e2pd-tp2.yaml"))
    names = [s.name for s in result.instances]
    assert names == ["encode-0", "encode-1", "pd-0", "pd-1"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in result.instances] == ["0", "1", "2,3", "4,5"]
    for spec in result.instances[2:]:
        assert spec.argv[5:9] == ("--port", str(spec.port), "--tensor-parallel-size", "2")
        assert spec.start_after == ()
    assert "--tensor-parallel-size" not in result.instances[0].argv
    assert result.proxy.argv[9:17] == (
        "--encode", "http://127.0.0.1:8100", "--encode", "http://127.0.0.1:8101",
        "--prefill-decode", "http://127.0.0.1:8102", "--prefill-decode", "http://127.0.0.1:8103",
    )
    assert flag_value(result.proxy.argv, "--max-inflight") == "512"


def test_2e2pd_tp2_does_not_fit_four_gpus() -> None:
    topology = load_topology(ROOT / "topologies" / "qwen2_5-vl-2e2pd-tp2.yaml")
    with pytest.raises(PlanError) as info:
        demo_plan(topology, visible_gpus=GPUS[:4])
    line = "roles -> prefill_decode -> gpus: GPU {} does not exist; 4 GPUs are visible " \
        "(indices 0 to 3)"
    assert str(info.value) == f"{line.format(4)}\n{line.format(5)}"


def test_shared_gpu_exact() -> None:
    result = demo_plan(load_topology(ROOT / "topologies" / "qwen2_5-vl-shared-gpu.yaml"),
                   visible_gpus=["0"])
    encode, pd = result.instances
    assert encode.env["CUDA_VISIBLE_DEVICES"] == pd.env["CUDA_VISIBLE_DEVICES"] == "0"
    assert flag_value(encode.argv, "--gpu-memory-utilization") == "0.15"
    assert flag_value(pd.argv, "--gpu-memory-utilization") == "0.75"
    assert encode.start_after == ()
    assert pd.start_after == ("encode-0",)


def test_sharing_needs_fractions() -> None:
    topology = demo_topology({"encode": {"gpus": [0]}, "prefill_decode": {"gpus": [0]}})
    with pytest.raises(PlanError) as info:
        demo_plan(topology)
    assert str(info.value) == (
        "roles -> encode -> gpu_memory_utilization: required, because GPU 0 is shared by "
        "`encode-0`, `pd-0`\n"
        "roles -> prefill_decode -> gpu_memory_utilization: required, because GPU 0 is shared by "
        "`encode-0`, `pd-0`"
    )


def test_shared_fractions_must_fit() -> None:
    topology = demo_topology({
        "encode": {"gpus": [0], "gpu_memory_utilization": 0.4},
        "prefill_decode": {"gpus": [0], "gpu_memory_utilization": 0.7},
    })
    with pytest.raises(PlanError) as info:
        demo_plan(topology)
    assert str(info.value) == (
        "GPU 0 is shared by `encode-0`, `pd-0`: their gpu_memory_utilization adds up to 1.10, "
        "more than 1"
    )


def test_staggered_start_waits_for_every_gpu_neighbour() -> None:
    # pd-0 (TP 2 on GPUs 0+1) shares one GPU with each encoder: it waits for both.
    topology = demo_topology({
        "encode": {"replicas": 2, "gpus": [0, 1], "gpu_memory_utilization": 0.1},
        "prefill_decode": {"gpus": [0, 1], "tensor_parallel": 2, "gpu_memory_utilization": 0.8},
    })
    result = demo_plan(topology)
    assert [s.start_after for s in result.instances] == [(), (), ("encode-0", "encode-1")]


def test_more_gpus_than_the_machine_has() -> None:
    topology = demo_topology({"encode": {"gpus": [0]}, "prefill_decode": {"gpus": [3]}})
    with pytest.raises(PlanError) as info:
        demo_plan(topology, visible_gpus=["0", "1"])
    assert str(info.value) == (
        "roles -> prefill_decode -> gpus: GPU 3 does not exist; 2 GPUs are visible (indices 0 to 1)"
    )
    with pytest.raises(PlanError) as info:
        demo_plan(demo_topology({"encode": {}, "prefill_decode": {"tensor_parallel": 2}}),
              visible_gpus=["0", "1"])
    assert str(info.value) == (
        "roles -> prefill_decode -> gpus: needs 2 GPUs but only 1 is left unassigned; "
        "2 GPUs are visible (indices 0 to 1)"
    )
    with pytest.raises(PlanError, match="no GPU is visible"):
        demo_plan(demo_topology({"prefill_decode": {}}), visible_gpus=[])


def test_counts_pick_gpus_no_role_lists() -> None:
    topology = demo_topology({"encode": {"gpus": 1}, "prefill_decode": {"gpus": [0, 1],
                                                                    "tensor_parallel": 2}})
    result = demo_plan(topology)
    assert [s.gpus for s in result.instances] == [("2",), ("0", "1")]


def test_outer_visible_devices_are_written_as_given() -> None:
    topology = demo_topology({"encode": {"gpus": [0]}, "prefill_decode": {"gpus": [1]}})
    result = demo_plan(topology, visible_gpus=["GPU-aaaa", "GPU-bbbb"])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in result.instances] == ["GPU-aaaa", "GPU-bbbb"]


def test_ports_skip_the_proxy_and_each_other() -> None:
    topology = demo_topology(
        {"prefill": {"replicas": 2}, "decode": {}},
        proxy={"port": 9001}, ports={"base": 9000, "side_channel_base": 9001},
    )
    result = demo_plan(topology)
    assert [s.port for s in result.instances] == [9000, 9002, 9003]
    assert [s.side_channel_port for s in result.instances] == [9004, 9005, 9006]
    assert result.mode == "p-d"
    # No encoder: no EC config anywhere.
    assert all(flag_value(s.argv, "--ec-transfer-config") is None for s in result.instances)


def test_ports_past_65535() -> None:
    topology = demo_topology({"prefill_decode": {"replicas": 3}}, ports={"base": 65534})
    with pytest.raises(PlanError) as info:
        demo_plan(topology)
    assert str(info.value) == "ports -> base: 3 port(s) from 65534 do not fit below 65536"


def test_namespace_is_stable_and_tracks_what_changes_encoder_outputs() -> None:
    def ns(model: str = MODEL, args: tuple[str, ...] = (), vllm: str = VLLM,
           pd_args: tuple[str, ...] = ()) -> str:
        topology = parse_topology({"name": "demo", "model": model, "engine": {"args": list(args)},
                                   "roles": {"encode": {}, "prefill_decode": {
                                       "args": list(pd_args)}}})
        return demo_plan(topology, vllm_version=vllm).namespace

    base = ns()
    assert base == ns() and base.startswith("demo-") and len(base) == len("demo-") + 12
    assert ns(model="Qwen/Qwen2.5-VL-7B-Instruct") != base
    assert ns(args=("--dtype", "float16")) != base
    assert ns(args=("--mm-processor-kwargs", '{"max_pixels": 1000}')) != base
    assert ns(args=("--mm-processor-kwargs", '{"max_pixels": 1000}')) == \
        ns(args=("--mm-processor-kwargs={ \"max_pixels\":1000 }",))
    assert ns(vllm="0.33.1") != base
    assert ns(args=("--max-model-len", "4096")) == base
    assert ns(pd_args=("--max-num-seqs", "8")) == base


def test_namespace_of_a_local_model_follows_its_config(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    topology = parse_topology({"name": "demo", "model": str(model),
                               "roles": {"encode": {}, "prefill_decode": {}}})
    before = compute_namespace(topology, VLLM)
    (model / "config.json").write_text('{"a": 2}')
    assert compute_namespace(topology, VLLM) != before


def test_cpu_plan() -> None:
    topology = demo_topology({"encode": {}, "prefill": {}, "decode": {}}, device="cpu")
    result = demo_plan(topology, cpu_count=16, visible_gpus=[])
    encode, prefill, decode = result.instances
    assert encode.argv[:5] == (PY, "-m", "epdctl.engines.vllm_cpu", "serve", MODEL)
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in result.instances] == [
        "0-4", "5-9", "10-14"]
    assert all(s.gpus == () and "CUDA_VISIBLE_DEVICES" not in s.env for s in result.instances)
    assert json_flag(prefill, "--kv-transfer-config") == {
        "kv_connector": "ExampleConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(STATE / "kv")},
    }
    assert json_flag(decode, "--kv-transfer-config")["kv_role"] == "kv_consumer"
    assert json_flag(decode, "--ec-transfer-config")["ec_role"] == "ec_consumer"
    few = demo_plan(topology, cpu_count=2, visible_gpus=[])
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in few.instances] == ["0", "1", "0"]


def test_probes_stay_out_of_the_access_log_where_vllm_can_do_it() -> None:
    topology = demo_topology({"encode": {}, "prefill_decode": {}})
    for spec in demo_plan(topology).instances:
        assert flag_value(spec.argv, "--disable-access-log-for-endpoints") == "/health,/metrics"
        assert "--enable-log-requests" not in spec.argv
    for old in ("0.15.1", "0.9.2"):
        assert all("--disable-access-log-for-endpoints" not in s.argv
                   for s in demo_plan(topology, vllm_version=old).specs)
    assert has_quiet_probes("unknown") and has_quiet_probes("0.32.0+cpu")
    assert "--disable-access-log-for-endpoints" not in demo_plan(topology).proxy.argv


def test_log_requests_turns_on_vllm_request_logging_on_every_engine() -> None:
    topology = demo_topology({"encode": {}, "prefill": {}, "decode": {}},
                         engine={"log_requests": True, "args": ["--dtype", "half"]})
    result = demo_plan(topology)
    assert all(s.argv.count("--enable-log-requests") == 1 for s in result.instances)
    assert "--enable-log-requests" not in result.proxy.argv
    # The topology's own args come later, so they can still override epdctl's flags.
    encode = result.instances[0]
    assert encode.argv.index("--enable-log-requests") < encode.argv.index("--dtype")


def test_user_env_and_command_win() -> None:
    topology = demo_topology(
        {"prefill_decode": {"env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                    "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}}, device="cpu",
        engine={"command": ["python", "-m", "vllm.entrypoints.openai.api_server", "--model"]},
    )
    (pd,) = demo_plan(topology).instances
    assert pd.env == {**_ipc("pd-0"), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                      "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert pd.argv[:5] == ("python", "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL)


def test_a_cpu_instance_runs_its_worker_in_the_engine_core_process() -> None:
    """vLLM's `uni` executor on CPU (its platform keeps it only under this env): two
    processes an instance, not three, as a TP1 instance on a GPU. Not on GPUs."""
    topology = demo_topology({"encode": {}, "prefill_decode": {}}, device="cpu")
    assert all(s.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
               for s in demo_plan(topology).instances)
    gpu = demo_plan(demo_topology({"encode": {}, "prefill_decode": {}}))
    assert all("VLLM_ENABLE_V1_MULTIPROCESSING" not in s.env for s in gpu.instances)


def test_kv_extra_config_and_connector() -> None:
    topology = demo_topology({"prefill": {}, "decode": {}},
                         kv={"connector": "NixlConnector", "extra_config": {"backends": ["UCX"]}})
    prefill, _ = demo_plan(topology).instances
    assert json_flag(prefill, "--kv-transfer-config") == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }


def test_plan_spec_lookup_and_shell() -> None:
    result = demo_plan(demo_topology({"encode": {}, "prefill_decode": {}}))
    assert result.spec("pd-0").role == "prefill_decode"
    assert result.spec("proxy") is result.proxy
    with pytest.raises(KeyError):
        result.spec("decode-0")
    shell = result.spec("encode-0").shell()
    ipc_env = " ".join(f"{k}={v}" for k, v in _ipc("encode-0").items())
    assert shell.startswith(f"{ipc_env} CUDA_VISIBLE_DEVICES=0 CUDA_DEVICE_ORDER=PCI_BUS_ID "
                            "vllm serve ")
    assert "'--ec-transfer-config' " not in shell and "--ec-transfer-config '{" in shell


def test_plan_is_pure(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("plan() must not open sockets or start processes")

    monkeypatch.setattr(socket, "socket", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    topology = load_topology(ROOT / "topologies" / "qwen2_5-vl-1e1p1d.yaml")
    assert demo_plan(topology) == demo_plan(topology)
