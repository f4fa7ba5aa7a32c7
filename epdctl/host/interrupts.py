"""SIGTERM and SIGHUP unwind as Ctrl+C does while a block runs, so that what the block
started is stopped by its own clean-up; then they end the process as they would have.

By default they end a Python process on the spot: no `finally` runs, and a topology that
`bench`, `tune` or `verify` started stays up with nobody left to stop it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

WATCHED = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived (its number the argument): a KeyboardInterrupt, so that
    every clean-up written for Ctrl+C runs too; `unwinding` then ends the process of it."""


@contextmanager
def unwinding() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise Terminated instead of ending the
    process; once the block has ended, however it ended, the process ends of the signal
    (its exit status says so). Only signals at their default action are taken (never one a
    caller handles itself), only in the main thread (where Python runs handlers), and once:
    a second signal while the clean-up runs is ignored instead of cutting it short. Nested
    blocks: the outermost one takes the signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken: list[signal.Signals] = []
    got: list[int] = []

    def raise_it(signum: int, frame: FrameType | None) -> None:
        for sig in taken:
            signal.signal(sig, signal.SIG_IGN)
        got.append(signum)
        raise Terminated(signum)

    for sig in WATCHED:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, raise_it)
            taken.append(sig)
    try:
        yield
    finally:
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)
        if got:  # however the block ended (Ctrl+C's exit 130, say): the signal's end
            signal.raise_signal(got[0])
