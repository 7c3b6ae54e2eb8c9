"""Python backend stub crashes over a whole test run: counted, shown in the terminal summary, and
the run fails unless there are none (tests/conftest.py calls these).

The crash this guards against: a stub's teardown that deleted its metrics after its shared memory
was gone (git show 4d6acc4) segfaulted in every stub that exited, at each unload and stop. It
leaves no line in tritonserver's log: the stub is tritonserver's child, which reaps it without a
word, and the stub dies after its Python is finalized (no faulthandler). The kernel logs it
("triton_python_b[PID]: segfault at ..." or "traps: triton_python_b[PID] general protection
fault ..."); glibc's heap checks abort with their reason on the process's stderr ("free():
invalid pointer"), which is the server's log. So:

* every LocalTriton of the run keeps a log, listed in one folder (SERVER_LOGS_ENV, set here
  before any test or xdist worker starts; cubeserve/server/local_triton.py);
* the supervisor names each stub's PID there, and where its code is mapped (the kernel names
  the faulting thread, whose id is the stub's PID only for its main thread, and the mapping of
  the code it was in), and says how each tritonserver ended (cubeserve/server/supervisor.py);
* at the end, the kernel log's records since the start (/dev/kmsg) that name one of those stubs,
  and glibc's heap-corruption aborts in those logs, are the crashes. Shown, not counted: kernel
  records naming a stub that is none of this run's (another run on the machine), and those of a
  stub that crashed while its tritonserver was being stopped or after it had died, where that
  tritonserver did not end cleanly (tests that break a server on purpose: its stubs lose their
  shared memory under them, or a forward blocked on a killed engine wakes after its stub's
  memory is gone), or was killed by LocalTriton.stop after its timeout (which says so in the log). A stub that crashes while its server runs (an unload), or whose
  server stops and exits cleanly, always counts, and so does one whose death made the supervisor
  stop its server (its log says so: the crash came first).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pytest

from cubeserve.server.local_triton import SERVER_LOGS_ENV

_WHEN = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) cubeserve supervisor: "  # the supervisor's log format
STUB_LINE = re.compile(_WHEN + r"python backend stub (\d+): (\S+) version (\S+) \(tritonserver pid (\d+)"
                       r"((?:; \S+ code at [0-9a-f]+)*)\)")
SERVER_END = re.compile(_WHEN + r"tritonserver \(pid (\d+)\) ended with (signal \d+|exit code -?\d+)")
# LocalTriton.stop's line where it had to SIGKILL the server (and the supervisor, which then says nothing)
SERVER_KILLED = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) cubeserve local server: "
                           r"tritonserver \(pid (\d+)\) killed")
SERVER_STOP = re.compile(_WHEN + r"stopping tritonserver \(pid (\d+)\)")
# A stub the supervisor saw die while its server ran (and stopped the server for it): its crash came
# first, whatever the times say, and always counts.
STUB_DIED = re.compile(_WHEN + r"the python backend stub of (.+?) died while Triton reports it READY "
                       r"\(tritonserver pid (\d+)\)")
# The supervisor writes both lines within its poll (0.5 s) of the event: a crash this much before
# a line still counts as after the event.
MARGIN_S = 1.0
KERNEL_STUB = re.compile(r"\btriton_python_b\[(\d+)\]")  # the kernel's comm (15 characters), thread id
KERNEL_CODE = re.compile(r"\[[0-9a-f]+,([0-9a-f]+)\+[0-9a-f]+\]")  # [offset,mapping start+size]
GLIBC_ABORT = re.compile(r"(?:free|malloc|realloc|munmap_chunk|malloc_consolidate)\(\): "
                         r"(?:invalid|corrupted|unaligned|unsorted|memory corruption)[^\n]*"
                         r"|double free or corruption[^\n]*|corrupted (?:size vs\. prev_size|double-linked list)[^\n]*")

_state: dict = {}


def kernel_records() -> tuple[list[tuple[int, float, str]], str | None]:
    """The kernel log's records still in its buffer, (sequence number, seconds since boot,
    message); and why it could not be read (None when it could)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return [], f"/dev/kmsg: {exc.strerror}"
    records = []
    try:
        while True:
            try:
                raw = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten while being read: go on with the next
                    continue
                return records, f"/dev/kmsg: {exc.strerror}"
            head, _, message = raw.decode(errors="replace").partition(";")
            fields = head.split(",")
            if len(fields) >= 3 and fields[1].isdigit() and fields[2].isdigit():
                records.append((int(fields[1]), int(fields[2]) / 1e6, message.split("\n", 1)[0]))
    finally:
        os.close(fd)
    return records, None


def _wall(logged: str) -> float:
    return datetime.strptime(logged, "%Y-%m-%d %H:%M:%S,%f").timestamp()  # the supervisor's local time


def configure(config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller counts
        return
    folder = tempfile.mkdtemp(prefix="cubeserve-server-logs-")
    os.environ[SERVER_LOGS_ENV] = folder  # inherited by xdist's workers, started after this
    records, unreadable = kernel_records()
    _state.update(folder=Path(folder), since=max((seq for seq, _, _ in records), default=-1), unreadable=unreadable)


def finish(session) -> None:
    if "folder" not in _state:
        return
    folder = _state["folder"]
    stubs, by_code, ending, aborts, logs, died = {}, {}, {}, [], set(), set()
    for entry in sorted(folder.iterdir()):
        log = entry.resolve()
        if log in logs or not log.is_file():
            continue
        logs.add(log)
        text = log.read_text(errors="replace")
        for _, pid, model, version, server, code in STUB_LINE.findall(text):
            stubs[int(pid)] = stub = (int(pid), f"{model} version {version}", int(server), log)
            by_code.update({int(start, 16): stub for start in re.findall(r"code at ([0-9a-f]+)", code)})
        died |= {(int(server), what) for _, names, server in STUB_DIED.findall(text) for what in names.split(", ")}
        stopping = {int(server): _wall(logged) for logged, server in reversed(SERVER_STOP.findall(text))}
        ends = SERVER_END.findall(text) + [(logged, server, "killed") for logged, server in SERVER_KILLED.findall(text)]
        for logged, server, how in ends:
            if how != "exit code 0":  # from the stop, or from its end where nothing stopped it
                ending[int(server)] = min(stopping.get(int(server), _wall(logged)), _wall(logged)) - MARGIN_S
        aborts += [f"{log}: {m.group(0)}" for m in GLIBC_ABORT.finditer(text)]
    records, unreadable = kernel_records()
    boot = time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)  # the kernel's timestamps count from it
    crashes, orphans, elsewhere = [], [], 0
    for seq, since_boot, message in records:
        match = KERNEL_STUB.search(message) if seq > _state["since"] else None
        code = KERNEL_CODE.search(message)
        stub = match and (stubs.get(int(match.group(1))) or (code and by_code.get(int(code.group(1), 16))))
        if stub:
            pid, what, server, log = stub
            line = f"stub {pid} ({what}, tritonserver {server}, log {log}): {message}"
            after_the_stop = server in ending and boot + since_boot >= ending[server] and (server, what) not in died
            (orphans if after_the_stop else crashes).append(line)
        elif match:
            elsewhere += 1
    _state.update(crashes=crashes + aborts, orphans=orphans, stubs=len(stubs), logs=len(logs), elsewhere=elsewhere,
                  unreadable=_state["unreadable"] or unreadable)
    failed = bool(_state["crashes"])
    if failed and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not _state["crashes"]:
        shutil.rmtree(folder, ignore_errors=True)  # kept, with the logs it links to, when it shows a crash


def summary(terminalreporter) -> None:
    if "crashes" not in _state:
        return
    s = _state
    write = terminalreporter.write_line
    terminalreporter.section("python backend stub crashes")
    write(f"{len(s['crashes'])} crashes of the {s['stubs']} python backend stubs of {s['logs']} servers "
          f"(their logs, and the kernel's: a stub's SIGSEGV is in no other)")
    for line in s["crashes"]:
        write(f"  {line}", red=True)
    if s["crashes"]:
        write(f"  the run fails: no stub may crash (the servers' logs are kept in {s['folder']})", red=True)
    for line in s["orphans"]:
        write(f"  not counted, its tritonserver was being stopped or dead, and did not end cleanly: {line}")
    if s["elsewhere"]:
        write(f"  not counted: {s['elsewhere']} kernel records of python backend stubs of no server of this run "
              "(another run on this machine, or a stub gone before its supervisor's first look)")
    if s["unreadable"]:
        # Said loudly, not failed: a machine that hides its kernel log (a container without
        # CAP_SYSLOG) can still run every test; glibc's aborts in the logs are counted anyway.
        write(f"  the kernel log cannot be read ({s['unreadable']}): a stub's SIGSEGV goes uncounted", red=True)
