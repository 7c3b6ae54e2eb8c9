"""What the REST front end (cubeserve/serving/front.py) adds to a request: the same requests sent
alternately to the front end and to tritonserver's own REST port behind it, on one server, in
one run; p50 and p99 of each, and their difference.

Three kinds: the readiness probe (a GET forwarded as it is), an inference request that the model
refuses (a full trip through the front end's checks, Triton and the python backend, no
generation), and a whole generation of the tiny model."""

from __future__ import annotations

import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import Record

ROUNDS = {"ready": 400, "refused infer": 200, "generation": 48}


def _body(resolution: int) -> bytes:
    return json.dumps({"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a small ball"]},
                                  {"name": "RESOLUTION", "datatype": "INT32", "shape": [1], "data": [resolution]}],
                       "outputs": [{"name": "NUM_FACES"}]}).encode()


REQUESTS = {  # kind: (method, path, body, expected status)
    "ready": ("GET", "/v2/health/ready", None, 200),
    "refused infer": ("POST", "/v2/models/cube3d/infer", _body(99), 400),  # RESOLUTION out of range
    "generation": ("POST", "/v2/models/cube3d/infer", _body(4), 200),
}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def compare_latency(section: str, config: str, ports: dict[str, int], rounds: dict[str, int],
                    headers: dict[str, str]) -> tuple[list[Record], list[str]]:
    """The REQUESTS kinds sent alternately to two ports (the first: the path measured, the second:
    its baseline), one kept-alive connection each, so drift hits both alike: p50 and p99 of
    each and what the first adds."""
    measured, baseline = ports
    records = []
    lines = ["| request | via | p50 ms | p99 ms | added p50 ms | added p99 ms |", "|---|---|---:|---:|---:|---:|"]
    connections = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=120) for name, port in ports.items()}
    for kind, n in rounds.items():
        method, path, body, expected = REQUESTS[kind]
        times = {name: [] for name in ports}
        for i in range(n + 3):  # 3 warm-ups; then alternate
            for name in (list(ports) if i % 2 else list(ports)[::-1]):
                conn = connections[name]
                t0 = time.perf_counter()
                conn.request(method, path, body=body, headers=headers)
                reply = conn.getresponse()
                reply.read()
                elapsed = time.perf_counter() - t0
                assert reply.status == expected, (name, kind, reply.status)
                if i >= 3:
                    times[name].append(elapsed * 1e3)
        p = {name: (statistics.median(t), _percentile(t, 0.99)) for name, t in times.items()}
        added = (p[measured][0] - p[baseline][0], p[measured][1] - p[baseline][1])
        for name in ports:
            lines.append(f"| {kind} | {name} | {p[name][0]:.2f} | {p[name][1]:.2f} | "
                         + (f"{added[0]:+.2f} | {added[1]:+.2f} |" if name == measured else "| |"))
        records.append(Record(section, "cpu", config, kind, 1,
                              extra={"rounds": n, "p50_ms": {k: v[0] for k, v in p.items()},
                                     "p99_ms": {k: v[1] for k, v in p.items()},
                                     "added_p50_ms": added[0], "added_p99_ms": added[1]}))
    for conn in connections.values():
        conn.close()
    return records, lines


def run(config: str = "tiny") -> tuple[list[Record], list[str]]:
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.deploy import STREAM_MODEL
    from cubeserve.serving.local_triton import LocalTriton, copy_model_repository, free_port

    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_model_repository(Path(tmp) / "models")
        write_random_weights(config, repo / STREAM_MODEL / "1" / "weights", seed=0)
        with LocalTriton(repo, free_port(), free_port(), free_port()) as server:
            ports = {"front end": server.http_port, "tritonserver": server.triton_http_port}
            records, lines = compare_latency("front", config, ports, ROUNDS, {"Content-Type": "application/json"})
    lines += ["", "One client, one request at a time, a kept-alive connection to each port; "
                  "the front end opens a new connection to tritonserver for every request (by design: "
                  "no idle connection may hold tritonserver's shutdown)."]
    return records, lines
