"""What the front ends (cubeserve/server/front.py, cubeserve/server/grpc_front.py) add to a
request: the same requests sent alternately to a front end and to tritonserver's own port behind
it (REST, then gRPC), on one server, in one run; p50 and p99 of each, and their difference.

Three kinds: the readiness probe (forwarded as it is), an inference request that the model
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


def alternate(section: str, config: str, ports: dict[str, int], rounds: dict[str, int], send,
              label: str = "") -> tuple[list[Record], list[str]]:
    """Each kind of request sent alternately to two ports (the first: the path measured, the
    second: its baseline) by `send(name, kind)`, so drift hits both alike: p50 and p99 of each
    and what the first adds."""
    measured, baseline = ports
    records = []
    lines = ["| request | via | p50 ms | p99 ms | added p50 ms | added p99 ms |", "|---|---|---:|---:|---:|---:|"]
    for kind, n in rounds.items():
        times = {name: [] for name in ports}
        for i in range(n + 3):  # 3 warm-ups; then alternate
            for name in (list(ports) if i % 2 else list(ports)[::-1]):
                t0 = time.perf_counter()
                send(name, kind)
                if i >= 3:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        p = {name: (statistics.median(t), _percentile(t, 0.99)) for name, t in times.items()}
        added = (p[measured][0] - p[baseline][0], p[measured][1] - p[baseline][1])
        for name in ports:
            lines.append(f"| {kind} | {name} | {p[name][0]:.2f} | {p[name][1]:.2f} | "
                         + (f"{added[0]:+.2f} | {added[1]:+.2f} |" if name == measured else "| |"))
        records.append(Record(section, "cpu", config, label + kind, 1,
                              extra={"rounds": n, "p50_ms": {k: v[0] for k, v in p.items()},
                                     "p99_ms": {k: v[1] for k, v in p.items()},
                                     "added_p50_ms": added[0], "added_p99_ms": added[1]}))
    return records, lines


def compare_latency(section: str, config: str, ports: dict[str, int], rounds: dict[str, int],
                    headers: dict[str, str]) -> tuple[list[Record], list[str]]:
    """The REQUESTS kinds over REST, one kept-alive connection to each port (`alternate`)."""
    connections = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=120) for name, port in ports.items()}

    def send(name, kind):
        method, path, body, expected = REQUESTS[kind]
        conn = connections[name]
        conn.request(method, path, body=body, headers=headers)
        reply = conn.getresponse()
        reply.read()
        assert reply.status == expected, (name, kind, reply.status)

    try:
        return alternate(section, config, ports, rounds, send)
    finally:
        for conn in connections.values():
            conn.close()


def _grpc_calls():
    """kind: (call on a tritonclient.grpc client, whether it must succeed)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    def infer(resolution):
        def call(client):
            prompt = grpcclient.InferInput("PROMPT", [1], "BYTES")
            prompt.set_data_from_numpy(np.array([b"a small ball"], dtype=object))
            res = grpcclient.InferInput("RESOLUTION", [1], "INT32")
            res.set_data_from_numpy(np.array([resolution], dtype=np.int32))
            client.infer("cube3d", [prompt, res], outputs=[grpcclient.InferRequestedOutput("NUM_FACES")])
        return call

    return {"ready": (lambda client: client.is_server_ready(), True), "refused infer": (infer(99), False),
            "generation": (infer(4), True)}


def compare_grpc_latency(section: str, config: str, ports: dict[str, int], rounds: dict[str, int]
                         ) -> tuple[list[Record], list[str]]:
    """The same kinds over gRPC, one channel to each port (`alternate`)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    clients = {name: grpcclient.InferenceServerClient(f"127.0.0.1:{port}") for name, port in ports.items()}
    calls = _grpc_calls()

    def send(name, kind):
        call, succeeds = calls[kind]
        try:
            call(clients[name])
            ok = True
        except InferenceServerException:
            ok = False
        assert ok == succeeds, (name, kind)

    try:
        return alternate(section, config, ports, rounds, send, label="grpc ")
    finally:
        for client in clients.values():
            client.close()


def run(config: str = "tiny") -> tuple[list[Record], list[str]]:
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.deploy import STREAM_MODEL
    from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port

    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_model_repository(Path(tmp) / "models")
        write_random_weights(config, repo / STREAM_MODEL / "1" / "weights", seed=0)
        with LocalTriton(repo, free_port(), free_port(), free_port()) as server:
            ports = {"front end": server.http_port, "tritonserver": server.triton_http_port}
            records, lines = compare_latency("front", config, ports, ROUNDS, {"Content-Type": "application/json"})
            grpc_ports = {"gRPC front end": server.grpc_port, "tritonserver gRPC": server.triton_grpc_port}
            grpc_records, grpc_lines = compare_grpc_latency("front", config, grpc_ports, ROUNDS)
    lines += ["", "One client, one request at a time, a kept-alive connection to each port; "
                  "the front end opens a new connection to tritonserver for every request (by design: "
                  "no idle connection may hold tritonserver's shutdown).", "", "Over gRPC:", "", *grpc_lines,
              "", "One gRPC channel to each port; the gRPC front end keeps one channel to tritonserver, "
                  "parses and checks each inference request and writes it anew."]
    return records + grpc_records, lines
