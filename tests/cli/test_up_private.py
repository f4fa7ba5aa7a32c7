"""`up` refuses a store root or namespace dir that is not the user's alone, before anything
starts, in one line; the store it makes itself is private."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from epdctl.launch.run import prepare

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("which", ["root", "namespace"])
def test_up_refuses_a_world_writable_store(epdctl, fake_topology, state_root,
                                           which: str) -> None:
    topo = fake_topology()
    ns_dir = prepare(topo, state_root, is_dry_run=True).plan.store_dir
    bad = ns_dir.parent if which == "root" else ns_dir
    ns_dir.parent.mkdir(mode=0o700)
    bad.mkdir(mode=0o700, exist_ok=True)
    os.chmod(bad, 0o777)
    result = epdctl("up", str(topo), "-d", "--timeout", "20")
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: refusing the EC store `{bad}`: group or others can write to it (mode 0777); "
        f"remove it (epdctl creates it with mode 0700), or `chmod go= {bad}` if you trust "
        "what is in it, or set cache.dir to a directory of your own\n")
    assert not (state_root / "fake" / "state.json").exists()
    assert not (state_root / "fake" / "logs").exists()  # nothing was started


def test_up_makes_the_store_private_before_the_engines_start(epdctl, fake_topology,
                                                              state_root: Path) -> None:
    topo = fake_topology()
    result = epdctl("up", str(topo), "-d", "--timeout", "20")
    assert result.exit_code == 0, result.stderr
    try:
        ns_dir = prepare(topo, state_root, is_dry_run=True).plan.store_dir
        for path in (ns_dir.parent, ns_dir, state_root / "fake", state_root / "fake" / "logs"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
        for path in (state_root / "fake").glob("**/*"):
            if path.is_file():
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    finally:
        assert epdctl("down").exit_code == 0
