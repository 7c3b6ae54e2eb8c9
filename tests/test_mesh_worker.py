"""Marching cubes in a child process (`cubeserve.engine.mesh_worker`): the same mesh as in
process, the GIL free for the decode thread while it runs, and faults that never lose a mesh:
a killed worker is replaced, a failed call fails that mesh alone, a killed parent takes its
worker with it."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from cubeserve.engine import GenerationRequest as Req
from cubeserve.engine import geometry, mesh_worker
from cubeserve.engine.mesh_worker import MeshWorker
from cubeserve.engine.scheduler import Scheduler


def sphere(resolution: int) -> torch.Tensor:
    axis = geometry.grid_axis(resolution)
    x, y, z = torch.meshgrid(axis, axis, axis, indexing="ij")
    return (0.8 - (x * x + y * y + z * z).sqrt()).contiguous()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone_within(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def worker():
    w = MeshWorker()
    yield w
    w.close()


def test_the_worker_makes_the_in_process_mesh_in_a_child_process(worker):
    grid = sphere(6)
    here = geometry.marching_cubes(grid, 6)
    there = geometry.marching_cubes(grid, 6, worker=worker)
    assert worker.pid is not None and worker.pid != os.getpid()
    assert len(there.faces) > 1000
    np.testing.assert_array_equal(there.faces, here.faces)
    np.testing.assert_array_equal(there.vertices, here.vertices)


def longest_gap_of_a_python_thread_during(call) -> tuple[float, float]:
    """(the call's seconds, the longest pause of a pure-Python thread's loop during it)."""
    stop, longest = threading.Event(), [0.0]

    def tick():
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            longest[0] = max(longest[0], now - last)
            last = now

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.05)
    longest[0] = 0.0
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    stop.set()
    thread.join()
    return seconds, longest[0]


def test_while_the_worker_meshes_other_python_threads_run(worker):
    """In process, scikit-image holds the GIL through most of the call: another thread (the
    decode thread) stops for long stretches. Through the worker it keeps running."""
    grid = sphere(8).numpy()
    worker.lewiner(grid)  # started and warm
    _, stalled = longest_gap_of_a_python_thread_during(lambda: mesh_worker.lewiner(grid))
    seconds, gap = longest_gap_of_a_python_thread_during(lambda: worker.lewiner(grid))
    assert gap < 0.5 * stalled and gap < 0.25 * seconds, (
        f"a {gap:.3f} s pause in a {seconds:.3f} s call through the worker, {stalled:.3f} s in process")


def test_a_killed_worker_costs_no_mesh_and_is_replaced(worker):
    grid = sphere(7).numpy()
    expected = mesh_worker.lewiner(grid)
    worker.lewiner(grid)
    first = worker.pid
    killer = threading.Timer(0.01, os.kill, (first, signal.SIGKILL))
    killer.start()  # during the next call (or before it: the pipe is dead either way)
    vertices, faces = worker.lewiner(grid)
    killer.join()
    np.testing.assert_array_equal(faces, expected[1])
    np.testing.assert_array_equal(vertices, expected[0])
    worker.lewiner(grid)
    assert worker.pid not in (None, first) and alive(worker.pid)


def test_a_failing_call_fails_that_mesh_and_the_worker_goes_on(worker):
    worker.lewiner(sphere(5).numpy())
    pid = worker.pid
    with pytest.raises(RuntimeError, match="marching cubes failed: ValueError"):
        worker.lewiner(np.ones((9, 9, 9), np.float32))  # no surface at level 0: scikit-image refuses
    assert worker.pid == pid
    vertices, faces = worker.lewiner(sphere(5).numpy())
    assert len(faces) > 0


def test_a_killed_parent_takes_its_worker_with_it(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import numpy as np, sys, time
        from cubeserve.engine.mesh_worker import MeshWorker
        worker = MeshWorker()
        grid = np.linspace(-1, 1, 27, dtype=np.float32).reshape(3, 3, 3)
        worker.lewiner(grid)
        print(worker.pid, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert alive(pid)
        parent.kill()
        parent.wait()
        assert gone_within(pid, 10), "the worker outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()


def test_a_worker_that_cannot_start_leaves_marching_cubes_in_process(monkeypatch):
    monkeypatch.setattr(mesh_worker, "_interpreter", lambda: "/nonexistent/python3")
    worker = MeshWorker()
    grid = sphere(5).numpy()
    vertices, faces = worker.lewiner(grid)
    np.testing.assert_array_equal(faces, mesh_worker.lewiner(grid)[1])
    assert worker.pid is None


def test_the_scheduler_meshes_in_its_worker_and_stops_it(make_engine):
    engine = make_engine("tiny", "reference")
    request = Req("a round table", resolution=6)
    expected = engine.generate([request])[0].mesh
    sched = Scheduler(engine, max_objects=2).start()
    try:
        mesh = sched.submit(request).result(timeout=120).mesh
        pid = sched._mesh_worker.pid
    finally:
        sched.stop()
    assert pid is not None and not expected.empty
    np.testing.assert_array_equal(mesh.faces, expected.faces)
    np.testing.assert_array_equal(mesh.vertices, expected.vertices)
    assert gone_within(pid, 10)
