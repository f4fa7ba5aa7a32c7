"""Private paths: what epdctl creates is its user's alone (0700 / 0600), and a directory it
is about to use must be a real one that the user owns and nobody else can write to.

On a shared machine another user must not read the EC store or the state dir, plant files
in them, or hand us a directory (or a link) of theirs to write into. Stdlib only: the
connector checks its store with this inside vLLM's processes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

DIR_MODE = 0o700
FILE_MODE = 0o600
# Group or others may write: they could add, rename or remove what is inside.
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


def dir_problem(path: str | os.PathLike[str], st: os.stat_result | None = None,
                uid: int | None = None) -> str | None:
    """Why `path` is not a directory to trust, as `what is wrong; the fix`; None if it is.

    `st`: its lstat (read when not given; FileNotFoundError when it does not exist).
    """
    uid = os.geteuid() if uid is None else uid
    st = os.lstat(path) if st is None else st
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link; remove the link (epdctl creates the directory itself)"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory; remove it"
    if st.st_uid != uid:
        return (f"it belongs to uid {st.st_uid}, not to you (uid {uid}); have its owner "
                "remove it")
    if st.st_mode & _SHARED_WRITE:
        return (f"group or others can write to it (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"remove it (epdctl creates it with mode 0700), or `chmod go-w {path}` if "
                "you trust what is in it")
    return None


def refusal(what: str, path: str | os.PathLike[str], problem: str, elsewhere: str) -> str:
    """The one line that refuses a directory: what it is, where, why, and the ways out."""
    return f"refusing {what} `{path}`: {problem}, or {elsewhere}"


def check_dir(path: str | os.PathLike[str], what: str, elsewhere: str,
              error: type[Exception]) -> None:
    """Raise `error` (one line) unless `path` is a directory to trust; it must exist."""
    problem = dir_problem(path)
    if problem is not None:
        raise error(refusal(what, path, problem, elsewhere))


def make_dir(path: str | os.PathLike[str], what: str, elsewhere: str,
             error: type[Exception]) -> Path:
    """Create `path` with mode 0700 unless it exists (its parents as `mkdir -p` does), then
    check_dir it: an existing directory is used only if it is one to trust."""
    path = Path(path)
    try:
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # not a directory: check_dir says so
    except OSError as exc:
        raise error(f"{what} `{path}` is not writable: {exc.strerror or exc}") from None
    check_dir(path, what, elsewhere, error)
    return path


def own_dir(path: str | os.PathLike[str]) -> Path:
    """A directory epdctl owns outright (a state dir, its logs): created 0700, and made 0700
    if an older epdctl left it readable by others (not if others could write to it: what
    is inside may be theirs, which check_dir then says)."""
    path = Path(path)
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    st = os.lstat(path)
    if (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077
            and not st.st_mode & _SHARED_WRITE):
        os.chmod(path, DIR_MODE)
    return path


def open_file(path: str | os.PathLike[str], flags: int) -> int:
    """os.open that creates the file 0600 (and makes an existing one of ours 0600)."""
    fd = os.open(path, flags | os.O_CREAT, FILE_MODE)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str | os.PathLike[str]) -> BinaryIO:
    """A log file opened for appending, created 0600 (its directory made with own_dir)."""
    own_dir(Path(path).parent)
    return os.fdopen(open_file(path, os.O_WRONLY | os.O_APPEND), "ab")
