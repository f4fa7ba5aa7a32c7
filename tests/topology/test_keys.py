"""proxy.api_key from the environment (`${VAR}`) or a 0600 file (`api_key_file`), read only
where a run starts; one line for every way it can be wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from epdctl.errors import TopologyError
from epdctl.launch.run import make_plan
from epdctl.topology.keys import env_name, has_api_key, literal_key, resolve_api_key
from epdctl.topology.model import load_topology, parse_topology

BASE = {"name": "demo", "model": "m/vl", "device": "cpu", "roles": {"prefill_decode": {}}}


def _proxy(**proxy: str):
    return parse_topology({**BASE, "proxy": proxy}).proxy


def _key_file(tmp_path: Path, text: str = "s3cret\n", mode: int = 0o600) -> Path:
    path = tmp_path / "proxy.key"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_literal_key_is_itself() -> None:
    proxy = _proxy(api_key="k3y")
    assert (resolve_api_key(proxy, {}), literal_key(proxy), env_name(proxy)) == ("k3y", "k3y",
                                                                                None)
    assert not has_api_key(_proxy()) and resolve_api_key(_proxy(), {}) is None


def test_a_key_from_the_environment() -> None:
    proxy = _proxy(api_key="${PROXY_KEY}")
    assert env_name(proxy) == "PROXY_KEY" and literal_key(proxy) is None
    assert resolve_api_key(proxy, {"PROXY_KEY": "from-env"}) == "from-env"
    with pytest.raises(TopologyError) as caught:
        resolve_api_key(proxy, {})
    assert str(caught.value) == ("proxy.api_key is ${PROXY_KEY}, which is not set here; "
                                 "`export PROXY_KEY=...` before epdctl, or use api_key_file")
    assert env_name(_proxy(api_key="$PROXY_KEY")) is None  # only the braced form refers


def test_a_key_from_a_private_file(tmp_path: Path) -> None:
    path = _key_file(tmp_path, "s3cret\nignored\n")
    proxy = _proxy(api_key_file=str(path))
    assert has_api_key(proxy) and literal_key(proxy) is None
    assert resolve_api_key(proxy) == "s3cret"


@pytest.mark.parametrize(("text", "mode", "message"), [
    ("s3cret", 0o644, "can be read by others (mode 0644); `chmod 600 "),
    ("s3cret", 0o640, "can be read by others (mode 0640)"),
    ("\n", 0o600, "is empty; put the key on its first line"),
])
def test_a_key_file_others_can_read_or_an_empty_one_is_refused(
    tmp_path: Path, text: str, mode: int, message: str,
) -> None:
    proxy = _proxy(api_key_file=str(_key_file(tmp_path, text, mode)))
    with pytest.raises(TopologyError, match="^proxy.api_key_file `.*` ") as caught:
        resolve_api_key(proxy)
    assert message in str(caught.value) and "s3cret" not in str(caught.value)


def test_a_link_to_a_key_file_is_not_followed(tmp_path: Path) -> None:
    link = tmp_path / "link.key"
    link.symlink_to(_key_file(tmp_path))
    with pytest.raises(TopologyError, match="symbolic links"):
        resolve_api_key(_proxy(api_key_file=str(link)))


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_key_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = _key_file(tmp_path)
    os.chown(path, 65534, 65534)
    with pytest.raises(TopologyError, match="belongs to uid 65534, not to you"):
        resolve_api_key(_proxy(api_key_file=str(path)))


def test_both_a_key_and_a_key_file_is_a_topology_error() -> None:
    with pytest.raises(TopologyError, match="give api_key or api_key_file, not both"):
        _proxy(api_key="k", api_key_file="/k")


def test_the_key_file_is_relative_to_the_topology(tmp_path: Path) -> None:
    _key_file(tmp_path)
    (tmp_path / "t.yaml").write_text("name: demo\nmodel: m/vl\ndevice: cpu\n"
                                     "proxy: {api_key_file: proxy.key}\n"
                                     "roles: {prefill_decode: {}}\n")
    topology = load_topology(tmp_path / "t.yaml")
    assert topology.proxy.api_key_file == tmp_path / "proxy.key"


def test_the_plan_of_a_run_has_the_key_and_shows_none(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROXY_KEY", "from-env-k3y")
    topology = parse_topology({**BASE, "proxy": {"api_key": "${PROXY_KEY}"}})
    plan = make_plan(topology, tmp_path / "demo")
    assert plan.proxy.env["EPDCTL_PROXY_API_KEY"] == "from-env-k3y"
    shown = "\n".join(s.shell() for s in plan.specs)
    assert "from-env-k3y" not in shown and "${PROXY_KEY}" not in shown
    assert plan.instances[0].env["VLLM_API_KEY"] not in shown


def test_a_dry_run_needs_no_key_and_a_start_does(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROXY_KEY", raising=False)
    topology = parse_topology({**BASE, "proxy": {"api_key": "${PROXY_KEY}"}})
    dry = make_plan(topology, tmp_path / "demo", is_dry_run=True)
    assert dry.proxy.env["EPDCTL_PROXY_API_KEY"] == "<proxy.api_key>"
    with pytest.raises(TopologyError, match=r"\$\{PROXY_KEY\}, which is not set here"):
        make_plan(topology, tmp_path / "demo")
