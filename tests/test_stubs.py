"""serving/stubs.py's StubLiveness against real processes that look like python backend stubs
(`triton_python_backend_stub <repository>/<model>/<version>/model.py ... <model>_0_0`) and are
this test's children, as stubs are tritonserver's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from cubeserve.serving import stubs


def fake_stub(tmp_path, model: str, version: str) -> subprocess.Popen:
    """A process whose command line is a stub's: argument 1 its model.py (which this one runs:
    it sleeps), argument 8 its instance name."""
    model_py = tmp_path / model / version / "model.py"
    model_py.parent.mkdir(parents=True, exist_ok=True)
    model_py.write_text("import time\ntime.sleep(120)\n")
    args = [str(tmp_path / stubs.STUB_EXECUTABLE), str(model_py), "shm", "1", "2", "3", "4", "5", f"{model}_0_0"]
    return subprocess.Popen(args, executable=sys.executable)


def test_a_remembered_stub_is_looked_at_alone_until_it_dies_and_a_new_one_is_found(tmp_path, monkeypatch):
    scans = []
    scan = stubs.python_stubs
    monkeypatch.setattr(stubs, "python_stubs", lambda pid: scans.append(pid) or scan(pid))
    first = fake_stub(tmp_path, "cube3d_stream", "1")
    second = None
    try:
        liveness = stubs.StubLiveness(os.getpid())
        assert liveness.alive("cube3d_stream", 1)
        assert liveness.alive("cube3d_stream", "1") and liveness.alive("cube3d_stream", 1)
        assert len(scans) == 1, "a live stub it found is not looked for again"
        assert not liveness.alive("cube3d_stream", 2) and not liveness.alive("cube3d", 1)
        assert len(scans) == 3  # an unknown pair is looked for every time

        first.send_signal(signal.SIGKILL)  # not reaped: a zombie, as a dead stub is until Triton waits
        os.waitid(os.P_PID, first.pid, os.WEXITED | os.WNOWAIT)
        assert not liveness.alive("cube3d_stream", 1), "a dead stub (a zombie) counted as alive"

        second = fake_stub(tmp_path, "cube3d_stream", "1")  # the version loaded again
        assert liveness.alive("cube3d_stream", 1)
        scans.clear()
        assert liveness.alive("cube3d_stream", 1) and not scans
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()
                process.wait()
