"""Ports and child processes."""

import ctypes
import os
import signal
import socket
import threading
import time


def free_port() -> int:
    """A port the OS just handed out on 127.0.0.1 and released again: free now, though another
    process may take it before the caller binds it (fine on a test or benchmark host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In a Python child: end this process (SIGKILL) once its parent is gone. A thread watches
    the parent's pid, so it holds whichever thread of the parent started the child."""
    ppid = os.getppid()

    def watch() -> None:
        while os.getppid() == ppid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def exec_with_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """As `preexec_fn` of a program the parent execs: the kernel sends it `sig` when the
    parent dies, even by SIGKILL (Linux; elsewhere a no-op). A thread cannot survive an exec,
    so a program that is not ours gets the kernel's signal instead of die_with_parent."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except OSError:
        pass
