"""render_k8s() and the model: its volume in the pods, the Hugging Face cache, HF_TOKEN."""

from __future__ import annotations

from typing import Any

import pytest
from _k8s_schema import validate

from epdctl.cli.render import HF_TOKEN_KEY
from epdctl.errors import RenderError
from epdctl.render import K8sOptions, render_k8s
from epdctl.render import _volumes as volumes
from epdctl.topology.model import parse_topology

POD_PATH = {"name": "vl", "model": "/models/qwen2.5-vl-3b",
            "roles": {"encode": {}, "prefill_decode": {"replicas": 2}}}
HUB = {**POD_PATH, "model": "Qwen/Qwen2.5-VL-3B-Instruct"}


def _render(data: dict[str, Any], **options: Any):
    return render_k8s(parse_topology(data), "name: x\n", K8sOptions(**options))


def _engine_pods(rendering) -> list[dict]:
    return [o["spec"]["template"]["spec"] for o in rendering.objects
            if o["kind"] == "StatefulSet"]


def _proxy_pod(rendering) -> dict:
    (deployment,) = [o for o in rendering.objects if o["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]


def _volumes(pod: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod["volumes"]}


def _mounts(pod: dict) -> dict[str, dict]:
    return {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}


def _env(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["containers"][0]["env"]}


def test_a_pod_path_is_kept_as_written_and_its_pvc_mounted_read_only_at_its_directory() -> None:
    rendering = _render(POD_PATH, model_pvc="qwen-weights")
    pods = _engine_pods(rendering)
    assert len(pods) == 2
    for pod in pods:
        assert pod["containers"][0]["command"][2] == "/models/qwen2.5-vl-3b"
        assert _volumes(pod)["model"] == {
            "name": "model", "persistentVolumeClaim": {"claimName": "qwen-weights",
                                                       "readOnly": True}}
        assert _mounts(pod)["model"] == {"name": "model", "mountPath": "/models",
                                         "readOnly": True}
        # A path model downloads nothing: no cache volume, no HF_HOME.
        assert "hf-cache" not in _volumes(pod) and "HF_HOME" not in _env(pod)
    assert "model" not in _volumes(_proxy_pod(rendering))
    for obj in rendering.objects:
        validate(obj)
    assert any("PVC qwen-weights is mounted read-only at /models, so the model's files must "
               "be in qwen2.5-vl-3b/ on the volume" in n for n in rendering.notes)


def test_a_host_path_mounts_at_model_mount_and_must_be_a_directory() -> None:
    rendering = _render(POD_PATH, model_host_path="/mnt/qwen", model_mount="/models/qwen2.5-vl-3b")
    for pod in _engine_pods(rendering):
        assert _volumes(pod)["model"]["hostPath"] == {"path": "/mnt/qwen", "type": "Directory"}
        assert _mounts(pod)["model"]["mountPath"] == "/models/qwen2.5-vl-3b"
    assert any("at the volume's top level" in n for n in rendering.notes)


def test_the_volume_reaches_every_pod_of_a_leader_worker_set() -> None:
    data = {**POD_PATH, "roles": {"prefill_decode": {"tensor_parallel": 4}}}
    rendering = _render(data, model_pvc="w", gpus_per_node=2)
    (lws,) = [o for o in rendering.objects if o["kind"] == "LeaderWorkerSet"]
    group = lws["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        pod = group[key]["spec"]
        assert _mounts(pod)["model"]["mountPath"] == "/models"
        assert _volumes(pod)["model"]["persistentVolumeClaim"]["claimName"] == "w"
    validate(lws)


def test_a_pod_path_without_a_volume_renders_and_says_the_image_must_hold_it() -> None:
    rendering = _render(POD_PATH)
    for pod in _engine_pods(rendering):
        assert set(_volumes(pod)) == {"dshm"}
    assert any("the image must contain it" in n for n in rendering.notes)


def test_a_hub_model_gets_an_empty_dir_cache_at_hf_home_by_default() -> None:
    rendering = _render(HUB)
    for pod in _engine_pods(rendering):
        assert _volumes(pod)["hf-cache"] == {"name": "hf-cache", "emptyDir": {}}
        assert _mounts(pod)["hf-cache"] == {"name": "hf-cache", "mountPath": volumes.HF_HOME}
        assert _env(pod)["HF_HOME"] == {"name": "HF_HOME", "value": volumes.HF_HOME}
        assert "HF_TOKEN" not in _env(pod)
    assert "hf-cache" not in _volumes(_proxy_pod(rendering))
    assert any("emptyDir at HF_HOME=/root/.cache/huggingface" in n for n in rendering.notes)
    assert any("No HF_TOKEN" in n for n in rendering.notes)


def test_the_cache_pvc_and_the_token_secret_reach_the_engines_only() -> None:
    rendering = _render(HUB, hf_cache_pvc="hf", hf_token_secret="tok", hf_token_key="token")
    for pod in _engine_pods(rendering):
        assert _volumes(pod)["hf-cache"]["persistentVolumeClaim"] == {"claimName": "hf"}
        assert _env(pod)["HF_TOKEN"] == {
            "name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tok", "key": "token"}}}
    assert "HF_TOKEN" not in _env(_proxy_pod(rendering))
    for obj in rendering.objects:
        validate(obj)
    assert any("Secret tok, key token" in n for n in rendering.notes)
    assert not any("No HF_TOKEN" in n for n in rendering.notes)


@pytest.mark.parametrize(
    ("env", "mounted_at"),
    [({"HF_HOME": "/data/hf"}, "/data/hf"),
     ({"HF_HOME": "/data/hf", "HF_HUB_CACHE": "/data/hub"}, "/data/hub")],
)
def test_a_cache_dir_the_engine_env_names_is_where_the_cache_is_mounted(env, mounted_at) -> None:
    rendering = _render({**HUB, "engine": {"env": env}})
    for pod in _engine_pods(rendering):
        assert _mounts(pod)["hf-cache"]["mountPath"] == mounted_at
        names = [e["name"] for e in pod["containers"][0]["env"]]
        assert len(names) == len(set(names))  # HF_HOME stays the topology's, once
        assert _env(pod)["HF_HOME"]["value"] == "/data/hf"


def test_offline_with_an_empty_dir_cache_is_pointed_out() -> None:
    rendering = _render({**HUB, "engine": {"env": {"HF_HUB_OFFLINE": "1"}}})
    assert any("HF_HUB_OFFLINE" in n for n in rendering.notes)
    rendering = _render({**HUB, "engine": {"env": {"HF_HUB_OFFLINE": "1"}}}, hf_cache_pvc="hf")
    assert not any("HF_HUB_OFFLINE" in n for n in rendering.notes)


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        ("./weights", {}, "model: `./weights` is a path on this machine, which pods cannot see"),
        ("~/.cache/m", {}, "model: `~/.cache/m` is a path on this machine"),
        ("..", {"model_pvc": "w"}, "model: `..` is a path on this machine"),
        ("/models/m", {"model_pvc": "w", "model_host_path": "/m"},
         "--model-pvc and --model-host-path: pick one"),
        ("/models/m", {"model_mount": "/models"}, "--model-mount needs --model-pvc"),
        ("Qwen/Qwen2.5-VL-3B-Instruct", {"model_host_path": "/m"},
         "--model-host-path: model `Qwen/Qwen2.5-VL-3B-Instruct` is a Hugging Face id"),
        ("/models/m", {"model_pvc": "w", "model_mount": "/weights"},
         "--model-mount /weights: model `/models/m` is not inside it"),
        ("/models-x/m", {"model_pvc": "w", "model_mount": "/models"},
         "--model-mount /models: model `/models-x/m` is not inside it"),
        ("/m", {"model_pvc": "w"}, "model: `/m`: the model volume cannot be mounted at /"),
    ],
)
def test_model_choices_pods_could_not_use_are_refused(model, options, message) -> None:
    with pytest.raises(RenderError) as info:
        _render({**POD_PATH, "model": model}, **options)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("env", "options", "message"),
    [
        ({"engine": {"env": {"HF_HOME": "hf"}}}, {},
         "engine -> env: HF_HOME must be an absolute path"),
        ({"engine": {"env": {"HF_TOKEN": "hf_x"}}}, {"hf_token_secret": "tok"},
         "engine -> env: HF_TOKEN is set here and by --hf-token-secret"),
        ({"roles": {"prefill_decode": {"env": {"HF_TOKEN": "hf_x"}}}}, {"hf_token_secret": "t"},
         "roles -> prefill_decode -> env: HF_TOKEN is set here"),
    ],
)
def test_engine_env_that_clashes_with_the_volumes_is_refused(env, options, message) -> None:
    with pytest.raises(RenderError) as info:
        _render({**HUB, **env}, **options)
    assert str(info.value).startswith(message)


def test_the_cli_default_secret_key_is_the_renderers() -> None:
    assert HF_TOKEN_KEY == K8sOptions().hf_token_key
