"""epdctl.host.interrupts: SIGTERM unwinds a block, then ends the process of the signal (each case
in a Python subprocess of its own: the end is the process's)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)


def _run(body: str) -> subprocess.CompletedProcess[str]:
    # SIGHUP as a terminal starts a process: a run under `nohup` would hand it on ignored.
    script = ("import os, signal, sys, threading\nfrom epdctl.host.interrupts import unwinding\n"
              "signal.signal(signal.SIGHUP, signal.SIG_DFL)\n")
    return subprocess.run([sys.executable, "-c", script + textwrap.dedent(body)], text=True,
                          capture_output=True, timeout=30)


def test_the_block_unwinds_then_the_process_dies_of_the_signal() -> None:
    done = _run("""
        with unwinding():
            try:
                with unwinding():  # nested: the outer block owns the signals
                    try:
                        os.kill(os.getpid(), signal.SIGTERM)
                        signal.pause()
                    finally:
                        print("inner clean-up", flush=True)
                        os.kill(os.getpid(), signal.SIGTERM)  # a second one: ignored
                        print("clean-up not cut short", flush=True)
            except KeyboardInterrupt:
                print("seen as Ctrl+C", flush=True)
                sys.exit(130)  # what a command does with Ctrl+C: still the signal's end
        print("never", flush=True)
        """)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout.splitlines() == ["inner clean-up", "clean-up not cut short",
                                        "seen as Ctrl+C"]


def test_sighup_too() -> None:
    done = _run("""
        with unwinding():
            try:
                os.kill(os.getpid(), signal.SIGHUP)
                signal.pause()
            finally:
                print("clean-up", flush=True)
        """)
    assert done.returncode == -signal.SIGHUP and done.stdout == "clean-up\n", done.stderr


def test_a_handler_of_the_caller_is_left_alone_and_a_quiet_block_changes_nothing() -> None:
    done = _run("""
        signal.signal(signal.SIGTERM, lambda *a: print("caller's handler", flush=True))
        with unwinding():
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
        with unwinding():
            pass
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
        print("went on", flush=True)
        """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "caller's handler\nwent on\n"


def test_outside_the_main_thread_it_takes_nothing() -> None:
    done = _run("""
        seen = []
        def work():
            with unwinding():
                seen.append(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        print(seen, flush=True)
        """)
    assert done.returncode == 0 and done.stdout == "[True]\n", done.stderr
