"""The server's overhead: time per object through Triton (REST and gRPC) against the engine in
process, same weights, same requests, same run.

On a machine shared with other work the engine's own time swings from one second to the next,
so the paths take turns: one at a time, each object goes in process, then over REST, then over
gRPC, for ROUNDS rounds, and each path's figure is the median of its objects; all at once, each
path sends its OBJECTS objects together, in turn, ROUNDS times, and the figure is the median
round. The in-process engine stays loaded while the server runs (its threads wait, idle); the
server is idle while the engine runs in process. "outside the engine" is a path's median of
(the client's time - the engine's TIMINGS total_s): the server's own part, apart from how fast
the engine was at that moment (the mesh file's export is in it: the in-process path makes none).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.common import Record

OBJECTS = 8
RESOLUTION = 5
ROUNDS = 5
PATHS = ("in process", "Triton http", "Triton grpc")


def run(config: str = "tiny", rounds: int = ROUNDS) -> tuple[list[Record], list[str]]:
    from cube3d_client import Cube3DClient
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.engine import Engine, GenerationRequest
    from cubeserve.engine.scheduler import Scheduler
    from cubeserve.deploy import STREAM_MODEL
    from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port

    prompts = [f"bench object {i}" for i in range(OBJECTS)]
    records, lines = [], []
    one: dict[str, list[tuple[float, float]]] = {path: [] for path in PATHS}  # (client s, engine total_s)
    many: dict[str, list[float]] = {path: [] for path in PATHS}  # seconds per object, per round
    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_model_repository(Path(tmp) / "models")
        weights = write_random_weights(config, repo / STREAM_MODEL / "1" / "weights", seed=0)

        engine = Engine.from_dir(weights, device="cpu")
        device = str(engine.device)
        with Scheduler(engine, max_objects=OBJECTS) as sched, \
                LocalTriton(repo, free_port(), free_port(), free_port()) as server:
            clients = {"Triton http": Cube3DClient(server.http_url, "http"),
                       "Triton grpc": Cube3DClient(server.grpc_url, "grpc")}

            def generate(path: str, prompt: str) -> float:
                """One object on `path`; the engine's total_s."""
                if path == "in process":
                    return sched.generate(GenerationRequest(prompt, resolution=RESOLUTION)).timings["total_s"]
                return clients[path].generate(prompt, resolution=RESOLUTION).timings["total_s"]

            def all_at_once(path: str) -> None:
                if path == "in process":
                    tickets = [sched.submit(GenerationRequest(p, resolution=RESOLUTION)) for p in prompts]
                    for t in tickets:
                        t.result()
                    return
                url, protocol = clients[path].url, clients[path].protocol

                def call(p):
                    with Cube3DClient(url, protocol) as c:
                        c.generate(p, resolution=RESOLUTION)

                threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()

            try:
                for path in PATHS:  # warm-up
                    generate(path, prompts[0])
                for _ in range(rounds):
                    for prompt in prompts:
                        for path in PATHS:
                            t0 = time.perf_counter()
                            total = generate(path, prompt)
                            one[path].append((time.perf_counter() - t0, total))
                for _ in range(rounds):
                    for path in PATHS:
                        t0 = time.perf_counter()
                        all_at_once(path)
                        many[path].append((time.perf_counter() - t0) / OBJECTS)
            finally:
                for client in clients.values():
                    client.close()

    measured = {path: statistics.median(s for s, _ in one[path]) for path in PATHS}
    outside = {path: statistics.median(s - total for s, total in one[path]) for path in PATHS}
    concurrent = {path: statistics.median(many[path]) for path in PATHS}
    lines.append(f"Server overhead, config `{config}`, resolution {RESOLUTION}, {OBJECTS} objects, one at a time "
                 f"and all at once, the paths taking turns for {rounds} rounds (seconds per object, wall clock, "
                 f"median):")
    lines.append("")
    lines.append(f"| path | one at a time | outside the engine (one at a time) | {OBJECTS} concurrent | "
                 "overhead vs in process (one at a time) |")
    lines.append("|---|---|---|---|---|")
    for path in PATHS:
        ratio = measured[path] / measured["in process"]
        lines.append(f"| {path} | {measured[path] * 1e3:.1f} ms | {outside[path] * 1e3:.1f} ms | "
                     f"{concurrent[path] * 1e3:.1f} ms | {ratio:.2f}x |")
        for flight, value in ((1, measured[path]), (OBJECTS, concurrent[path])):
            extra = {"seconds_per_object": value, "rounds": rounds}
            if flight == 1:
                extra["outside_engine_seconds"] = outside[path]
            records.append(Record("server_overhead", device, config, path, flight,
                                  objects_per_second=1.0 / value, extra=extra))
    return records, lines
