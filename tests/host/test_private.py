"""epdctl.host.private: which directories are trusted, and the modes of what epdctl creates."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from epdctl.errors import CacheError
from epdctl.host import private

ME = os.geteuid()
OTHER = 65534 if ME != 65534 else 65533  # nobody


def fake_stat(mode: int, uid: int = ME) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


@pytest.mark.parametrize(("st", "why"), [
    (fake_stat(stat.S_IFLNK | 0o777), "it is a symbolic link; remove the link"),
    (fake_stat(stat.S_IFREG | 0o600), "it is not a directory; remove it"),
    (fake_stat(stat.S_IFDIR | 0o700, OTHER),
     f"it belongs to uid {OTHER}, not to you (uid {ME}); have its owner remove it"),
    (fake_stat(stat.S_IFDIR | 0o770), "group or others can write to it (mode 0770); remove it"),
    (fake_stat(stat.S_IFDIR | 0o1777), "group or others can write to it (mode 1777); remove it"),
    (fake_stat(stat.S_IFDIR | 0o702), "group or others can write to it (mode 0702); remove it"),
    # Reading a store lists its entries' content hashes: any access of others is refused.
    (fake_stat(stat.S_IFDIR | 0o755), "group or others can read it (mode 0755); `chmod go= /x`"),
    (fake_stat(stat.S_IFDIR | 0o750), "group or others can read it (mode 0750)"),
    (fake_stat(stat.S_IFDIR | 0o701), "group or others can read it (mode 0701)"),
    (fake_stat(stat.S_IFDIR | 0o710), "group or others can read it (mode 0710)"),
])
def test_an_untrusted_directory_is_named_with_the_fix(st: os.stat_result, why: str) -> None:
    problem = private.dir_problem("/x", st)
    assert problem is not None and problem.startswith(why)


@pytest.mark.parametrize("mode", [0o700, 0o500, 0o300])
def test_a_directory_of_ones_own_that_nobody_else_can_reach_is_trusted(mode: int) -> None:
    assert private.dir_problem("/x", fake_stat(stat.S_IFDIR | mode)) is None


def test_root_owned_is_not_ones_own_for_another_user() -> None:
    st = fake_stat(stat.S_IFDIR | 0o700, 0)
    assert private.dir_problem("/x", st, uid=1000) == (
        "it belongs to uid 0, not to you (uid 1000); have its owner remove it")


def test_make_dir_creates_0700_and_refuses_in_one_line(tmp_path: Path) -> None:
    made = private.make_dir(tmp_path / "a" / "b", "the thing", "use another", CacheError)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert private.make_dir(made, "the thing", "use another", CacheError) == made  # reused
    os.chmod(made, 0o777)
    with pytest.raises(CacheError) as err:
        private.make_dir(made, "the thing", "use another", CacheError)
    assert str(err.value) == (
        f"refusing the thing `{made}`: group or others can write to it (mode 0777); remove it "
        f"(epdctl creates it with mode 0700), or `chmod go= {made}` if you trust what is in "
        "it, or use another")
    link = tmp_path / "link"
    link.symlink_to(made)
    os.chmod(made, 0o700)
    with pytest.raises(CacheError, match=r"^refusing the thing `.*/link`: it is a symbolic link"):
        private.make_dir(link, "the thing", "use another", CacheError)
    (tmp_path / "file").write_text("")
    with pytest.raises(CacheError, match="it is not a directory"):
        private.make_dir(tmp_path / "file", "the thing", "use another", CacheError)


@pytest.mark.skipif(ME != 0, reason="chown to another uid needs root")
def test_make_dir_refuses_another_users_directory(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(CacheError, match=rf"belongs to uid {OTHER}, not to you \(uid 0\)"):
        private.make_dir(theirs, "the thing", "use another", CacheError)


def test_make_dir_refuses_another_uids_directory_as_any_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chown refusal without root: the directory is this user's, and epdctl runs as if
    its user were another uid."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    monkeypatch.setattr(os, "geteuid", lambda: OTHER)
    with pytest.raises(CacheError, match=rf"belongs to uid {ME}, not to you \(uid {OTHER}\)"):
        private.make_dir(theirs, "the thing", "use another", CacheError)


def test_own_dir_and_files_are_private(tmp_path: Path) -> None:
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)  # as an older epdctl left it
    assert stat.S_IMODE(private.own_dir(old).stat().st_mode) == 0o700
    log = tmp_path / "logs" / "x.log"
    with private.open_append(log) as f:
        f.write(b"line\n")
    assert stat.S_IMODE(log.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    os.chmod(log, 0o644)
    with private.open_append(log) as f:
        f.write(b"more\n")
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and log.read_bytes() == b"line\nmore\n"
