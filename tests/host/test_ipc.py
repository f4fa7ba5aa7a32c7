"""Engines' IPC sockets go to a private directory of the run, removed with the instance."""

from __future__ import annotations

import getpass
import json
import os
import signal
import stat
import tempfile
from pathlib import Path

import pytest

from epdctl.host import ipc
from tests.cli.test_down import kill_supervisor, up
from tests.conftest import is_running, run_pids
from tests.planning import demo_plan, demo_topology
from tests.reliability.helpers import wait_for


def test_rpc_dir_is_under_the_state_dir_when_a_socket_path_fits() -> None:
    state = Path("/home/someone/.local/state/epdctl/demo")
    assert ipc.rpc_dir(state, "pd-0") == state / "ipc" / "pd-0"
    assert ipc.fits(state / "ipc" / "pd-0")


def test_rpc_dir_falls_back_to_the_runtime_dir_then_the_temp_dir() -> None:
    state = Path("/" + "d" * 60) / "demo"  # 70 bytes with ipc/pd-0: no room for a uuid
    assert not ipc.fits(state / "ipc" / "pd-0")
    got = ipc.rpc_dir(state, "pd-0", {"XDG_RUNTIME_DIR": "/run/user/1000"})
    assert got.parent == Path("/run/user/1000")
    assert got.name.startswith("epdctl-") and got.name.endswith("-pd-0")
    assert ipc.fits(got)
    # Another run (state dir) gets another directory; the same run the same one.
    assert ipc.rpc_dir(state.with_name("other"), "pd-0", {"XDG_RUNTIME_DIR": "/r"}) != got
    assert ipc.rpc_dir(state, "pd-0", {"XDG_RUNTIME_DIR": "/r"}).name == got.name
    too_long = {"XDG_RUNTIME_DIR": "/" + "r" * 80}
    assert ipc.rpc_dir(state, "pd-0", too_long).parent == Path(tempfile.gettempdir())
    assert ipc.rpc_dir(state, "pd-0", {}).parent == Path(tempfile.gettempdir())


def test_plan_gives_each_engine_its_own_and_the_users_value_wins() -> None:
    result = demo_plan(demo_topology({"encode": {}, "prefill_decode": {}}))
    assert {s.name: s.env.get(ipc.RPC_ENV) for s in result.specs} == {
        "encode-0": "/state/demo/ipc/encode-0", "pd-0": "/state/demo/ipc/pd-0", "proxy": None}
    assert [ipc.ours(s.env, result.state_dir, s.name) for s in result.instances] == [
        Path("/state/demo/ipc/encode-0"), Path("/state/demo/ipc/pd-0")]
    assert [s.env["TMPDIR"] for s in result.instances] == [
        "/state/demo/ipc/encode-0", "/state/demo/ipc/pd-0"]  # vLLM's temp files go there too
    inductor = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    assert {s.env["TORCHINDUCTOR_CACHE_DIR"] for s in result.instances} == {str(inductor)}
    own = demo_plan(demo_topology({"prefill_decode": {"env": {ipc.RPC_ENV: "/srv/ipc"}}}))
    (pd,) = own.instances
    assert pd.env[ipc.RPC_ENV] == "/srv/ipc"
    assert ipc.ours(pd.env, own.state_dir, pd.name) is None  # never made nor removed by us


def test_make_is_private_and_remove_takes_the_sockets() -> None:

    # pytest's tmp_path is too long for a socket path: a short directory of our own.
    with tempfile.TemporaryDirectory(prefix="epdctl-test-") as top:
        _make_and_remove(Path(top) / "state" / "ipc" / "pd-0")


def _make_and_remove(path: Path) -> None:
    import socket

    ipc.make(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path / "00000000-0000-0000-0000-000000000000"))
    ipc.remove(path)
    assert not path.parent.exists()  # the last instance's: `ipc/` goes too
    ipc.remove(path)  # gone already: nothing to do


def test_make_refuses_a_planted_link(tmp_path: Path) -> None:
    from epdctl.errors import StartupError

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ipc").mkdir()
    (tmp_path / "ipc" / "pd-0").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StartupError, match="symbolic link"):
        ipc.make(tmp_path / "ipc" / "pd-0")


def _ipc_dirs(state_root: Path) -> dict[str, Path]:
    state = json.loads((state_root / "fake" / "state.json").read_text())
    return {s["name"]: Path(s["env"][ipc.RPC_ENV]) for s in state["specs"]
            if ipc.RPC_ENV in s["env"]}


@pytest.mark.timeout(90)
def test_down_after_sigkills_leaves_no_socket(epdctl, fake_topology, state_root) -> None:
    up(epdctl, fake_topology(pd_args=("--ipc-socket",), encode_args=("--ipc-socket",)))
    dirs = _ipc_dirs(state_root)
    assert set(dirs) == {"encode-0", "pd-0"}
    for path in dirs.values():
        assert ipc.fits(path) and stat.S_IMODE(path.stat().st_mode) == 0o700
        kinds = sorted((p.name.startswith("vllm_dist_"), stat.S_ISSOCK(p.lstat().st_mode))
                       for p in path.iterdir())
        assert kinds == [(False, True), (True, False)]  # the socket, the temp file
    pids = run_pids(state_root)
    kill_supervisor(state_root)
    for name in dirs:
        os.killpg(pids[name], signal.SIGKILL)
    assert wait_for(lambda: not any(is_running(pids[n]) for n in dirs), timeout_s=15)
    assert all(any(p.iterdir()) for p in dirs.values())  # nobody unlinks a socket on SIGKILL
    assert epdctl("down").exit_code == 0
    assert [p for p in dirs.values() if p.exists()] == []
    assert not (state_root / "fake" / "ipc").exists()


@pytest.mark.timeout(90)
def test_supervisor_removes_the_directory_of_an_instance_that_died(
    epdctl, fake_topology, state_root
) -> None:
    up(epdctl, fake_topology(pd_args=("--ipc-socket",)))
    pd = _ipc_dirs(state_root)["pd-0"]
    assert any(pd.iterdir())
    pids = run_pids(state_root)
    os.killpg(pids["pd-0"], signal.SIGKILL)
    # The supervisor sees pd-0 die, stops the run (restart policy: never), cleans up, exits.
    assert wait_for(lambda: not is_running(pids["supervisor"]), timeout_s=30)
    assert not pd.exists()
    result = epdctl("down")
    assert result.exit_code == 0 and "Nothing of fake was running" in result.output


def test_remove_all_finds_the_fallback_directories_without_the_state() -> None:
    with tempfile.TemporaryDirectory(prefix="epdctl-test-") as runtime:
        state = Path("/" + "d" * 60) / "demo"
        env = {"XDG_RUNTIME_DIR": runtime}
        made = [ipc.rpc_dir(state, name, env) for name in ("encode-0", "pd-0")]
        other = ipc.rpc_dir(state.with_name("other"), "pd-0", env)
        for path in (*made, other):
            assert path.parent == Path(runtime)
            path.mkdir()
        ipc.remove_all(state, env)
        assert [p for p in made if p.exists()] == [] and other.exists()  # another run's stays


@pytest.mark.timeout(90)
def test_down_force_without_state_removes_them_too(epdctl, fake_topology, state_root) -> None:
    up(epdctl, fake_topology(pd_args=("--ipc-socket",)))
    dirs = _ipc_dirs(state_root)
    (state_root / "fake" / "state.json").unlink()
    assert epdctl("down", "--force", "--name", "fake").exit_code == 0
    assert [p for p in dirs.values() if p.exists()] == []
