"""Servers that end with the command that started them.

A command stopped by SIGKILL (a process manager that kills only the PID it started, the OOM
killer, `kill -9`) runs no cleanup: without more, the tritonserver it started keeps its ports and
memory, the Envoy keeps the gateway's port and its keys, and nothing is left to stop them. Linux's
parent-death signal (prctl PR_SET_PDEATHSIG) sends such a child SIGTERM instead, which each
handles as a stop: the supervisor drains tritonserver, Envoy exits. In a container the runtime
kills the whole tree anyway; this is for the commands run on a machine (`cubeserve serve`,
`cubeserve gateway`, the tests)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _libc_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _libc_prctl() if sys.platform.startswith("linux") else None


def ends_with_this_process() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: the child gets SIGTERM when this process ends, however
    it ends. None where that cannot hold: off Linux, and off the main thread (the signal follows
    the *thread* that forked, so a child started by a worker thread would be stopped when that
    thread ends)."""
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def in_child() -> None:  # between fork and exec: a system call and nothing that takes a lock
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call above took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return in_child
