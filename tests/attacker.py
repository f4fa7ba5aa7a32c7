"""A second local user, for real: `as_nobody` runs an attack in a forked child that dropped
to uid and gid 65534 (the suite runs as root on CI; without root the callers skip).

A fork, not an exec: this sandbox lets uid 65534 exec nothing, and its `/` is 0700, so the
child can reach a path only through a directory fd opened before it dropped (`dir_fd`), and
can import nothing new: import what the attack needs before calling.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

NOBODY = 65534


def as_nobody(attack: Callable[[], dict]) -> dict:
    """Run `attack` in a forked child that dropped to uid and gid 65534 first, and return
    what it returned (a fork, not an exec: this sandbox lets uid 65534 exec nothing)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the attacker
        code = 1
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            assert os.geteuid() == NOBODY
            os.write(write_fd, json.dumps(attack()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        out = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker's child failed"
    return json.loads(out)


def attempt(**calls: Callable[[], object]) -> Callable[[], dict]:
    """An attack: each call's outcome, `done` or `denied` (PermissionError)."""

    def attack() -> dict:
        out = {}
        for what, call in calls.items():
            try:
                call()
                out[what] = "done"
            except PermissionError:
                out[what] = "denied"
        return out

    return attack
