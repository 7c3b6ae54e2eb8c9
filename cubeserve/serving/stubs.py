"""The processes of a tritonserver, found through /proc (Linux): its process tree, and the python
backend's stub processes among them; and a stub's guarantee that it ends once finalized.

Triton runs every python_backend model instance in a process of its own
(`triton_python_backend_stub <repository>/<model>/<version>/model.py ...`, a child of
tritonserver). When one dies (out-of-memory kill, a crash in a kernel), Triton 2.51 neither
restarts it nor reports the model unready: its requests hang or fail while every health
endpoint answers 200. The supervisor and the predict model watch the stubs with this instead.
"""

from __future__ import annotations

import faulthandler
import gc
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

STUB_EXECUTABLE = "triton_python_backend_stub"


def _stat_fields(pid_dir: Path) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, ...]; None once the process is gone.
    The name ("(comm)") may hold spaces and parentheses, so the split is after the last ")"."""
    try:
        return (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def started_at(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch (None once it is gone): its
    /proc/<pid>/stat starttime (clock ticks since boot) plus the boot time (/proc/stat's btime)."""
    fields = _stat_fields(Path(f"/proc/{pid}"))
    if not fields:
        return None
    boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process now."""
    parents = {}
    for pid_dir in Path("/proc").iterdir():
        if pid_dir.name.isdigit():
            fields = _stat_fields(pid_dir)
            if fields:
                parents[int(pid_dir.name)] = int(fields[1])
    return parents


def children(pid: int) -> list[int]:
    return [child for child, parent in _parents().items() if parent == pid]


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants, at any depth (the supervisor, tritonserver, the stubs)."""
    below: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        below.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(below.get(p, ()))
    return tree


def _stub_model_py(pid_dir: Path) -> Path | None:
    """The model.py a live stub process runs, None for anything else (or a zombie)."""
    fields = _stat_fields(pid_dir)
    try:
        args = (pid_dir / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if not fields or fields[0] == "Z" or len(args) < 2 or not args[0].decode(errors="replace").endswith(STUB_EXECUTABLE):
        return None  # a zombie is a dead stub that Triton has not reaped
    return Path(args[1].decode(errors="replace"))


def stub_processes(server_pid: int) -> dict[int, Path]:
    """{stub pid: its model.py (<repository>/<model>/<version>/model.py)} of tritonserver `server_pid`."""
    stubs = {}
    for pid in children(server_pid):
        model_py = _stub_model_py(Path(f"/proc/{pid}"))
        if model_py is not None:
            stubs[pid] = model_py
    return stubs


_INSTANCE_NAME = re.compile(r"(.+)_\d+_\d+")


def _model_name(pid: int, model_py: Path) -> str:
    """The stub's model: from its instance name (argument 8 of the stub's command line in
    python_backend's stub_launcher.cc: `<model>_<group>_<instance>` for the default instance
    groups), else from its path. The path alone is not enough: a model loaded with its files in
    the load request runs from a temporary folder (`<tmp>/<version>/model.py`)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        match = _INSTANCE_NAME.fullmatch(args[8].decode(errors="replace"))
        if match:
            return match.group(1)
    except (OSError, IndexError):
        pass
    return model_py.parent.parent.name


# Triton's answer to a request for a model whose stub has died (python_backend r24.10
# src/python_be.cc, an INTERNAL error: HTTP 500, gRPC INTERNAL). The supervisor restarts the server
# (or ends the container) within a poll interval, so the request was never run and another try
# will be: the front ends answer it as unavailable (503 / UNAVAILABLE), which clients retry.
_DEAD_STUB = re.compile(r"Stub process '(.+?)' is not healthy\.?")


def dead_stub_unavailable(message: str) -> str | None:
    """Triton's error `message` as an "unavailable: ..." one when it says a model's stub died,
    else None."""
    found = _DEAD_STUB.search(message)
    if found is None:
        return None
    return (f"unavailable: the process of model instance '{found.group(1)}' died and the server is "
            "restarting; retry")


def python_stubs(server_pid: int) -> dict[int, tuple[str, str]]:
    """{stub pid: (model name, version)} for the live stub processes of tritonserver `server_pid`."""
    return {pid: (_model_name(pid, path), path.parent.name) for pid, path in stub_processes(server_pid).items()}


class StubLiveness:
    """Whether a stub of (model, version) of tritonserver `server_pid` lives, asked often (the
    predict model's watchdog, four times a second while requests wait on the engine). A scan of
    /proc reads every process's stat (1.6 ms with 67 processes on a 2-core CPU, more beside a
    build), and at that rate the watchdog took 3.7 ms of CPU an object while geometry wanted both
    cores (issue 53). So the stubs a scan found are remembered by pid and start time and looked
    at alone, one read of /proc/<pid>/stat each, for as long as one of them lives (a zombie, or
    another process under a reused pid, does not); only then is /proc scanned again, which also
    finds a reloaded version's new stub."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid
        self._known: dict[tuple[str, str], list[tuple[int, str]]] = {}  # (model, version) -> [(pid, start)]

    def _lives(self, pid: int, start: str) -> bool:
        fields = _stat_fields(Path(f"/proc/{pid}"))
        return bool(fields) and fields[0] != "Z" and int(fields[1]) == self.server_pid and fields[19] == start

    def alive(self, model: str, version: str | int) -> bool:
        key = (model, str(version))
        if any(self._lives(pid, start) for pid, start in self._known.get(key, ())):
            return True
        known: dict[tuple[str, str], list[tuple[int, str]]] = {}
        for pid, pair in python_stubs(self.server_pid).items():
            fields = _stat_fields(Path(f"/proc/{pid}"))
            if fields:
                known.setdefault(pair, []).append((pid, fields[19]))
        self._known = known  # one assignment: the watchdog and the forwards' threads both ask
        return key in known


def kill_leftover_stubs(stubs: dict[int, Path]) -> list[int]:
    """SIGKILL the stubs of `stubs` (from stub_processes while tritonserver lived) that outlived
    it: a stub whose server was killed is reparented and can linger, e.g. on a thread still
    waiting for a dead engine. A pid is hit only while it still runs the same model.py."""
    killed = []
    for pid, model_py in stubs.items():
        if _stub_model_py(Path(f"/proc/{pid}")) == model_py:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


SHM_REGION_PREFIX = "triton_python_backend_shm_region_"


def shm_regions(pids) -> set[str]:
    """The shared-memory regions (names in /dev/shm) of the stub processes `pids`: argument 2 of
    a stub's command line (python_backend's stub_launcher.cc)."""
    regions = set()
    for pid in pids:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(args) > 2 and args[2].startswith(SHM_REGION_PREFIX.encode()) and b"/" not in args[2]:
            regions.add(args[2].decode())
    return regions


def orphan_regions(min_age_s: float = 60.0, shm: Path = Path("/dev/shm")) -> set[str]:
    """Python backend regions in `shm` that no live process maps and that are older than
    `min_age_s`: a killed server's (SIGKILL, an out-of-memory kill: nothing of it ran to remove
    them), which in a pod stay in its memory-backed /dev/shm across container restarts and count
    against its memory. The age keeps a region that a starting server has created and not yet
    mapped (another server's, where several share /dev/shm)."""
    now = time.time()
    candidates = set()
    for path in shm.glob(SHM_REGION_PREFIX + "*"):
        try:
            if now - path.stat().st_mtime >= min_age_s:
                candidates.add(path.name)
        except FileNotFoundError:
            pass
    if not candidates:
        return set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:  # gone, or another user's
            continue
        candidates = {name for name in candidates if f"{shm}/{name}" not in text}
        if not candidates:
            break
    return candidates


def remove_regions(regions) -> list[str]:
    """Unlink the regions of a tritonserver that ended without removing them (killed, crashed:
    Triton removes them in its own shutdown only); returns those removed."""
    removed = []
    for name in regions:
        try:
            os.unlink(f"/dev/shm/{name}")
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def release_backend_objects() -> None:
    """Free now, from finalize, what the stub's Python still holds of its shared memory (requests,
    tensors, response senders left in reference cycles). The stub unmaps that memory before its
    interpreter is torn down; an object freed then writes to the unmapped pool's lock and the stub
    segfaults at every unload and stop."""
    gc.collect()


def end_this_process_after(seconds: float) -> None:
    """A stub on its way out (after finalize) that still runs `seconds` from now: its threads'
    stacks go to stderr (the server's log) and it ends. Until a stub ends, Triton's unload of its
    model does not finish and the engine's memory stays taken; an exit hook that hangs (a
    library's, a thread that never ends) must not keep it. faulthandler's timer is a C thread:
    it fires also while the interpreter shuts down, where a Python thread could not run."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    # faulthandler stops watching when the interpreter is torn down, and what runs after it (C++
    # destructors) could hang too: SIGALRM, whose default action ends the process, covers that.
    signal.alarm(math.ceil(2 * seconds))
