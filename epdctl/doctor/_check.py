"""The result of one doctor check, and the subprocess runner the checks share."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from epdctl.interrupts import unwinding

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(frozen=True)
class Check:
    """One line of `epdctl doctor`: what was checked, how it went, and what to do about it."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Completed:
    """A finished command; returncode None means it was killed at its timeout."""

    returncode: int | None
    stdout: str
    stderr: str

    def last_line(self) -> str:
        """The last non-empty line of stderr, else of stdout (where errors end up)."""
        for text in (self.stderr, self.stdout):
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            if lines:
                return lines[-1]
        return ""


Runner = Callable[[Sequence[str], Mapping[str, str], float], Completed]


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # any helper it forked goes with it
    except ProcessLookupError:
        pass


def run_command(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> Completed:
    """Run argv to completion in its own session, killing the whole group at the timeout,
    and with epdctl: on SIGINT, SIGTERM, SIGHUP or any exception while it runs."""
    with unwinding():
        try:
            proc = subprocess.Popen(
                list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
            )
        except OSError as exc:
            return Completed(127, "", f"{argv[0]}: {exc.strerror or exc}")
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            return Completed(None, out, err)
        except BaseException:
            # Its own session keeps it out of reach of the terminal's Ctrl+C: ours to stop.
            _kill_group(proc)
            proc.wait()
            raise
        return Completed(proc.returncode, out, err)
