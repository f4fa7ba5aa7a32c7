"""Private paths: what epdctl creates is its user's alone (0700 / 0600), and a directory it
is about to use must be a real one that the user owns and nobody else can reach at all.

On a shared machine another user must not read the EC store or the state dir (entry names
are content hashes), plant files in them, or hand us a directory (or a link) of theirs to
write into; and no file epdctl writes follows a link planted at its name (write_file,
open_file, open_append). Stdlib only: the connector checks its store with this inside
vLLM's processes.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

DIR_MODE = 0o700
FILE_MODE = 0o600
# Group or others may write: they could add, rename or remove what is inside.
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH
_SHARED = 0o077
"""Any access of group or others: listing a store shows its entries' content hashes."""


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
                f"remove it (epdctl creates it with mode 0700), or `chmod go= {path}` if "
                "you trust what is in it")
    if st.st_mode & _SHARED:
        return (f"group or others can read it (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"`chmod go= {path}`, or remove it (epdctl creates it with mode 0700)")
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
    tighten(path)
    return path


def tighten(path: str | os.PathLike[str]) -> None:
    """Make a directory of ours that others can read but not write 0700 (nobody else can
    have put anything in it); anything else is left for dir_problem to name."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & _SHARED
            and not st.st_mode & _SHARED_WRITE):
        os.chmod(path, DIR_MODE)


def open_file(path: str | os.PathLike[str], flags: int) -> int:
    """os.open of a file that may exist already (a lock, a log): created 0600, never through
    a link (O_NOFOLLOW: ELOOP), and an existing one must be a regular file of ours (else
    OSError; one of ours is made 0600). For a file written whole, use write_file."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "it is a symbolic link (never followed)",
                          str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, "it is not a regular file of yours", str(path))
        if stat.S_IMODE(st.st_mode) & _SHARED:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` with `data` atomically: a fresh 0600 file of an unguessable name
    (mkstemp: O_EXCL, so nothing planted is followed) renamed over it. OSError on failure,
    and then no tmp file is left."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_append(path: str | os.PathLike[str]) -> BinaryIO:
    """A log file opened for appending, created 0600 (see open_file), in a directory made
    with own_dir and checked (OSError if it is not the user's alone)."""
    parent = own_dir(Path(path).parent)
    problem = dir_problem(parent)
    if problem is not None:
        raise PermissionError(f"refusing the log dir `{parent}`: {problem}")
    return os.fdopen(open_file(path, os.O_WRONLY | os.O_APPEND), "ab")
