"""The state dir and the logs are private to their user (0700 / 0600), and a state dir that
is not the user's alone is refused."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from epdctl.errors import StateError
from epdctl.launch.detached import spawn_detached
from epdctl.launch.processes import spawn
from epdctl.launch.spec import LaunchSpec
from epdctl.launch.state import StateDir
from tests.launch.test_state import make_state


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_state_dir_state_json_lock_and_logs_are_private(tmp_path: Path) -> None:
    sdir = StateDir(tmp_path / "root" / "demo")
    sdir.write(make_state())
    assert mode(tmp_path / "root") == mode(sdir.path) == 0o700
    assert mode(sdir.state_file) == 0o600
    fd = sdir.lock()
    assert mode(sdir.lock_file) == 0o600
    try:
        # The detached supervisor's own log (it exits at once: the state names no real run).
        popen = spawn_detached(sdir, fd, 1.0)
        assert popen.wait(timeout=60) is not None
    finally:
        sdir.unlock()
    assert mode(sdir.logs_dir) == 0o700 and mode(sdir.logs_dir / "supervisor.log") == 0o600
    spec = LaunchSpec(name="x", role="encode", command=(sys.executable, "-c", "print(1)"),
                      port=1, log_path=sdir.logs_dir / "x.log")
    proc = spawn(spec, sdir.path)
    assert proc.popen is not None and proc.popen.wait(timeout=60) == 0
    assert mode(spec.log_path) == 0o600 and spec.log_path.read_text().endswith("1\n")


def test_an_older_state_dir_is_made_private(tmp_path: Path) -> None:
    sdir = StateDir(tmp_path / "demo")
    sdir.path.mkdir(mode=0o755)
    os.chmod(sdir.path, 0o755)
    sdir.write(make_state())
    assert mode(sdir.path) == 0o700


@pytest.mark.parametrize("how", ["world-writable", "other-owner", "other-uid", "symlink"])
def test_a_state_dir_that_is_not_the_users_alone_is_refused(
        tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sdir = StateDir(tmp_path / "demo")
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir()
        sdir.path.symlink_to(tmp_path / "elsewhere")
        why = "it is a symbolic link"
    elif how == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("chown to another uid needs root")
        sdir.path.mkdir()
        os.chown(sdir.path, 65534, 65534)
        why = "it belongs to uid 65534"
    elif how == "other-uid":  # the chown refusal without root: epdctl runs as another uid
        sdir.path.mkdir()
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: 65534 if me != 65534 else 65533)
        why = f"it belongs to uid {me}"
    else:
        sdir.path.mkdir()
        os.chmod(sdir.path, 0o1777)  # own_dir leaves it: group/others may have put files in it
        why = "group or others can write to it (mode 1777)"
    for call in (lambda: sdir.write(make_state()), sdir.lock):
        with pytest.raises(StateError) as err:
            call()
        assert str(err.value).startswith(f"refusing the state dir `{sdir.path}`: {why}")
        assert str(err.value).endswith("or pick another --state-dir")
    assert not sdir.state_file.exists()
