"""A second local user, tried for real: the attacker is a child process that drops to uid
65534 (the suite runs as root on CI; elsewhere those tests skip and the rule is shown with
a store of a fake owner). It cannot list or read the store `up` made, and a default store
root it created first (any mode) neither stops `up` nor is used: the run gets a fresh
private root of its own, which every command finds and `down` removes."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from epdctl import cache
from epdctl.cache.store import Store
from epdctl.cache.store_root import store_safety
from epdctl.host import private
from epdctl.launch.state import RunState
from tests.attacker import NOBODY, as_nobody, attempt
from tests.cache.conftest import payload

pytestmark = pytest.mark.timeout(120)
IS_ROOT = os.geteuid() == 0
ME = os.geteuid()
as_root = pytest.mark.skipif(not IS_ROOT, reason="dropping to another uid needs root")


@pytest.fixture
def shm_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in for /dev/shm (mode 1777, on tmpfs) holding the default store roots."""
    base = Path(tempfile.mkdtemp(prefix="epdctl-test-base-",
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    os.chmod(base, 0o1777)
    monkeypatch.setattr(cache, "STORE_BASE", str(base))
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def default_topology(fake_topology: Callable[..., Path]) -> Callable[..., Path]:
    """A fake-server topology that leaves cache.dir at its default (in shm_base)."""

    def write(connector: str | None = None) -> Path:
        path = fake_topology()
        data = yaml.safe_load(path.read_text())
        data["cache"] = {"connector": connector} if connector else {}
        path.write_text(yaml.safe_dump(data))
        return path

    return write


def squat(path: Path, mode: int) -> None:
    """Create `path` as the attacker would have: theirs (as root), else ours but readable
    (there is no other user to make it then)."""
    path.mkdir()
    os.chmod(path, mode)
    if IS_ROOT:
        os.chown(path, NOBODY, NOBODY)
    else:
        path.mkdir()
        os.chmod(path, mode)


def state_of(state_root: Path) -> RunState:
    return RunState.model_validate_json((state_root / "fake" / "state.json").read_text())


@as_root
def test_another_user_cannot_list_or_read_the_store(epdctl, default_topology, state_root,
                                                    shm_base: Path) -> None:
    assert epdctl("up", str(default_topology()), "-d", "--timeout", "20").exit_code == 0
    try:
        state = state_of(state_root)
        ns_dir = Path(state.store_dir)
        assert ns_dir.parent == shm_base / f"epdctl-{ME}"
        store = Store(ns_dir.parent, state.namespace).create()  # as E's connector does
        store.publish("k", payload(2), dtype="float32", shape=(2, 8))
        os.chmod(store.entry_path("k"), 0o644)  # even a readable entry is out of reach
        entry = Path(store.entry_path("k"))
        # Reached through a directory fd opened first (this sandbox's `/` is 0700): the
        # attacker is stopped by the store's own modes, not by the way there.
        base = os.open(shm_base, os.O_RDONLY | os.O_DIRECTORY)

        def opened(path: Path) -> int:
            return os.open(path.relative_to(shm_base), os.O_RDONLY, dir_fd=base)

        try:
            seen = as_nobody(attempt(
                control=lambda: os.listdir(base),
                list_root=lambda: os.listdir(opened(ns_dir.parent)),
                list_namespace=lambda: os.listdir(opened(ns_dir)),
                list_entries=lambda: os.listdir(opened(Path(store.entries))),
                read_entry=lambda: os.read(opened(entry), 16)))
        finally:
            os.close(base)
        if seen.pop("control") != "done":
            pytest.skip("uid 65534 may not even list a mode 1777 directory here (a sandbox): "
                        "the attack would prove nothing")
        assert seen == dict.fromkeys(
            ["list_root", "list_namespace", "list_entries", "read_entry"], "denied")
    finally:
        assert epdctl("down").exit_code == 0


@pytest.mark.parametrize("mode", [0o700, 0o755, 0o777] if IS_ROOT else [0o755, 0o777])
def test_a_squatted_default_root_does_not_stop_up_and_is_not_used(
    epdctl, default_topology, state_root, shm_base: Path, mode: int
) -> None:
    squatted = shm_base / f"epdctl-{ME}"
    squat(squatted, mode)
    result = epdctl("up", str(default_topology()), "-d", "--timeout", "20")
    assert result.exit_code == 0, result.stderr
    try:
        root = Path(state_of(state_root).store_dir).parent
        assert root.parent == shm_base and root.name.startswith(f"epdctl-{ME}-")
        st = os.lstat(root)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (ME, 0o700)
        warnings = [line for line in result.stderr.splitlines() if "warning" in line]
        assert warnings == [f"warning: not using the EC store root `{squatted}` ("
                            f"{private.dir_problem(squatted)}); this run's store is "
                            f"`{root}`, private to you"]
        assert os.listdir(squatted) == []  # nothing of ours went into theirs
        safety = store_safety(state_of(state_root))
        assert (safety.root, safety.is_private, safety.is_fresh) == (root, True, True)
        inspect = epdctl("cache", "inspect", "--json")
        assert inspect.exit_code == 0 and json.loads(inspect.stdout)["store_dir"] == str(root)
        assert epdctl("status").exit_code == 0
    finally:
        assert epdctl("down").exit_code == 0
    assert not root.exists()  # down removes the root it made, once empty
    assert squatted.is_dir()  # not ours to remove


def test_a_dry_run_with_a_squatted_root_creates_nothing(epdctl, default_topology,
                                                       shm_base: Path) -> None:
    squatted = shm_base / f"epdctl-{ME}"
    squat(squatted, 0o755)
    result = epdctl("up", str(default_topology()), "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert (f"warning: the EC store root `{squatted}` is not usable "
            f"({private.dir_problem(squatted)}); `up` will use a fresh private root of its "
            "own\n") in result.stderr
    assert os.listdir(shm_base) == [squatted.name]


def test_a_dry_run_creates_no_default_root(epdctl, default_topology, shm_base: Path) -> None:
    assert epdctl("up", str(default_topology()), "--dry-run").exit_code == 0
    assert os.listdir(shm_base) == []


@pytest.mark.parametrize("squatted", [False, True], ids=["default", "fresh"])
def test_a_start_refused_before_it_begins_leaves_no_root(
    epdctl, default_topology, shm_base: Path, monkeypatch: pytest.MonkeyPatch, squatted: bool
) -> None:
    from epdctl.errors import PlanError

    if squatted:
        squat(shm_base / f"epdctl-{ME}", 0o755)

    def refuse(*args: object, **kwargs: object) -> None:
        raise PlanError("refused for the test")

    monkeypatch.setattr("epdctl.launch.run.make_plan", refuse)
    result = epdctl("up", str(default_topology()), "-d", "--timeout", "20")
    assert result.exit_code == 1
    assert result.stderr.endswith("Error: refused for the test\n")
    # The default root made (or the fresh one, when the default was taken) is taken back.
    assert os.listdir(shm_base) == ([f"epdctl-{ME}"] if squatted else [])


def test_up_makes_the_default_root_private(epdctl, default_topology, state_root,
                                           shm_base: Path) -> None:
    result = epdctl("up", str(default_topology()), "-d", "--timeout", "20")
    assert result.exit_code == 0, result.stderr
    try:
        assert "warning" not in result.stderr
        state = state_of(state_root)
        assert Path(state.store_dir).parent == shm_base / f"epdctl-{ME}"
        safety = store_safety(state)
        assert (safety.is_used, safety.is_private, safety.is_fresh) == (True, True, False)
        os.chmod(safety.namespace_dir, 0o755)
        later = store_safety(state)
        assert not later.is_private and later.problem == (
            f"{safety.namespace_dir}: {private.dir_problem(safety.namespace_dir)}")
    finally:
        assert epdctl("down").exit_code == 0


def test_a_user_set_store_root_that_others_can_read_is_refused_with_the_fix(
    epdctl, fake_topology, state_root, tmp_path: Path
) -> None:
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o755)
    result = epdctl("up", str(fake_topology()), "-d", "--timeout", "20")
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: refusing the EC store `{root}`: group or others can read it (mode 0755); "
        f"`chmod go= {root}`, or remove it (epdctl creates it with mode 0700), or set "
        "cache.dir to a directory of your own\n")
    assert not (state_root / "fake" / "logs").exists()  # nothing was started


def test_a_root_of_a_fake_owner_is_refused() -> None:
    """Where the suite is not root: the same rule, judged on a stat of another owner."""
    theirs = os.stat_result((stat.S_IFDIR | 0o700, 0, 0, 1, NOBODY, 0, 0, 0, 0, 0))
    assert private.dir_problem("/x", theirs, uid=1000) == (
        f"it belongs to uid {NOBODY}, not to you (uid 1000); have its owner remove it")
    readable = os.stat_result((stat.S_IFDIR | 0o705, 0, 0, 1, 1000, 0, 0, 0, 0, 0))
    assert private.dir_problem("/x", readable, uid=1000).startswith(
        "group or others can read it (mode 0705)")


OOT = "tests.ec_recording:RecordingECConnector"


@pytest.mark.parametrize("connector", ["ECExampleConnector", OOT])
def test_every_connector_gets_a_private_namespace_dir_before_the_engines_start(
    epdctl, fake_topology, state_root, connector: str
) -> None:
    topo = fake_topology(cache=f"connector: '{connector}'")
    result = epdctl("up", str(topo), "-d", "--timeout", "20")
    assert result.exit_code == 0, result.stderr
    ns_dir = Path(state_of(state_root).store_dir)
    try:
        for path in (ns_dir.parent, ns_dir):
            st = os.lstat(path)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (ME, 0o700), path
    finally:
        assert epdctl("down").exit_code == 0
    # One planted (another's, or one others can write to) is refused before anything starts.
    ns_dir.parent.mkdir(mode=0o700, exist_ok=True)
    ns_dir.mkdir(mode=0o700)
    os.chmod(ns_dir, 0o777)
    result = epdctl("up", str(topo), "-d", "--timeout", "20")
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: refusing the EC store `{ns_dir}`: group or "
                                    "others can write to it (mode 0777)")
    assert not (state_root / "fake" / "state.json").exists()


def test_a_kept_fresh_root_is_found_again_by_the_next_up(epdctl, default_topology,
                                                         state_root, shm_base: Path) -> None:
    squatted = shm_base / f"epdctl-{ME}"
    squat(squatted, 0o755)
    topo = default_topology()
    assert epdctl("up", str(topo), "-d", "--timeout", "20").exit_code == 0
    root = Path(state_of(state_root).store_dir).parent
    assert epdctl("down", "--keep-cache").exit_code == 0
    assert root.is_dir()
    again = epdctl("up", str(topo), "-d", "--timeout", "20")
    try:
        assert again.exit_code == 0, again.stderr
        assert Path(state_of(state_root).store_dir).parent == root
        assert f"this run's store is `{root}`" in again.stderr
    finally:
        assert epdctl("down").exit_code == 0
    assert not root.exists()


def test_up_records_the_namespaces_this_topology_used(epdctl, fake_topology,
                                                      state_root: Path) -> None:
    from epdctl.cache.store_root import earlier_namespaces

    first = fake_topology()
    assert epdctl("up", str(first), "-d", "--timeout", "20").exit_code == 0
    old = Path(state_of(state_root).store_dir)
    assert earlier_namespaces(state_root / "fake", old.parent) == {old.name}
    assert epdctl("down", "--keep-cache").exit_code == 0
    # Another dtype: another namespace, for the same topology.
    second = fake_topology(encode_args=("--dtype", "float16"), pd_args=("--dtype", "float16"))
    result = epdctl("up", str(second), "-d", "--timeout", "20")
    assert result.exit_code == 0, result.stderr
    try:
        new = Path(state_of(state_root).store_dir)
        assert new != old and new.parent == old.parent
        assert earlier_namespaces(state_root / "fake", new.parent) == {old.name, new.name}
    finally:
        assert epdctl("down").exit_code == 0


def test_a_fresh_root_of_ours_is_shared_not_multiplied(epdctl, default_topology, state_root,
                                                       shm_base: Path) -> None:
    squat(shm_base / f"epdctl-{ME}", 0o777)
    ours = shm_base / f"epdctl-{ME}-k3yq9z"  # as an earlier up (or verify's plan) made it
    ours.mkdir(mode=0o700)
    result = epdctl("up", str(default_topology()), "-d", "--timeout", "20")
    assert result.exit_code == 0, result.stderr
    try:
        assert Path(state_of(state_root).store_dir).parent == ours
        assert sorted(os.listdir(shm_base)) == [f"epdctl-{ME}", ours.name]
    finally:
        assert epdctl("down").exit_code == 0
