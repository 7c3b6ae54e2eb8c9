"""Decode steps with marching cubes running beside them, on the CPU.

A `DecodeRunner` steps on a decode thread (the thread that built it hands its OpenMP workers
back first, as the scheduler does) for a fixed time, refilling slots as objects finish; only
`runner.step()` is timed. Beside it, a geometry thread (one OpenMP thread, as the scheduler's
while objects decode) runs `geometry.marching_cubes` back to back on a sphere's occupancy grid
at a high resolution (257^3 at resolution 8), either in this process ("in-process") or in the
marching cubes worker process the scheduler uses ("worker"); "alone" has no geometry. The modes
take turns for a few rounds, so that a shared machine's drift reaches them all alike.

Also measured: how long one marching cubes call keeps a pure-Python ticker thread from running
(its longest gap between ticks), with nothing else running.

    python -m bench.geometry_beside_decode [--config mid] [--objects 4] [--resolution 8]
                                           [--seconds 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from bench.common import hardware

def sphere_grid(resolution: int) -> torch.Tensor:
    """Occupancy logits of a sphere of radius 0.8: positive inside, [n, n, n] fp32."""
    from cubeserve.engine import geometry

    axis = geometry.grid_axis(resolution)
    x, y, z = torch.meshgrid(axis, axis, axis, indexing="ij")
    return (0.8 - (x * x + y * y + z * z).sqrt()).contiguous()


def mesh_workers() -> dict:
    """The marching cubes paths to compare: {mode: worker or None}."""
    modes = {"in-process": None}
    try:
        from cubeserve.engine.mesh_worker import MeshWorker
    except ImportError:  # before the worker existed
        return modes
    modes["worker"] = MeshWorker()
    return modes


def ticker_gap(call) -> tuple[float, float, int]:
    """(seconds of call(), a pure-Python ticker thread's longest gap during it, its ticks)."""
    stop = threading.Event()
    gaps = {"longest": 0.0, "ticks": 0}

    def tick():
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            gaps["longest"] = max(gaps["longest"], now - last)
            gaps["ticks"] += 1
            last = now

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.05)
    gaps["longest"], gaps["ticks"] = 0.0, 0
    t0 = time.perf_counter()
    call()
    seconds = time.perf_counter() - t0
    stop.set()
    thread.join()
    return seconds, gaps["longest"], gaps["ticks"]


def decode_for(runner, requests, seconds: float) -> list[float]:
    """Step `runner` for `seconds` on this thread, refilling free slots; each step's seconds."""
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        free = runner.free_slots
        if free:
            runner.admit(requests[: len(free)])
        t0 = time.perf_counter()
        out = runner.step()
        times.append(time.perf_counter() - t0)
        for slot in out.finished:
            runner.release(slot)
    return times


def run_mode(runner, requests, grid, resolution: int, worker, geometry_on: bool, seconds: float):
    """Decode for `seconds` on a decode thread with (or without) marching cubes beside it:
    (step seconds, marching cubes calls finished)."""
    from cubeserve.engine import geometry
    from cubeserve.engine.threads import set_thread_openmp_threads

    stop = threading.Event()
    calls = [0]
    steps: list[float] = []

    def geometry_loop():
        set_thread_openmp_threads(1)
        while not stop.is_set():
            kwargs = {"worker": worker} if worker is not None else {}
            geometry.marching_cubes(grid, resolution, **kwargs)
            calls[0] += 1

    def decode_loop():
        steps.extend(decode_for(runner, requests, seconds))

    side = threading.Thread(target=geometry_loop, name="bench-geometry") if geometry_on else None
    decode = threading.Thread(target=decode_loop, name="bench-decode")
    if side:
        side.start()
    decode.start()
    decode.join()
    stop.set()
    if side:
        side.join()
    return steps, calls[0]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="mid")
    parser.add_argument("--objects", type=int, default=4, help="objects in flight")
    parser.add_argument("--resolution", type=int, default=8, help="marching cubes grid: 2^r + 1 per axis")
    parser.add_argument("--seconds", type=float, default=8.0, help="decode time per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from bench.engine_speed import build_engine
    from cubeserve.engine import GenerationRequest, geometry
    from cubeserve.engine.threads import release_openmp_workers

    device = torch.device("cpu")
    engine = build_engine(args.config, device, torch.float32)
    runner = engine.decode_runner(args.objects, graph_buckets=None)
    requests = [GenerationRequest(f"benchmark object {i}") for i in range(args.objects)]
    grid = sphere_grid(args.resolution)
    workers = mesh_workers()
    n = geometry.grid_size(args.resolution)

    print(f"# {hardware(device)}, torch {torch.__version__}, config {args.config}, "
          f"{args.objects} objects in flight, marching cubes on a {n}^3 grid")
    gil = {}
    for mode, worker in workers.items():
        kwargs = {"worker": worker} if worker is not None else {}
        t0 = time.perf_counter()
        mesh = geometry.marching_cubes(grid, args.resolution, **kwargs)  # warm (and start the worker)
        first = time.perf_counter() - t0
        seconds, gap, ticks = min((ticker_gap(lambda: geometry.marching_cubes(grid, args.resolution, **kwargs))
                                   for _ in range(3)), key=lambda r: r[1])
        gil[mode] = (seconds, gap, ticks)
        print(f"{mode}: first call {first:.3f} s; a call {seconds:.3f} s ({len(mesh.faces)} faces), "
              f"the ticker's longest gap {gap * 1e3:.1f} ms ({ticks} ticks)")

    release_openmp_workers()  # the decode thread owns the OpenMP team, as in the scheduler
    modes = [("alone", None, False)] + [(m, w, True) for m, w in workers.items()]
    steps = {m: [] for m, _, _ in modes}
    calls = {m: 0 for m, _, _ in modes}
    run_mode(runner, requests, grid, args.resolution, None, False, 1.0)  # warm-up
    for _ in range(args.rounds):
        for mode, worker, geometry_on in modes:
            s, c = run_mode(runner, requests, grid, args.resolution, worker, geometry_on, args.seconds)
            steps[mode] += s
            calls[mode] += c
    for worker in workers.values():
        if worker is not None:
            worker.close()

    print()
    print("| geometry beside decoding | steps | step p50 ms | p90 ms | p99 ms | max ms | marching cubes calls "
          "| ticker's longest gap in one call ms |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, _, _ in modes:
        s = steps[mode]
        p = {q: percentile(s, q) * 1e3 for q in (50, 90, 99, 100)}
        gap = gil[mode][1] if mode in gil else None
        print(f"| {mode} | {len(s)} | {p[50]:.1f} | {p[90]:.1f} | {p[99]:.1f} | {p[100]:.1f} | {calls[mode]} | "
              f"{'-' if gap is None else f'{gap * 1e3:.0f}'} |")


if __name__ == "__main__":
    main()
