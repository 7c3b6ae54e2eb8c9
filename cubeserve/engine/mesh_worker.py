"""scikit-image's marching cubes in a process of its own, so that it never stalls decoding.

`skimage.measure.marching_cubes` holds the GIL through most of its run, and while it does,
the decode thread cannot launch its next step: every object in flight waits for another
object's mesh (BENCHMARKS.md, "Geometry beside decoding", measures it). A
`MeshWorker` sends the grid through a pipe to a child process and waits for the reply with the
GIL released.

The child is this module run by the same interpreter (`python -m cubeserve.engine.mesh_worker`):
it imports numpy and scikit-image, not torch. It exits when its stdin closes, so it never
outlives its parent, also when the parent is killed (a Triton stub's SIGKILL closes the pipe).
When the child cannot be started or dies, the mesh is made in the calling process instead: a
request is never lost to the worker.

Messages, both ways: an 8-byte little-endian length, a JSON header, then the arrays it names
(dtype, shape) as raw bytes in that order.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading

import numpy as np

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")


def lewiner(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(vertices [V, 3] in grid index units, faces [F, 3]) of the surface at level 0 of a
    float32 grid [n, n, n]: scikit-image's Lewiner marching cubes, in this process."""
    from skimage import measure

    vertices, faces, _, _ = measure.marching_cubes(grid, level=0.0, method="lewiner")
    return vertices, faces


# -- messages -------------------------------------------------------------------------------------

def _send(stream, header: dict, arrays: list[np.ndarray]) -> None:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = dict(header, arrays=[[a.dtype.str, list(a.shape)] for a in arrays])
    encoded = json.dumps(header).encode()
    stream.write(_LENGTH.pack(len(encoded)) + encoded)
    for a in arrays:
        stream.write(memoryview(a).cast("B"))  # large writes go straight to the pipe, GIL released
    stream.flush()


def _read_exactly(stream, n: int) -> bytearray:
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        read = stream.readinto(view[got:])
        if not read:
            raise EOFError("the other end of the mesh worker's pipe closed")
        got += read
    return buffer


def _receive(stream) -> tuple[dict, list[np.ndarray]]:
    (length,) = _LENGTH.unpack(_read_exactly(stream, _LENGTH.size))
    header = json.loads(_read_exactly(stream, length))
    arrays = []
    for dtype, shape in header.pop("arrays"):
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(_read_exactly(stream, count * dtype.itemsize), dtype=dtype).reshape(shape))
    return header, arrays


# -- the parent's side ----------------------------------------------------------------------------

def _interpreter() -> str | None:
    """This interpreter, also inside an embedding program (Triton's python backend stub, whose
    sys.executable may be the stub itself): the `python3` first on PATH there, as the stub's."""
    if sys.executable and os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    return shutil.which("python3")


class MeshWorker:
    """One child process running `lewiner`, started on first use; one call at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._unavailable = False  # the child could not be started: mesh in process from then on

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def lewiner(self, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As the module's `lewiner`, run in the child (in this process where there is none)."""
        grid = np.ascontiguousarray(grid, dtype=np.float32)
        with self._lock:
            if self._unavailable or not self._started():
                return lewiner(grid)
            try:
                _send(self._process.stdin, {}, [grid])
                header, arrays = _receive(self._process.stdout)
            except (OSError, EOFError, ValueError) as exc:  # the child died (or garbled the pipe)
                log.warning("the marching cubes worker (pid %s) failed (%s); this mesh is made in process "
                            "and a new worker starts for the next", self.pid, exc)
                self._stop_process()
                return lewiner(grid)
        if "error" in header:
            raise RuntimeError(f"marching cubes failed: {header['error']}")
        return arrays[0], arrays[1]

    def _started(self) -> bool:
        if self._process is not None and self._process.poll() is None:
            return True
        self._stop_process()
        python = _interpreter()
        try:
            if python is None:
                raise OSError("no python3 interpreter found")
            env = dict(os.environ, OMP_NUM_THREADS="1")
            self._process = subprocess.Popen([python, "-m", __name__], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, env=env)
            header, _ = _receive(self._process.stdout)  # it says it is ready once scikit-image imported
            if not header.get("ready"):
                raise OSError(f"unexpected first message {header}")
        except (OSError, EOFError, ValueError) as exc:
            log.warning("the marching cubes worker could not start (%s); marching cubes runs in this process", exc)
            self._stop_process()
            self._unavailable = True
            return False
        log.info("marching cubes worker started (pid %d)", self._process.pid)
        return True

    def _stop_process(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        for stream in (process.stdin, process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:  # a closed stdin makes it exit
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def close(self) -> None:
        with self._lock:
            self._stop_process()


# -- the child's side -----------------------------------------------------------------------------

def serve(stdin, stdout) -> None:
    """Answer grids with their surfaces until stdin closes."""
    importlib.import_module("skimage.measure")  # before saying ready: the first mesh pays no import
    _send(stdout, {"ready": True}, [])
    while True:
        try:
            _, (grid,) = _receive(stdin)
        except EOFError:
            return
        try:
            vertices, faces = lewiner(grid)
        except Exception as exc:  # the parent raises it for this mesh; the worker goes on
            _send(stdout, {"error": f"{type(exc).__name__}: {exc}"}, [])
            continue
        _send(stdout, {}, [vertices, faces])


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
