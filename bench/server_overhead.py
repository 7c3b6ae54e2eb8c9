"""The server's overhead: time per object through Triton (REST and gRPC) against the engine in
process, same weights, same requests, same run."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from bench.common import Record

OBJECTS = 8
RESOLUTION = 5


def run(config: str = "tiny") -> tuple[list[Record], list[str]]:
    from cube3d_client import Cube3DClient
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.engine import Engine, GenerationRequest
    from cubeserve.engine.scheduler import Scheduler
    from cubeserve.deploy import STREAM_MODEL
    from cubeserve.serving.local_triton import LocalTriton, copy_model_repository, free_port

    prompts = [f"bench object {i}" for i in range(OBJECTS)]
    records, lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_model_repository(Path(tmp) / "models")
        weights = write_random_weights(config, repo / STREAM_MODEL / "1" / "weights", seed=0)

        engine = Engine.from_dir(weights, device="cpu")
        device = str(engine.device)
        requests = [GenerationRequest(p, resolution=RESOLUTION) for p in prompts]
        with Scheduler(engine, max_objects=OBJECTS) as sched:
            sched.generate(requests[0])  # warm-up
            t0 = time.perf_counter()
            for r in requests:
                sched.generate(r)
            sequential = (time.perf_counter() - t0) / OBJECTS
            t0 = time.perf_counter()
            for t in [sched.submit(r) for r in requests]:
                t.result()
            concurrent = (time.perf_counter() - t0) / OBJECTS
        measured = {("in process", 1): sequential, ("in process", OBJECTS): concurrent}

        with LocalTriton(repo, free_port(), free_port(), free_port()) as server:
            for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
                with Cube3DClient(url, protocol) as client:
                    client.generate(prompts[0], resolution=RESOLUTION)  # warm-up
                    t0 = time.perf_counter()
                    for p in prompts:
                        client.generate(p, resolution=RESOLUTION)
                    measured[(f"Triton {protocol}", 1)] = (time.perf_counter() - t0) / OBJECTS

                def call(p, protocol=protocol, url=url):
                    with Cube3DClient(url, protocol) as c:
                        c.generate(p, resolution=RESOLUTION)

                threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                measured[(f"Triton {protocol}", OBJECTS)] = (time.perf_counter() - t0) / OBJECTS

    lines.append(f"Server overhead, config `{config}`, resolution {RESOLUTION}, {OBJECTS} objects, one at a time "
                 f"and all at once (seconds per object, wall clock):")
    lines.append("")
    lines.append("| path | one at a time | 8 concurrent | overhead vs in process (one at a time) |")
    lines.append("|---|---|---|---|")
    for path in ("in process", "Triton http", "Triton grpc"):
        one, many = measured[(path, 1)], measured[(path, OBJECTS)]
        ratio = one / measured[("in process", 1)]
        lines.append(f"| {path} | {one * 1e3:.1f} ms | {many * 1e3:.1f} ms | {ratio:.2f}x |")
        for flight, value in ((1, one), (OBJECTS, many)):
            records.append(Record("server_overhead", device, config, path, flight,
                                  objects_per_second=1.0 / value, extra={"seconds_per_object": value}))
    return records, lines
