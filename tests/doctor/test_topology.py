"""The model check (local path, Hugging Face cache, offline mode) and known-bad settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from epdctl.doctor import Check
from epdctl.doctor._topology import check_combinations, check_model, hf_hub_cache
from epdctl.launch.plan import plan
from tests.doctor.fakes import topology

MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
EPD = {"encode": {"gpus": [0]}, "prefill": {"gpus": [1]}, "decode": {"gpus": [2]}}


def test_local_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert check_model(topology(model=str(tmp_path)), {}, None) == Check(
        "model", "ok", f"local model {tmp_path}")
    empty = tmp_path / "empty"
    empty.mkdir()
    check = check_model(topology(model=str(empty)), {}, None)
    assert (check.status, check.detail) == (
        "fail", f"{empty} has no config.json, so it is not a Hugging Face model directory")


def test_local_model_missing(tmp_path: Path) -> None:
    check = check_model(topology(model=str(tmp_path / "nope")), {}, "/venv/bin/python")
    assert check == Check("model", "fail", f"local path {tmp_path}/nope does not exist",
                          "correct `model:` in the topology, or put the model there")


@pytest.mark.parametrize("name", ["llava", "qwen2vl-0123abcd"])
def test_missing_tiny_model_names_its_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            name: str) -> None:
    monkeypatch.setenv("EPDCTL_TINY_MODEL_DIR", str(tmp_path))
    check = check_model(topology(model=str(tmp_path / name)), {}, "/venv/bin/python")
    kind = name.partition("-")[0]
    assert check.fix == f"build it: `/venv/bin/python -m epdctl.dev.tiny_models {kind}`"


def _cache(hub: Path, model: str = MODEL, commit: str = "abc123", ref: str = "main") -> None:
    repo = hub / f"models--{model.replace('/', '--')}"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / ref).write_text(commit)


def test_hub_model_cached(tmp_path: Path) -> None:
    _cache(tmp_path)
    check = check_model(topology(model=MODEL), {"HF_HUB_CACHE": str(tmp_path)}, None)
    snapshot = tmp_path / "models--Qwen--Qwen2.5-VL-3B-Instruct" / "snapshots" / "abc123"
    assert check == Check("model", "ok", f"{MODEL} is in the Hugging Face cache ({snapshot})")
    pinned = topology(model=MODEL, engine={"args": ["--revision", "v2"]})
    assert check_model(pinned, {"HF_HUB_CACHE": str(tmp_path)}, None).status == "warn"
    (tmp_path / "models--Qwen--Qwen2.5-VL-3B-Instruct" / "refs" / "v2").write_text("abc123")
    assert check_model(pinned, {"HF_HUB_CACHE": str(tmp_path)}, None).status == "ok"


def test_hub_model_not_cached(tmp_path: Path) -> None:
    env = {"HF_HOME": str(tmp_path)}
    check = check_model(topology(model=MODEL), env, None)
    assert check == Check(
        "model", "warn", f"{MODEL} is not in the Hugging Face cache ({tmp_path}/hub): the "
        "first `up` downloads it",
        f"download it ahead: `hf download {MODEL}` (a gated model needs HF_TOKEN)")
    offline = check_model(topology(model=MODEL), {**env, "HF_HUB_OFFLINE": "1"}, None)
    assert offline.status == "fail"
    assert offline.detail.endswith("and HF_HUB_OFFLINE is set")


def test_hf_hub_cache_follows_huggingface_rules(tmp_path: Path) -> None:
    assert hf_hub_cache({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == Path("/a")
    assert hf_hub_cache({"HF_HOME": "/b", "XDG_CACHE_HOME": "/c"}) == Path("/b/hub")
    assert hf_hub_cache({"XDG_CACHE_HOME": "/c"}) == Path("/c/huggingface/hub")
    assert hf_hub_cache({}) == Path.home() / ".cache" / "huggingface" / "hub"


def _combos(tmp_path: Path, **fields: object) -> list[Check]:
    topo = topology(**fields)
    gpus = [str(i) for i in range(3)]
    return check_combinations(topo, plan(topo, tmp_path, visible_gpus=gpus))


def test_no_known_bad_combination(tmp_path: Path) -> None:
    assert _combos(tmp_path, roles=EPD) == [Check("combination", "ok",
                                                  "no known-bad combination")]


def test_mooncake_kv_needs_another_router(tmp_path: Path) -> None:
    [check] = _combos(tmp_path, roles=EPD, kv={"connector": "MooncakeConnector"})
    assert check.status == "fail" and "MooncakeConnector" in check.detail
    assert check.fix == "use NixlConnector (the default on `device: cuda`)"


def test_kv_section_without_a_split_is_ignored(tmp_path: Path) -> None:
    [check] = _combos(tmp_path, kv={"connector": "NixlConnector"})
    assert check == Check("combination", "warn", "kv.connector NixlConnector is ignored: the "
                          "roles (encode, prefill_decode) have no prefill/decode split",
                          "remove `kv:`, or use prefill + decode roles")


def test_open_proxy_without_api_key(tmp_path: Path) -> None:
    [check] = _combos(tmp_path, proxy={"host": "0.0.0.0"})
    assert check.status == "warn" and check.fix == "set proxy.api_key, or proxy.host: 127.0.0.1"
    assert _combos(tmp_path, proxy={"host": "0.0.0.0", "api_key": "k"})[0].status == "ok"


def test_qwen3_5_over_nixl_needs_the_ds_layout(tmp_path: Path) -> None:
    [check] = _combos(tmp_path, model="Qwen/Qwen3.5-35B-A3B", roles=EPD)
    assert check.detail == ("Qwen3.5 over NIXL needs VLLM_SSM_CONV_STATE_LAYOUT=DS on P and "
                            "D; prefill-0, decode-0 lack it")
    fixed = _combos(tmp_path, model="Qwen/Qwen3.5-35B-A3B", roles=EPD,
                    engine={"env": {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}})
    assert fixed[0].status == "ok"
