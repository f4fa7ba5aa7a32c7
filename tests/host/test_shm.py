"""Shared-memory files of a SIGKILLed instance are unlinked by the supervisor or by `down`."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from epdctl.host.shm import mapped_files, release
from tests.cli.test_down import kill_supervisor, up
from tests.conftest import is_running, run_pids

pytestmark = pytest.mark.timeout(90)


def _fake_shm_file(state_root: Path) -> Path:
    state = json.loads((state_root / "fake" / "state.json").read_text())
    files = state["records"]["pd-0"]["shm_files"]
    assert files == [f"/dev/shm/epdctl-test-fake-{state['records']['pd-0']['pid']}"]
    return Path(files[0])


@pytest.fixture
def shm_leftovers():
    before = set(Path("/dev/shm").glob("epdctl-test-fake-*"))
    yield
    release(str(p) for p in set(Path("/dev/shm").glob("epdctl-test-fake-*")) - before)


def _kill_group(state_root: Path, name: str) -> None:
    os.killpg(run_pids(state_root)[name], signal.SIGKILL)


def _wait_gone(path: Path, timeout_s: float = 15.0) -> bool:
    end = time.monotonic() + timeout_s
    while path.exists() and time.monotonic() < end:
        time.sleep(0.1)
    return not path.exists()


def test_supervisor_unlinks_the_files_of_an_instance_killed_with_sigkill(
    epdctl, fake_topology, state_root, shm_leftovers
) -> None:
    up(epdctl, fake_topology(pd_args=("--shm-file",)))
    path = _fake_shm_file(state_root)
    assert path.exists()
    _kill_group(state_root, "pd-0")
    assert _wait_gone(path)  # the supervisor saw pd-0 die and stopped the run


def test_down_unlinks_them_when_the_supervisor_is_gone_too(
    epdctl, fake_topology, state_root, shm_leftovers
) -> None:
    up(epdctl, fake_topology(pd_args=("--shm-file",)))
    path = _fake_shm_file(state_root)
    kill_supervisor(state_root)
    _kill_group(state_root, "pd-0")
    pid = run_pids(state_root)["pd-0"]
    end = time.monotonic() + 15
    while is_running(pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not is_running(pid)
    assert path.exists()  # nobody unlinks it on a SIGKILL
    assert epdctl("down").exit_code == 0
    assert not path.exists()


def _semaphores() -> set[Path]:
    return set(Path("/dev/shm").glob("sem.*"))


def test_down_unlinks_the_named_semaphore_of_a_sigkilled_group(
    epdctl, fake_topology, state_root
) -> None:
    """sem_open maps a semaphore under a temporary name it then unlinks, so only the inode
    ties `sem.mp-*` to the group: the supervisor records it, `down` removes it. The one
    semaphore is the one pd-0 names in its log (other tests' engines may make theirs in
    /dev/shm meanwhile)."""
    sem: Path | None = None
    try:
        up(epdctl, fake_topology(pd_args=("--semaphore",)))
        state = json.loads((state_root / "fake" / "state.json").read_text())
        sem = _logged_semaphore(state_root)
        assert sem.exists() and sem.name.startswith("sem.mp-"), sem
        assert state["records"]["pd-0"]["shm_files"] == [str(sem)]
        kill_supervisor(state_root)
        _kill_group(state_root, "pd-0")  # its resource tracker goes too: nobody unlinks it
        pid = run_pids(state_root)["pd-0"]
        end = time.monotonic() + 15
        while is_running(pid) and time.monotonic() < end:
            time.sleep(0.05)
        assert not is_running(pid)
        assert sem.exists()
        assert epdctl("down").exit_code == 0
        assert not sem.exists()
    finally:
        if sem is not None:
            release([str(sem)])


def _logged_semaphore(state_root: Path) -> Path:
    """The semaphore pd-0 (tests/fake_server.py --semaphore) says it made."""
    log = (state_root / "fake" / "logs" / "pd-0.log").read_text()
    name = next(line.split()[-1] for line in log.splitlines()
                if line.startswith("fake: semaphore "))
    return Path("/dev/shm") / f"sem.{name.lstrip('/')}"


def test_mapped_files_names_a_semaphore_by_its_inode() -> None:
    import multiprocessing

    before = _semaphores()
    lock = multiprocessing.get_context("spawn").Lock()
    name = f"/dev/shm/sem.{lock._semlock.name.lstrip('/')}"  # type: ignore[attr-defined]
    # Its own, new file (other tests' engines may make theirs meanwhile).
    assert name in {str(p) for p in _semaphores() - before}
    assert name in mapped_files(os.getpgid(0))
    assert release([name]) == []  # this process maps it
    assert Path(name).exists()
    del lock  # its finalizer unlinks it (and tells the resource tracker)
    assert not Path(name).exists()


def test_release_keeps_files_still_mapped(tmp_path: Path) -> None:
    import mmap

    path = Path(f"/dev/shm/epdctl-test-release-{os.getpid()}")
    with open(path, "wb+") as f:
        f.truncate(4096)
        mapping = mmap.mmap(f.fileno(), 4096)
    try:
        assert str(path) in mapped_files(os.getpgid(0))
        assert release([str(path), "/etc/passwd"]) == []  # mapped here; not in /dev/shm
        assert path.exists()
    finally:
        mapping.close()
    assert release([str(path)]) == [str(path)]
    assert not path.exists()
