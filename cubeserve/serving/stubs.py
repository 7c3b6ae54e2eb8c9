"""The python backend's stub processes of a tritonserver, found through /proc (Linux).

Triton runs every python_backend model instance in a process of its own
(`triton_python_backend_stub <repository>/<model>/<version>/model.py ...`, a child of
tritonserver). When one dies (out-of-memory kill, a crash in a kernel), Triton 2.51 neither
restarts it nor reports the model unready: its requests hang or fail while every health
endpoint answers 200. The supervisor and the predict model watch the stubs with this instead.
"""

from __future__ import annotations

from pathlib import Path

STUB_EXECUTABLE = "triton_python_backend_stub"


def _parent_pid(pid_dir: Path) -> int | None:
    try:
        stat = (pid_dir / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
    return int(stat.rsplit(")", 1)[1].split()[1])


def python_stubs(server_pid: int) -> dict[int, tuple[str, str]]:
    """{stub pid: (model name, version)} for the live stub processes of tritonserver `server_pid`."""
    stubs = {}
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or _parent_pid(pid_dir) != server_pid:
            continue
        try:
            args = (pid_dir / "cmdline").read_bytes().split(b"\0")
            state = (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or len(args) < 2 or not args[0].decode(errors="replace").endswith(STUB_EXECUTABLE):
            continue  # a zombie is a dead stub that Triton has not reaped
        model_py = Path(args[1].decode(errors="replace"))
        stubs[int(pid_dir.name)] = (model_py.parent.parent.name, model_py.parent.name)
    return stubs


def stub_alive(server_pid: int, model: str, version: str | int) -> bool:
    return (model, str(version)) in python_stubs(server_pid).values()
