"""`epdctl render k8s` through CliRunner: exit codes, stdout vs stderr, -o DIR."""

from __future__ import annotations

from pathlib import Path

import yaml
from _k8s_schema import validate

TOPOLOGY = """\
name: demo
model: Qwen/Qwen2.5-VL-3B-Instruct
roles:
  encode: {}
  prefill_decode: {replicas: 2}
"""


def _write(tmp_path: Path, text: str = TOPOLOGY) -> Path:
    path = tmp_path / "demo.yaml"
    path.write_text(text)
    return path


def test_stdout_is_one_valid_stream_and_notes_go_to_stderr(epdctl, tmp_path: Path) -> None:
    result = epdctl("render", "k8s", str(_write(tmp_path)))
    assert result.exit_code == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ConfigMap", "Service", "StatefulSet", "Service", "StatefulSet",
                     "Service", "Deployment"]
    for doc in docs:
        validate(doc)
    assert docs[0]["data"]["topology.yaml"] == TOPOLOGY
    assert result.stdout.startswith("# Rendered by `epdctl render k8s` from demo.yaml.\n")
    assert "note: The proxy runs --ec-protocol mooncake: it picks the PD pod first" in result.stderr
    assert "note:" not in result.stdout


def test_output_dir_gets_one_file_per_object_and_loses_stale_ones(epdctl, tmp_path: Path) -> None:
    out = tmp_path / "manifests"
    out.mkdir()
    (out / "keep.yaml").write_text("kind: Mine\n")
    (out / "99-statefulset-old.yaml").write_text("# Rendered by `epdctl render k8s` from x\n")
    result = epdctl("render", "k8s", str(_write(tmp_path)), "-o", str(out),
                    "--namespace", "epd")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    assert "wrote 7 files to" in result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "00-configmap-demo-topology.yaml", "01-service-demo-encode.yaml",
        "02-statefulset-demo-encode.yaml", "03-service-demo-pd.yaml",
        "04-statefulset-demo-pd.yaml", "05-service-demo-proxy.yaml",
        "06-deployment-demo-proxy.yaml", "keep.yaml",
    ]
    for path in out.glob("0*.yaml"):
        (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert doc["metadata"]["namespace"] == "epd"
        validate(doc)


def test_bad_topology_exits_1_with_one_message(epdctl, tmp_path: Path) -> None:
    result = epdctl("render", "k8s", str(_write(tmp_path, "name: demo\nmodel: m\nroles: {}\n")))
    assert result.exit_code == 1
    assert result.stdout == ""
    # The wording belongs to load_topology (tested there); here: one message, no traceback.
    assert result.stderr.startswith(f"Error: {tmp_path / 'demo.yaml'}: invalid topology\n  roles")
    assert "Traceback" not in result.stderr


def test_missing_file_exits_1(epdctl, tmp_path: Path) -> None:
    result = epdctl("render", "k8s", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 1
    assert result.stderr == f"Error: {tmp_path / 'nope.yaml'}: no such file\n"


def test_cpu_topology_is_refused(epdctl, tmp_path: Path) -> None:
    text = TOPOLOGY.replace("roles:", "device: cpu\nroles:")
    result = epdctl("render", "k8s", str(_write(tmp_path, text)))
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: `demo` is a `device: cpu` topology")
    assert result.stderr.count("\n") == 1


def test_usage_errors_exit_2(epdctl, tmp_path: Path) -> None:
    path = str(_write(tmp_path))
    assert epdctl("render", "k8s", path, "--namespace", "Bad_NS").exit_code == 2
    assert epdctl("render", "k8s", path, "--gpus-per-node", "0").exit_code == 2
    assert epdctl("render", "k8s").exit_code == 2


def test_image_and_connector_options_reach_the_manifests(epdctl, tmp_path: Path) -> None:
    result = epdctl("render", "k8s", str(_write(tmp_path)), "--image", "reg/epd:1",
                    "--ec-connector", "ECCPUConnector")
    assert result.exit_code == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    images = {c["image"] for d in docs if d["kind"] in ("StatefulSet", "Deployment")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"reg/epd:1"}
    assert "ECCPUConnector" in result.stdout and "ECMooncakeConnector" not in result.stdout


def test_unwritable_output_dir_exits_1(epdctl, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = epdctl("render", "k8s", str(_write(tmp_path)), "-o", str(blocker / "sub"))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {blocker / 'sub'}: cannot write manifests: ")


def _engine_containers(stdout: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(stdout) if d]
    for doc in docs:
        validate(doc)
    return [c for d in docs if d["kind"] == "StatefulSet"
            for c in d["spec"]["template"]["spec"]["containers"]]


def test_a_model_path_in_the_pods_need_not_exist_here(epdctl, tmp_path: Path) -> None:
    model = "/models/not-on-this-machine/qwen2.5-vl-3b"
    assert not Path(model).exists()
    text = TOPOLOGY.replace("Qwen/Qwen2.5-VL-3B-Instruct", model)
    result = epdctl("render", "k8s", str(_write(tmp_path, text)), "--model-pvc", "weights")
    assert result.exit_code == 0, result.stderr
    containers = _engine_containers(result.stdout)
    assert len(containers) == 2
    for container in containers:
        assert model in container["command"]
        assert {"name": "model", "mountPath": "/models/not-on-this-machine",
                "readOnly": True} in container["volumeMounts"]
    assert "note: model: /models/not-on-this-machine/qwen2.5-vl-3b is a path in the engine " \
           "pods: PVC weights" in result.stderr


def test_a_path_on_this_machine_is_refused_in_one_line(epdctl, tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()  # it exists here, and still means nothing in a pod
    text = TOPOLOGY.replace("Qwen/Qwen2.5-VL-3B-Instruct", "./weights")
    result = epdctl("render", "k8s", str(_write(tmp_path, text)))
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("Error: model: `./weights` is a path on this machine, "
                                    "which pods cannot see: write the model's absolute path")
    assert result.stderr.count("\n") == 1


def test_hf_token_secret_key_defaults_to_hf_token(epdctl, tmp_path: Path) -> None:
    path = str(_write(tmp_path))
    for arg, key in (("hf", "HF_TOKEN"), ("hf:token", "token")):
        result = epdctl("render", "k8s", path, "--hf-token-secret", arg)
        assert result.exit_code == 0, result.stderr
        for container in _engine_containers(result.stdout):
            (token,) = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
            assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": key}


def test_volume_option_usage_errors_exit_2(epdctl, tmp_path: Path) -> None:
    path = str(_write(tmp_path))
    for args in (("--model-pvc", "Bad_Name"), ("--hf-cache-pvc", "-x"),
                 ("--model-host-path", "models"), ("--model-mount", "m"),
                 ("--hf-token-secret", "tok:bad key"), ("--hf-token-secret", "Tok")):
        result = epdctl("render", "k8s", path, *args)
        assert result.exit_code == 2, args
        assert f"Invalid value for '{args[0]}'" in result.stderr, args
